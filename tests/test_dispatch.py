"""Dispatch: per-call support checks and their fallbacks, forced backends, Triton being optional,
the CUDA packages' layout checks (pure functions, testable without a GPU) and `hybrid doctor`."""

import os
import subprocess
import sys

import pytest
import torch
from conftest import rel_err
from hybrid.kernels import cuda_backend, dispatch
from hybrid.kernels.dispatch import BackendError, use_backend

from hybrid import kernels
from hybrid.cli import main


@pytest.fixture
def toy_op(monkeypatch):
    """An op whose `triton` backend takes only even-length inputs, on a CPU order that tries triton first."""
    monkeypatch.setattr(dispatch, "_registry", {k: dict(v) for k, v in dispatch._registry.items()})
    monkeypatch.setitem(dispatch.DEFAULT_ORDER, "cpu", ("triton", "torch"))
    monkeypatch.setattr(dispatch, "_cache", {})

    def even_only(x):
        """takes even lengths only"""
        return None if len(x) % 2 == 0 else f"length {len(x)} is odd"

    dispatch.register("toy", "triton", lambda x: "triton", supports=even_only)
    dispatch.register("toy", "torch", lambda x: "torch")
    return "toy"


def test_supports_falls_back_per_call(toy_op):
    name, fn = dispatch.choose(toy_op, "cpu")
    assert name == "triton"
    assert fn([1, 2]) == "triton" and fn([1, 2, 3]) == "torch"
    assert dispatch.choose(toy_op, "cpu")[1] is fn  # the decision itself is cached


def test_forced_backend_that_cannot_take_the_call_says_why(toy_op):
    with use_backend("triton"):
        _, fn = dispatch.choose(toy_op, "cpu")
        assert fn([1, 2]) == "triton"
        with pytest.raises(BackendError, match="length 3 is odd.*forces it"):
            fn([1, 2, 3])


def test_explain_lists_per_call_constraints(toy_op):
    (row,) = [r for r in dispatch.explain("cpu") if r[0] == toy_op]
    assert row[1] == "triton" and "takes even lengths only" in row[2] and "cuda: not implemented" in row[2]


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_hybrid_imports_without_triton():
    """With triton unimportable, hybrid imports, CPU ops run on torch and forcing triton says why not."""
    code = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch
import hybrid
from hybrid import kernels
q = torch.randn(1, 5, 2, 8)
assert kernels.causal_attention(q, q, q).shape == q.shape
try:
    with kernels.use_backend("triton"):
        kernels.causal_attention(q, q, q)
except kernels.BackendError as e:
    print(e)
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert "triton does not import" in out.stdout


def test_forced_triton_on_cpu_without_interpreter_says_how():
    code = "import torch; from hybrid import kernels; q = torch.randn(1, 5, 2, 8); kernels.causal_attention(q, q, q)"
    out = _run(code, TRITON_INTERPRET="0", HYBRID_BACKEND="triton")
    assert out.returncode != 0 and "set TRITON_INTERPRET=1" in out.stderr


def test_flash_layout_checks():
    q = torch.zeros(4, 8, 128, dtype=torch.float16)
    assert cuda_backend.supports_flash(q) is None
    assert "fp16/bf16" in cuda_backend.supports_flash(q.float())
    assert "multiple of 8" in cuda_backend.supports_flash(torch.zeros(4, 8, 84, dtype=torch.float16))
    pool = torch.zeros(10, 16, 2, 128, dtype=torch.float16)
    assert "block_size % 256" in cuda_backend.supports_flash_paged(q, pool)


