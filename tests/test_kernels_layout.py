"""The CPU-fast forms of the torch kernels give the references' results on the inputs the model feeds
them: the conv on a strided channels-last view (a split of the in-projection), with and without state,
bias or autograd; the SSD where chunk decays fall into fp32's denormal range (flushed to zero)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from hybrid import kernels


@pytest.mark.parametrize("with_state,with_bias", [(False, False), (True, True), (False, True)])
def test_causal_conv1d_on_a_strided_view(with_state, with_bias):
    packed = torch.randn(2, 13, 20)
    x = packed[..., 5:14]  # [2, 13, 9], token stride 20: as the conv's slice of in_proj's output
    w, b = torch.randn(9, 4), torch.randn(9) if with_bias else None
    st = torch.randn(2, 9, 3) if with_state else None
    y_ref, s_ref = kernels.causal_conv1d_ref(x, w, b, initial_state=st, activation="silu")
    y, s = kernels.causal_conv1d(x, w, b, initial_state=st, activation="silu")
    assert y.shape == x.shape and s.shape == (2, 9, 3)
    assert rel_err(y, y_ref) < 1e-6 and torch.equal(s, s_ref)


def test_causal_conv1d_gradients_match_reference():
    x, w, b, st = torch.randn(2, 11, 6), torch.randn(6, 4), torch.randn(6), torch.randn(2, 6, 3)
    got = [t.clone().requires_grad_() for t in (x, w, b, st)]
    want = [t.clone().requires_grad_() for t in (x, w, b, st)]
    y, s = kernels.causal_conv1d(got[0], got[1], got[2], initial_state=got[3], activation="silu")
    y_r, s_r = kernels.causal_conv1d_ref(want[0], want[1], want[2], initial_state=want[3], activation="silu")
    (y.square().sum() + s.sum()).backward()
    (y_r.square().sum() + s_r.sum()).backward()
    for g, r in zip(got, want, strict=True):
        assert rel_err(g.grad, r.grad) < 1e-5


def test_ssd_decays_into_the_denormal_range_match_the_recurrence():
    """dt A of -1.5 per token: a 64-token chunk decays by ~e^-96, between the smallest normal fp32
    (e^-87.3) and the smallest denormal (e^-103.3). Those decays are flushed to exact zeros (denormal
    arithmetic is ~100x slower on x86): the result is still the recurrence's."""
    b, L, H, P, G, N = 1, 200, 4, 8, 1, 16
    x, B, C = torch.randn(b, L, H, P), torch.randn(b, L, G, N), torch.randn(b, L, G, N)
    dt = torch.full((b, L, H), 0.1)
    A = -torch.tensor([15.0, 14.0, 1.0, 0.1])  # two fast heads, two slow ones
    D, s0 = torch.randn(H), torch.randn(b, H, P, N)
    y_ref, s_ref = kernels.ssd_scan_ref(x, dt, A, B, C, D=D, initial_state=s0)
    y, s = kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size=64, D=D, initial_state=s0)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    tiny = torch.finfo(torch.float32).tiny
    assert not ((y.abs() < tiny) & (y != 0)).any()


def test_ssd_does_not_write_into_the_initial_state():
    x, dt = torch.randn(1, 70, 2, 4), F.softplus(torch.randn(1, 70, 2))
    A, B, C = -torch.rand(2) * 4, torch.randn(1, 70, 1, 8), torch.randn(1, 70, 1, 8)
    s0 = torch.randn(1, 2, 4, 8)
    keep = s0.clone()
    with torch.inference_mode():
        kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size=64, initial_state=s0)
    assert torch.equal(s0, keep)
