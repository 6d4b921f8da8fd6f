"""The opt-in ``inductor`` backend (the SSD scan's torch.compile'd blocks) against the reference, fp32: odd
lengths (padded blocks), several blocks, n_groups > 1, initial states, varlen = alone. One compiled shape
(a compile costs ~20 s on a 2-core CPU), so the cases share their block shape."""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from hybrid.kernels import inductor_backend

from hybrid import kernels

pytestmark = pytest.mark.skipif(inductor_backend.probe() is not None, reason=str(inductor_backend.probe()))


def test_ssd_inductor_matches_recurrence_and_varlen_matches_alone(monkeypatch):
    monkeypatch.setattr("hybrid.kernels.ssd._TORCH_CHUNK", 16)
    monkeypatch.setattr("hybrid.kernels.ssd._TORCH_BLOCK", 64)
    torch.manual_seed(0)
    T, H, P, G, N = 101, 4, 8, 2, 16
    x, dt = torch.randn(T, H, P), F.softplus(torch.randn(T, H) - 1.0)
    A, B, C, D = -torch.empty(H).uniform_(0.5, 8.0), torch.randn(T, G, N), torch.randn(T, G, N), torch.randn(H)
    # 64 + 37 and 64 + 0: blocks of 4 chunks, and a last block padded from 3 chunks to 4 (one shape)
    cu = torch.tensor([0, 64, 101])
    s0 = torch.randn(2, H, P, N)
    with torch.inference_mode(), kernels.use_backend("inductor"):
        y, s = kernels.ssd_varlen_scan(x, dt, A, B, C, cu, chunk_size=256, D=D, initial_states=s0)
    y_ref, s_ref = kernels.ssd_varlen_scan_ref(x, dt, A, B, C, cu, D=D, initial_states=s0)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_inductor_backend_falls_back_to_torch_under_autograd():
    x, dt = torch.randn(1, 20, 2, 4, requires_grad=True), F.softplus(torch.randn(1, 20, 2))
    A, B, C = -torch.rand(2), torch.randn(1, 20, 1, 8), torch.randn(1, 20, 1, 8)
    with kernels.use_backend("inductor"):
        y, _ = kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size=16)
    y.sum().backward()
    y_ref, _ = kernels.ssd_scan_ref(x.detach(), dt, A, B, C)
    assert rel_err(y, y_ref) < 1e-5 and x.grad is not None and torch.isfinite(x.grad).all()
