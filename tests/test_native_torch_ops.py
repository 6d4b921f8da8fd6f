"""The native ops as torch.library custom ops (kernels/native/ops.py, ``torch.ops.hybrid.*``): their schemas, fake
implementations and declared mutations checked by ``torch.library.opcheck``, one op traced whole by
``torch.compile(fullgraph=True)`` and ``torch.export``, and the one-line argument errors each op's check gives
(the argument, what it got, what it needs) where a bad call would otherwise have read or written out of bounds."""

from __future__ import annotations

import pytest
import torch
from hybrid.kernels import native, ssd
from hybrid.kernels.native import ops

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")

OPS = ("ssd_step", "gdn_step", "conv_step", "paged_decode", "gla_step", "l2norm_heads", "gdn_gates", "gla_decay",
       "gdn_ut_solve", "gdn_chunk_prep", "selective_scan", "linear", "linear_int4", "linear_q")


def _ssd_args(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n, H, P, N, G = 3, 4, 8, 16, 2
    state = torch.randn(n, H, P, N, generator=g)
    x = torch.randn(n, H, P, generator=g).to(dtype)
    dt, A = torch.rand(n, H, generator=g), -torch.rand(H, generator=g)
    B, C = torch.randn(n, G, N, generator=g).to(dtype), torch.randn(n, G, N, generator=g).to(dtype)
    D = torch.randn(H, generator=g)
    return state, x, dt, A, B, C, D, None


def _sample_args() -> dict[str, tuple]:
    g = torch.Generator().manual_seed(5)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    n, H, K, V = 2, 4, 16, 16
    conv = (r(n, 24, 3), r(n, 24), r(24, 4), r(24), "silu", None)
    gdn = (r(n, H, K, V), r(n, 2, K), r(n, 2, K), r(n, H, V), -torch.rand(n, H, generator=g),
           torch.rand(n, H, generator=g), None, None)
    gla = (r(n, H, K, V), r(n, H, K), r(n, H, K), r(n, H, V), -torch.rand(n, H, K, generator=g), None, None)
    pages = (r(n, 4, 16), r(6, 4, 2, 16), r(6, 4, 2, 16), torch.tensor([5, 9], dtype=torch.int32),
             torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32), None, None)
    tri = torch.tril(r(n, H, 8, 8), -1) * 0.1
    prep = (r(1, 2, 8, K), r(1, 2, 8, K), r(1, 2, 8, 8), r(1, 2, 8, 8), -torch.rand(1, 4, 8, generator=g).cumsum(-1),
            torch.rand(1, 4, 8, generator=g), r(1, 4, 8, V))
    scan = (r(40, 19), torch.rand(40, 19, generator=g), -torch.rand(19, 16, generator=g), r(40, 16), r(40, 16),
            torch.tensor([0, 25, 40]), r(19), r(2, 19, 16))
    products = {
        "linear": (r(2, 64), r(48, 64), r(48), r(2, 48), None),
        "linear_int4": (r(3, 128), torch.randint(0, 256, (32, 64), dtype=torch.uint8, generator=g),
                        r(4, 32, 2) * 0.1, 32, None, None, 64),
        "linear_q": (r(2, 64), 0, torch.randint(-128, 128, (40, 64), dtype=torch.int8, generator=g),
                     torch.rand(40, generator=g) * 0.01, r(40), None),
    }
    return products | {
        "ssd_step": _ssd_args(), "conv_step": conv, "gdn_step": gdn, "gla_step": gla, "paged_decode": pages,
        "l2norm_heads": (r(3, H, K), 1e-6), "gdn_gates": (r(3, H), r(3, H), r(H), r(H)),
        "gla_decay": (r(3, 32), 16.0, None), "gdn_ut_solve": (tri, r(n, H, 8, 5)), "gdn_chunk_prep": prep,
        "selective_scan": scan}


def test_every_op_has_a_schema_and_a_sample():
    assert set(_sample_args()) == set(OPS)
    for name in OPS:
        schema = str(getattr(torch.ops.hybrid, name).default._schema)
        assert schema.startswith(f"hybrid::{name}(")


