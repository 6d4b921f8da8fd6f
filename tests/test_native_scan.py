"""The Mamba-1 selective scan in the native library (kernels/native/scan.c, the op ``hybrid::selective_scan``) against
the token-by-token reference, through the public ops (kernels.selective_scan / selective_varlen_scan, chosen by the
dispatch) on every variant this CPU runs — the AVX2 one on an AVX-512 machine too: odd lengths and widths (a partial
channel block), d_state 16 and odd ones, initial states, no D, bf16 inputs, a packed batch against its sequences one
by one, decays past fp32's normal range, the thread split, and the torch path where the native one is refused."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err
from hybrid.kernels import dispatch, native
from hybrid.kernels.native import ops, variants

from hybrid import kernels

pytestmark = pytest.mark.skipif(native.available() is not None, reason=f"native kernels: {native.available()}")


def _runnable_variants() -> list[str]:
    flags = variants.cpu_flags()
    return [v.name for v in variants.runnable(flags)] if flags is not None else []


@pytest.fixture(params=_runnable_variants() or [None])
def variant_lib(request):
    """Each prebuilt variant this CPU runs (best first), put in place of the loaded library for the test."""
    if request.param is None:
        pytest.skip("no /proc/cpuinfo flags: only the loaded library")
    lib = native.load_variant(request.param, threads=2)
    with native.using_library(lib):
        yield request.param


def _inputs(b, L, Dm, N, dtype=torch.float32, dt_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, L, Dm, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(b, L, Dm, generator=g) - 1) * dt_scale
    A = -torch.rand(Dm, N, generator=g) * 4 - 0.1
    B, C = torch.randn(b, L, N, generator=g), torch.randn(b, L, N, generator=g)
    return x.to(dtype), dt.to(dtype), A, B.to(dtype), C.to(dtype)


def _native(fn, *args, **kwargs):
    assert dispatch.choose("selective_scan", "cpu")[0] == "native"
    with torch.inference_mode():
        return fn(*args, **kwargs)


@pytest.mark.parametrize("L,Dm,N", [(63, 37, 16), (1, 16, 16), (64, 33, 7), (5, 3, 64), (63, 45, 16)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_D", [False, True])
def test_equals_the_reference(variant_lib, L, Dm, N, with_state, with_D):
    x, dt, A, B, C = _inputs(2, L, Dm, N)
    D = torch.randn(Dm) if with_D else None
    h0 = torch.randn(2, Dm, N) if with_state else None
    before = None if h0 is None else h0.clone()
    y_ref, h_ref = kernels.selective_scan_ref(x, dt, A, B, C, D=D, initial_state=h0)
    y, h = _native(kernels.selective_scan, x, dt, A, B, C, D=D, initial_state=h0)
    assert y.dtype == torch.float32 and h.dtype == torch.float32
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5
    if h0 is not None:
        assert torch.equal(h0, before)  # the entering state is not written


def test_bf16_inputs_round_once(variant_lib):
    x, dt, A, B, C = _inputs(2, 63, 37, 16, dtype=torch.bfloat16, seed=1)
    D = torch.randn(37)
    y_ref, h_ref = kernels.selective_scan_ref(x, dt, A, B, C, D=D)  # fp32 arithmetic on the bf16 inputs
    y, h = _native(kernels.selective_scan, x, dt, A, B, C, D=D)
    assert y.dtype == torch.bfloat16
    # the same fp32 sums, each output rounded to bf16 once (the reference rounds its own): within one rounding
    assert (y.float() - y_ref.float()).abs().max() <= 1e-5 + y_ref.float().abs().max() * 2.0 ** -8
    assert rel_err(h, h_ref) < 1e-5


def test_strided_inputs_as_the_layer_splits_them(variant_lib):
    """x_proj's output split into dt / B / C: rows at a stride, no copy needed."""
    b, L, Dm, N = 2, 21, 19, 16
    x, dt, A, _, _ = _inputs(b, L, Dm, N, seed=2)
    proj = torch.randn(b, L, 2 * N + 5)
    B, C = proj[..., 5:5 + N], proj[..., 5 + N:]
    y_ref, h_ref = kernels.selective_scan_ref(x, dt, A, B, C)
    y, h = _native(kernels.selective_scan, x, dt, A, B, C)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