def test_mamba_and_conv_layout_checks():
    x = torch.zeros(10, 2, 4)
    cu1, cu2 = torch.tensor([0, 10]), torch.tensor([0, 4, 10])
    s0 = torch.zeros(2, 2, 4, 8)
    assert cuda_backend.supports_packed_ssd(x, None, None, None, None, cu1, chunk_size=8, initial_states=s0[:1]) is None
    assert "per sequence" in cuda_backend.supports_packed_ssd(x, None, None, None, None, cu2, chunk_size=8,
                                                               initial_states=s0)
    assert "no initial state" in cuda_backend.supports_no_initial_state(x, initial_state=s0)
    assert "widths 2..4" in cuda_backend.supports_conv(x, torch.zeros(4, 5))
    assert "no initial states" in cuda_backend.supports_conv_varlen(x, torch.zeros(4, 4), None, cu2,
                                                                    initial_states=torch.zeros(2, 4, 3))
    assert "dtype" in cuda_backend.supports_conv_step(torch.zeros(2, 4, 3), torch.zeros(2, 4, dtype=torch.float16),
                                                      torch.zeros(4, 4))


def test_final_conv_states_from_packed_inputs():
    """What the cuda wrapper computes itself (the package returns no final states with seq_idx)."""
    cu = torch.tensor([0, 2, 9, 20])
    x = torch.randn(20, 6)
    _, ref = kernels.causal_conv1d_varlen_ref(x, torch.randn(6, 4), None, cu)
    assert torch.equal(cuda_backend.last_inputs(x, cu, 3), ref)


def test_missing_package_reason_is_remembered(monkeypatch):
    monkeypatch.setattr(cuda_backend, "_loaded", {})
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    first = cuda_backend._load("causal_conv1d")
    assert isinstance(first, str) and "causal_conv1d does not import" in first
    monkeypatch.delitem(sys.modules, "causal_conv1d")
    assert cuda_backend._load("causal_conv1d") is first  # imported once; the reason is kept


def test_doctor_prints_every_op(capsys):
    main(["doctor"])
    out = capsys.readouterr().out
    assert "TRITON_INTERPRET=" in out and "# ops on cpu" in out
    for op in dispatch.ops():
        assert f"\n{op} " in out
    from hybrid.kernels import native

    if native.available() is None:  # the instruction paths the native library was built with, as the CPU flags say
        flags = set(open("/proc/cpuinfo").read().split()) if os.path.exists("/proc/cpuinfo") else set()
        assert "native instruction paths: " in out
        assert ("AVX512-BF16 vdpbf16ps" in native.cpu_paths()) == ("avx512_bf16" in flags)
        assert ("AVX2" in native.cpu_paths()) == ("avx2" in flags)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_backends_bf16(backend):
    """On a GPU: each backend's attention and SSD in bf16 against the fp32 references (skips a backend
    whose package is missing)."""
    if dispatch.why_not("varlen_attention", backend, "cuda") or dispatch.why_not("ssd_varlen_scan", backend, "cuda"):
        pytest.skip(f"{backend} not usable here")
    dev = "cuda"
    lens = [257, 63]
    cu = torch.tensor([0, 257, 320], dtype=torch.int32, device=dev)
    # references in fp32 on the same bf16-rounded inputs: what is left is the kernels' own error
    q, k, v = (torch.randn(320, h, 128, device=dev).bfloat16() for h in (8, 2, 2))
    ref = kernels.varlen_attention_ref(q.float(), k.float(), v.float(), cu)
    with use_backend(backend):
        out = kernels.varlen_attention(q, k, v, cu)
    assert rel_err(out, ref) < 1e-2  # bf16 output and bf16 probabilities: unit roundoff 3.9e-3
    x = torch.randn(sum(lens), 4, 64, device=dev).bfloat16()
    dt = torch.nn.functional.softplus(torch.randn(sum(lens), 4, device=dev) - 1)
    A = -torch.rand(4, device=dev) * 4
    B, C = (torch.randn(sum(lens), 1, 32, device=dev).bfloat16() for _ in range(2))
    y_ref, s_ref = kernels.ssd_varlen_scan_ref(x.float(), dt, A, B.float(), C.float(), cu)
    with use_backend(backend):
        y, s = kernels.ssd_varlen_scan(x, dt, A, B, C, cu)
    # bf16 output; inside, mamba-ssm rounds intermediate chunk states to bf16 too
    assert rel_err(y, y_ref) < 2e-2 and rel_err(s, s_ref) < 2e-2
