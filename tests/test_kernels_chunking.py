"""The torch SSD path's chunking and blocking change only the cost: every chunk length and block size
gives the recurrence's result in fp32, and bf16 inputs give it within bf16's own rounding."""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from hybrid import kernels


def _inputs(b, L, H, P, G, N, dtype=torch.float32, decay=8.0):
    x = torch.randn(b, L, H, P)
    dt = F.softplus(torch.randn(b, L, H) - 1.0)
    A = -torch.empty(H).uniform_(0.5, decay)
    B, C = torch.randn(b, L, G, N), torch.randn(b, L, G, N)
    return x.to(dtype), dt, A, B.to(dtype), C.to(dtype), torch.randn(H), torch.randn(b, H, P, N)


@pytest.mark.parametrize("chunk,block", [(16, 16), (16, 48), (32, 64), (64, 512), (7, 21)])
@pytest.mark.parametrize("G", [1, 2])
def test_ssd_every_chunk_and_block_size_gives_the_recurrence(monkeypatch, chunk, block, G):
    """L = 101: odd, several blocks with a partial last one, chunk boundaries inside and across blocks."""
    monkeypatch.setattr("hybrid.kernels.ssd._TORCH_CHUNK", chunk)
    monkeypatch.setattr("hybrid.kernels.ssd._TORCH_BLOCK", block)
    x, dt, A, B, C, D, s0 = _inputs(2, 101, 4, 8, G, 16)
    y_ref, s_ref = kernels.ssd_scan_ref(x, dt, A, B, C, D=D, initial_state=s0)
    y, s = kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size=256, D=D, initial_state=s0)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_ssd_strong_decay_stays_finite():
    """Decays of hundreds of e-folds within a chunk: no inf * 0 in the masked decay matrix."""
    x, dt, A, B, C, D, s0 = _inputs(1, 130, 4, 8, 1, 16, decay=400.0)
    y_ref, s_ref = kernels.ssd_scan_ref(x, dt, A, B, C, D=D, initial_state=s0)
    y, s = kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size=64, D=D, initial_state=s0)
    assert torch.isfinite(y).all() and rel_err(y, y_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_ssd_chunked_gradients_match_recurrence():
    """With autograd on, the out-of-place branch runs: same values, same gradients as the reference."""
    x, dt, A, B, C, D, s0 = _inputs(1, 37, 2, 4, 1, 8)
    leaves = [t.clone().requires_grad_() for t in (x, dt, B, C)]
    ref_leaves = [t.clone().requires_grad_() for t in (x, dt, B, C)]
    y, s = kernels.ssd_chunk_scan(leaves[0], leaves[1], A, leaves[2], leaves[3], chunk_size=16, D=D, initial_state=s0)
    y_r, s_r = kernels.ssd_scan_ref(ref_leaves[0], ref_leaves[1], A, ref_leaves[2], ref_leaves[3], D=D,
                                    initial_state=s0)
    (y.square().sum() + s.sum()).backward()
    (y_r.square().sum() + s_r.sum()).backward()
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert rel_err(got.grad, want.grad) < 1e-4


@pytest.mark.parametrize("G,H", [(1, 2), (3, 3), (2, 6)])
def test_ssd_gradients_across_blocks_and_groups(monkeypatch, G, H):
    """The written-out chunk walk backward (kernels.ssd._ChunkWalk): several blocks, so the state's gradient
    crosses block boundaries into a trained initial state; one head per group and several; equal to the
    recurrence's gradients through every input."""
    monkeypatch.setattr("hybrid.kernels.ssd._TORCH_BLOCK", 32)
    x, dt, A, B, C, D, s0 = _inputs(2, 75, H, 4, G, 8)
    leaves = [t.clone().requires_grad_() for t in (x, dt, A, B, C, s0)]
    ref = [t.clone().requires_grad_() for t in (x, dt, A, B, C, s0)]
    y, s = kernels.ssd_chunk_scan(*leaves[:5], chunk_size=16, D=D, initial_state=leaves[5])
    y_r, s_r = kernels.ssd_scan_ref(*ref[:5], D=D, initial_state=ref[5])
    w_y, w_s = torch.randn_like(y), torch.randn_like(s)
    ((y * w_y).sum() + (s * w_s).sum()).backward()
    ((y_r * w_y).sum() + (s_r * w_s).sum()).backward()
    for name, got, want in zip("x dt A B C state".split(), leaves, ref, strict=True):
        assert rel_err(got.grad, want.grad) < 1e-4, name


@pytest.mark.parametrize("mm", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,hpg", [(9, 1), (2, 3)])
def test_chunk_walk_backward_equals_the_recorded_ops(mm, G, hpg):
    """The written-out backward against autograd through the plain ops (kernels.ssd._recorded_walk, which the
    Function's forward runs too): bf16 operands round where the recorded ops round them, the same gradients
    (equal on this CPU; the bound leaves room for another accumulation order only). The shapes include SmolLM2's
    students': a group per head."""
    from hybrid.kernels.ssd import _chunk_walk, _recorded_walk

    b, nc, T, P, N = 2, 3, 8, 4, 8
    H = G * hpg
    args = [torch.randn(b, H, P, N), torch.randn(b, nc, T, G, hpg * P).to(mm), torch.randn(b, nc * T, G, N).to(mm),
            torch.randn(b, nc * T, G, N).to(mm), torch.rand(b, nc, H)]
    mine = [t.clone().requires_grad_() for t in args]
    theirs = [t.clone().requires_grad_() for t in args]
    y, s = _chunk_walk(*mine, mm)
    y_r, s_r = _recorded_walk(*theirs, mm)
    assert torch.equal(y, y_r) and torch.equal(s, s_r)
    w_y, w_s = torch.randn(y.shape).to(mm), torch.randn(s.shape)
    ((y * w_y).float().sum() + (s * w_s).sum()).backward()
    ((y_r * w_y).float().sum() + (s_r * w_s).sum()).backward()
    for name, got, want in zip("state xw B C decay".split(), mine, theirs, strict=True):
        assert rel_err(got.grad.float(), want.grad.float()) < 1e-6, name


def _bf16_noise(exact: torch.Tensor) -> float:
    """The error of rounding the exact result to bf16: what any bf16 output carries at least."""
    return rel_err(exact.to(torch.bfloat16), exact)


@pytest.mark.parametrize("G", [1, 2])
def test_ssd_bf16_within_bf16_rounding_of_exact(G):
    x, dt, A, B, C, D, s0 = _inputs(2, 77, 4, 8, G, 16, dtype=torch.bfloat16)
    # exact: the fp32 recurrence on the very same (bf16-valued) inputs
    y_ex, s_ex = kernels.ssd_scan_ref(x.float(), dt, A, B.float(), C.float(), D=D, initial_state=s0)
    y, s = kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size=16, D=D, initial_state=s0)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    # where the CPU multiplies in bf16 its operands are rounded too: a few roundings, never a drift
    assert rel_err(y, y_ex) <= 4 * _bf16_noise(y_ex)
    assert rel_err(s, s_ex) <= 4 * _bf16_noise(s_ex)


def test_selective_scan_bf16_within_bf16_rounding_of_exact():
    x, dt = torch.randn(2, 45, 12).to(torch.bfloat16), F.softplus(torch.randn(2, 45, 12))
    A = -torch.rand(12, 8) * 8
    B, C = torch.randn(2, 45, 8).to(torch.bfloat16), torch.randn(2, 45, 8).to(torch.bfloat16)
    D, h0 = torch.randn(12), torch.randn(2, 12, 8)
    y_ex, h_ex = kernels.selective_scan_ref(x.float(), dt, A, B.float(), C.float(), D=D, initial_state=h0)
    y, h = kernels.selective_scan(x, dt, A, B, C, D=D, initial_state=h0)
    assert y.dtype == torch.bfloat16 and h.dtype == torch.float32
    assert rel_err(y, y_ex) <= 4 * _bf16_noise(y_ex) and rel_err(h, h_ex) <= 4 * _bf16_noise(h_ex)


def test_causal_conv1d_bf16_within_bf16_rounding_of_exact():
    x, w, b = torch.randn(2, 33, 6).to(torch.bfloat16), torch.randn(6, 4), torch.randn(6)
    st = torch.randn(2, 6, 3).to(torch.bfloat16)
    y_ex, _ = kernels.causal_conv1d_ref(x.float(), w, b, initial_state=st.float(), activation="silu")
    y, s = kernels.causal_conv1d(x, w, b, initial_state=st, activation="silu")
    assert y.dtype == torch.bfloat16 and s.dtype == torch.bfloat16
    assert rel_err(y, y_ex) <= 4 * _bf16_noise(y_ex)


@pytest.mark.parametrize("block,sub", [(16, 16), (64, 16), (96, 32), (256, 16)])
@pytest.mark.parametrize("autograd", [False, True])
def test_selective_every_block_and_sub_chunk_size_gives_the_recurrence(monkeypatch, block, sub, autograd):
    """L = 203: odd, several blocks with a padded last one. Inference takes the token steps, autograd the
    chunked form (factorised decay cumsum, sub-chunk hand-over): both exact whatever the blocking."""
    monkeypatch.setattr("hybrid.kernels.selective._BLOCK", block)
    monkeypatch.setattr("hybrid.kernels.selective._SUB", sub)
    x, dt = torch.randn(2, 203, 12, requires_grad=autograd), F.softplus(torch.randn(2, 203, 12))
    A, B, C = -torch.rand(12, 8) * 4, torch.randn(2, 203, 8), torch.randn(2, 203, 8)
    D, h0 = torch.randn(12), torch.randn(2, 12, 8)
    y_ref, h_ref = kernels.selective_scan_ref(x.detach(), dt, A, B, C, D=D, initial_state=h0)
    y, h = kernels.selective_scan(x, dt, A, B, C, D=D, initial_state=h0)
    assert y.requires_grad == autograd
    assert rel_err(y.detach(), y_ref) < 1e-5 and rel_err(h.detach(), h_ref) < 1e-5


def test_selective_scan_gradients_match_recurrence():
    x, dt = torch.randn(1, 37, 6), F.softplus(torch.randn(1, 37, 6))
    A, B, C, h0 = -torch.rand(6, 4) * 4, torch.randn(1, 37, 4), torch.randn(1, 37, 4), torch.randn(1, 6, 4)
    leaves = [t.clone().requires_grad_() for t in (x, dt, A, B, C, h0)]
    refs = [t.clone().requires_grad_() for t in (x, dt, A, B, C, h0)]
    y, h = kernels.selective_scan(*leaves[:5], initial_state=leaves[5])
    y_ref, h_ref = kernels.selective_scan_ref(*refs[:5], initial_state=refs[5])
    w_y, w_h = torch.randn_like(y), torch.randn_like(h)
    ((y * w_y).sum() + (h * w_h).sum()).backward()
    ((y_ref * w_y).sum() + (h_ref * w_h).sum()).backward()
    for got, want in zip(leaves, refs, strict=True):
        assert rel_err(got.grad, want.grad) < 1e-4