@pytest.mark.parametrize("name", OPS)
def test_opcheck(name):
    """Schema (mutations declared), fake tensors, autograd registration and AOT dispatch, on real arguments."""
    torch.library.opcheck(getattr(torch.ops.hybrid, name).default, _sample_args()[name])


def _ssd_then_torch(state, x, dt, A, B, C, D):
    y = torch.ops.hybrid.ssd_step(state, x, dt, A, B, C, D)
    return torch.nn.functional.silu(y) * 2.0, state.sum()


def test_an_op_compiles_whole_and_mutates_its_state():
    """torch.compile(fullgraph=True): no graph break at the op (its fake gives the output's shape), and the
    compiled call updates the state in place as the eager call does."""
    state, x, dt, A, B, C, D, _ = _ssd_args(seed=3)
    eager_state, compiled_state = state.clone(), state.clone()
    y_eager, s_eager = _ssd_then_torch(eager_state, x, dt, A, B, C, D)
    compiled = torch.compile(_ssd_then_torch, fullgraph=True, backend="aot_eager")
    y, s = compiled(compiled_state, x, dt, A, B, C, D)
    assert torch.equal(y, y_eager) and torch.equal(s, s_eager) and torch.equal(compiled_state, eager_state)
    # against the op's reference too (the compiled graph runs the same kernel)
    ref_state = state.clone()
    y_ref = ssd.ssd_step_ref(ref_state, x, dt, A, B, C, D=D)
    assert (y_eager / 2.0 - torch.nn.functional.silu(y_ref)).abs().max() < 1e-5
    assert (compiled_state - ref_state).abs().max() < 1e-5


def test_an_op_exports():
    class Scan(torch.nn.Module):
        def forward(self, x, dt, A, B, C, cu):
            return torch.ops.hybrid.selective_scan(x, dt, A, B, C, cu)

    args = _sample_args()["selective_scan"][:6]
    ep = torch.export.export(Scan(), args)
    assert any(n.target is torch.ops.hybrid.selective_scan.default for n in ep.graph.nodes)
    y, h = ep.module()(*args)
    y_eager, h_eager = torch.ops.hybrid.selective_scan(*args)
    assert torch.equal(y, y_eager) and torch.equal(h, h_eager)


def test_bad_arguments_raise_one_line_naming_the_argument():
    state, x, dt, A, B, C, D, _ = _ssd_args()
    op = torch.ops.hybrid.ssd_step
    cases = [  # (the change, what the message names)
        (dict(x=x.half()), "x is torch.float16"),
        (dict(state=state[:, :, :, :8]), "state has strides"),
        (dict(state=state[:2]), "state has shape [2, 4, 8, 16]"),
        (dict(dt=dt.double()), "dt is torch.float64"),
        (dict(A=A[:3]), "A has shape [3]"),
        (dict(B=B.bfloat16()), "B is torch.bfloat16"),
        (dict(C=C[:, :, :8]), "C has shape [3, 2, 8]"),
        (dict(x=x.transpose(1, 2).contiguous().transpose(1, 2)), "x has strides"),
        (dict(slots=torch.tensor([0, 1, 2], dtype=torch.int32)), "slots is torch.int32"),
        (dict(B=torch.randn(3, 3, 16), C=torch.randn(3, 3, 16)), "divides the 4 heads"),
    ]
    for change, expected in cases:
        args = dict(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, slots=None) | change
        with pytest.raises(ValueError) as e:
            op(**args)
        msg = str(e.value)
        assert msg.startswith("hybrid::ssd_step: ") and expected in msg and "; it needs " in msg, msg
        assert "\n" not in msg
        # the dispatch's per-call check gives the same reason, so the torch path takes such a call
        assert ops.supports_ssd_step(args["state"], args["x"], args["dt"], args["A"], args["B"], args["C"], D=D,
                                     slots=args["slots"]) == msg


