"""The compiled Mamba-1 scan (kernels/cpu_scan.py) against the token-by-token reference: odd lengths and widths
(a partial channel block), initial states, no D, bf16 inputs, a batch, and decays past fp32's normal range;
the torch path takes it in inference and falls back to its token steps when it is turned off."""

import pytest
import torch
from conftest import rel_err
from hybrid.kernels import cpu_scan, selective

from hybrid import kernels

pytestmark = pytest.mark.skipif(cpu_scan.available() is not None,
                                reason=f"no compiled scan here: {cpu_scan.available()}")


def _inputs(b, L, Dm, N, dtype=torch.float32, dt_scale=1.0):
    x = torch.randn(b, L, Dm)
    dt = torch.nn.functional.softplus(torch.randn(b, L, Dm) - 1) * dt_scale
    A = -torch.rand(Dm, N) * 4 - 0.1
    B, C = torch.randn(b, L, N), torch.randn(b, L, N)
    return x.to(dtype), dt.to(dtype), A, B.to(dtype), C.to(dtype)


@pytest.mark.parametrize("L,Dm,N", [(1, 16, 16), (37, 40, 16), (64, 33, 7), (5, 3, 64)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_D", [False, True])
def test_equals_the_reference(L, Dm, N, with_state, with_D):
    x, dt, A, B, C = _inputs(2, L, Dm, N)
    D = torch.randn(Dm) if with_D else None
    h0 = torch.randn(2, Dm, N) if with_state else torch.zeros(2, Dm, N)
    y_ref, h_ref = kernels.selective_scan_ref(x, dt, A, B, C, D=D, initial_state=h0)
    y, h = cpu_scan.selective_scan_cpu(x, dt, A, B, C, D, h0)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5
    assert torch.equal(h0, h0.clone())  # the entering state is not written


def test_large_decays_flush_to_zero_like_the_reference():
    x, dt, A, B, C = _inputs(1, 20, 24, 16, dt_scale=100.0)  # dt A down to ~ -1e3: e^{dt A} underflows
    y_ref, h_ref = kernels.selective_scan_ref(x, dt, A, B, C)
    y, h = cpu_scan.selective_scan_cpu(x, dt, A, B, C, None, torch.zeros(1, 24, 16))
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


def test_threads_split_the_channels(monkeypatch):
    x, dt, A, B, C = _inputs(1, 30, 70, 16)
    y1, h1 = cpu_scan.selective_scan_cpu(x, dt, A, B, C, None, torch.zeros(1, 70, 16))
    with torch.inference_mode():
        torch.set_num_threads(3)
        try:
            y3, h3 = cpu_scan.selective_scan_cpu(x, dt, A, B, C, None, torch.zeros(1, 70, 16))
        finally:
            torch.set_num_threads(1)
    assert torch.equal(y1, y3) and torch.equal(h1, h3)  # each channel's arithmetic is the same, only who runs it


def test_torch_path_uses_it_in_inference_and_falls_back(monkeypatch):
    x, dt, A, B, C = _inputs(1, 25, 48, 16, dtype=torch.bfloat16)
    D = torch.randn(48)
    y_ref, _ = kernels.selective_scan_ref(x, dt, A, B, C, D=D)
    with torch.inference_mode():
        y, _ = kernels.selective_scan(x, dt, A, B, C, D=D)
        monkeypatch.setattr(cpu_scan, "supports", lambda *a: "off for this test")
        y_steps, _ = kernels.selective_scan(x, dt, A, B, C, D=D)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, y_ref) <= 2**-8 and rel_err(y_steps, y_ref) <= 2**-8


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_scan.ENV, "0")
    cpu_scan._library.cache_clear()
    try:
        assert cpu_scan.available() == f"{cpu_scan.ENV}=0"
        assert selective.cpu_scan.supports(torch.zeros(1), torch.zeros(1, 16)) is not None
    finally:
        monkeypatch.delenv(cpu_scan.ENV)
        cpu_scan._library.cache_clear()
    assert cpu_scan.available() is None