def test_packed_equals_each_sequence_alone(variant_lib):
    lens = [63, 1, 17, 40]
    T, Dm, N = sum(lens), 37, 16
    x, dt, A, B, C = (t[0] if t.dim() == 3 else t for t in _inputs(1, T, Dm, N, seed=3))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    h0 = torch.randn(len(lens), Dm, N)
    D = torch.randn(Dm)
    y, h = _native(kernels.selective_varlen_scan, x, dt, A, B, C, cu, D=D, initial_states=h0)
    y_ref, h_ref = kernels.selective_varlen_scan_ref(x, dt, A, B, C, cu, D=D, initial_states=h0)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        ys, hs = _native(kernels.selective_scan, x[None, s:e], dt[None, s:e], A, B[None, s:e], C[None, s:e], D=D,
                         initial_state=h0[i:i + 1])
        assert torch.equal(ys[0], y[s:e]) and torch.equal(hs[0], h[i])  # the same arithmetic per channel


def test_large_decays_flush_to_zero_like_the_reference(variant_lib):
    x, dt, A, B, C = _inputs(1, 20, 24, 16, dt_scale=100.0)  # dt A down to ~ -1e3: e^{dt A} underflows
    y_ref, h_ref = kernels.selective_scan_ref(x, dt, A, B, C)
    y, h = _native(kernels.selective_scan, x, dt, A, B, C)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


def test_threads_split_the_work_without_changing_bits():
    x, dt, A, B, C = _inputs(3, 30, 70, 16)
    y1, h1 = _native(kernels.selective_scan, x, dt, A, B, C)
    torch.set_num_threads(3)  # the library's pool follows torch's thread count
    try:
        y3, h3 = _native(kernels.selective_scan, x, dt, A, B, C)
    finally:
        torch.set_num_threads(1)
    assert torch.equal(y1, y3) and torch.equal(h1, h3)


def test_autograd_and_a_forced_torch_backend_take_the_torch_path():
    x, dt, A, B, C = _inputs(1, 25, 48, 16, dtype=torch.bfloat16)
    D = torch.randn(48)
    y_ref, _ = kernels.selective_scan_ref(x, dt, A, B, C, D=D)
    assert ops.supports_selective_scan(x, dt, A.requires_grad_(), B, C, D=D) == "autograd"
    A = A.detach()
    with dispatch.use_backend("torch"), torch.inference_mode():
        y_steps, _ = kernels.selective_scan(x, dt, A, B, C, D=D)
    assert rel_err(y_steps, y_ref) <= 2**-8
    assert ops.supports_selective_scan(x, dt, torch.zeros(48, 65), B, C) is not None  # d_state past 64: torch


def test_the_op_refuses_bad_arguments_in_one_line():
    x, dt, A, B, C = _inputs(1, 10, 8, 4)
    x, dt, B, C = x[0], dt[0], B[0], C[0]
    cu = torch.tensor([0, 10])
    op = torch.ops.hybrid.selective_scan
    cases = {
        "x is torch.float16": dict(x=x.half()),
        "cu_seqlens is torch.int32": dict(cu_seqlens=cu.int()),
        "cu_seqlens is [0, 9]": dict(cu_seqlens=torch.tensor([0, 9])),
        "A has shape [8, 65]": dict(A=torch.zeros(8, 65)),
        "B has shape [10, 5]": dict(B=torch.zeros(10, 5)),
        "initial_states has shape [2, 8, 4]": dict(initial_states=torch.zeros(2, 8, 4)),
        "D is torch.bfloat16": dict(D=torch.zeros(8, dtype=torch.bfloat16)),
        "x has strides [1, 10]": dict(x=x.t().contiguous().t()),
    }
    for expected, change in cases.items():
        args = dict(x=x, dt=dt, A=A, B=B, C=C, cu_seqlens=cu, D=None, initial_states=None) | change
        with pytest.raises(ValueError) as e:
            op(**args)
        msg = str(e.value)
        assert msg.startswith("hybrid::selective_scan: ") and expected in msg and "it needs" in msg, msg
        assert "\n" not in msg


def test_dispatch_picks_the_native_scan_and_the_torch_path_stays_registered():
    assert dispatch.choose("selective_varlen_scan", "cpu")[0] == "native"
    with dispatch.use_backend("torch"):  # the token steps stay the fallback (HYBRID_NATIVE=0, no variant)
        assert dispatch.choose("selective_scan", "cpu")[0] == "torch"