def test_every_op_checks_its_arguments():
    """One wrong argument per op (a dtype, a shape, a layout the kernel would misread): a ValueError naming it."""
    s = _sample_args()
    wrong = {
        "conv_step": (1, s["conv_step"][1].double(), "x is torch.float64"),
        "gdn_step": (4, s["gdn_step"][4].bfloat16(), "g is torch.bfloat16"),
        "gla_step": (3, s["gla_step"][3][:, :3].contiguous(), "v has shape [2, 3, 16]"),
        "paged_decode": (3, s["paged_decode"][3].long(), "seq_lens is torch.int64"),
        "l2norm_heads": (0, s["l2norm_heads"][0][:, :, :8], "x has strides"),
        "gdn_gates": (2, s["gdn_gates"][2][:3], "A_log has shape [3]"),
        "gla_decay": (0, s["gla_decay"][0].t(), "x has strides"),
        "gdn_ut_solve": (1, s["gdn_ut_solve"][1][:, :, :7], "X has shape"),
        "gdn_chunk_prep": (6, s["gdn_chunk_prep"][6].double(), "v is torch.float64"),
        "selective_scan": (5, s["selective_scan"][5].int(), "cu_seqlens is torch.int32"),
        "linear": (0, s["linear"][0][:, :63].contiguous(), "x has shape [2, 63]"),
        "linear_int4": (3, 48, "group is 48"),
        "linear_q": (2, s["linear_q"][2].to(torch.uint8), "w is torch.uint8"),
    }
    assert set(wrong) | {"ssd_step"} == set(OPS)
    for name, (i, bad_value, expected) in wrong.items():
        args = list(s[name])
        args[i] = bad_value
        with pytest.raises(ValueError) as e:
            getattr(torch.ops.hybrid, name)(*args)
        assert str(e.value).startswith(f"hybrid::{name}: ") and expected in str(e.value), str(e.value)


def test_fake_tensors_see_the_same_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    state, x, dt, A, B, C, D, _ = _ssd_args()
    real = (state, x.half(), dt, A, B, C, D)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in real]
        with pytest.raises(ValueError, match="hybrid::ssd_step: x is torch.float16"):
            torch.ops.hybrid.ssd_step(*fake)


def _runnable_variants() -> list[str]:
    from hybrid.kernels.native import variants

    flags = variants.cpu_flags()
    return [v.name for v in variants.runnable(flags)] if flags is not None else []


def _run(name: str, args: tuple):
    """The op on copies of ``args`` (mutated arguments included in what it returns)."""
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    out = getattr(torch.ops.hybrid, name)(*args)
    out = out if isinstance(out, tuple) else (out,) if out is not None else ()
    return [*out, *(a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())]


@pytest.mark.parametrize("variant", _runnable_variants())
def test_every_op_agrees_across_the_variants(variant):
    """Each op on a variant this CPU runs (the AVX2 build on an AVX-512 machine too) against the loaded library,
    which the reference tests (test_native_decode*, test_native_scan) hold to the *_ref functions."""
    lib = native.load_variant(variant, threads=2)
    for name, args in _sample_args().items():
        expected = _run(name, args)
        with native.using_library(lib):
            got = _run(name, args)
        for e, g in zip(expected, got, strict=True):
            scale = e.abs().max().clamp_min(1e-6)
            assert ((g - e).abs().max() / scale).item() < 1e-5, (name, variant)


def test_the_dispatch_calls_the_checked_kernel_only_after_supports_passed():
    """kernels/dispatch.py: a backend fn's ``after_supports`` runs right after its supports() said yes (the native
    ops: the op's check was that test); a refused call goes to the next backend, a direct call through the op."""
    from hybrid.kernels import dispatch

    calls = []

    def through_the_op(x):
        calls.append("op")
        return x

    through_the_op.after_supports = lambda x: calls.append("kernel") or x
    dispatch.register("_test_after_supports", "native", through_the_op, supports=lambda x: None if x > 0 else "neg")
    dispatch.register("_test_after_supports", "torch", lambda x: calls.append("torch") or x)
    try:
        fn = dispatch.choose("_test_after_supports", "cpu")[1]
        fn(1), fn(-1), through_the_op(2)
        assert calls == ["kernel", "torch", "op"]
    finally:
        dispatch._registry.pop("_test_after_supports")
        dispatch._cache.clear()
