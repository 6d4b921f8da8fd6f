"""Triton SSD chunk scan, Mamba-2/Mamba-1 state updates and causal conv1d against the references."""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from hybrid.kernels import use_backend
from triton_cases import DEVICE, TOL, needs_triton

from hybrid import kernels

pytestmark = needs_triton


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)


def _ssd(T, H, P, G, N, nseq, dtype):
    x = torch.randn(T, H, P, device=DEVICE).to(dtype)
    dt = F.softplus(torch.randn(T, H, device=DEVICE) - 1.0)
    A = -torch.empty(H, device=DEVICE).uniform_(0.5, 8.0)
    B, C = (torch.randn(T, G, N, device=DEVICE).to(dtype) for _ in range(2))
    D = torch.randn(H, device=DEVICE)
    s0 = torch.randn(nseq, H, P, N, device=DEVICE)
    return x, dt, A, B, C, D, s0


@pytest.mark.parametrize("lens,H,P,G,N,init,dtype", [
    ([63, 65, 1], 4, 16, 2, 16, True, torch.float32),
    ([257], 2, 64, 1, 32, False, torch.float32),
    ([65, 40], 4, 80, 4, 16, True, torch.float16),
])
def test_ssd_varlen_matches_recurrence(lens, H, P, G, N, init, dtype):
    """Initial states, boundaries inside the packed batch (the state never crosses one), final states."""
    x, dt, A, B, C, D, s0 = _ssd(sum(lens), H, P, G, N, len(lens), dtype)
    s0 = s0 if init else None
    cu = _cu(lens)
    y_ref, s_ref = kernels.ssd_varlen_scan_ref(x, dt, A, B, C, cu, D=D, initial_states=s0)
    with use_backend("triton"):
        y, s = kernels.ssd_varlen_scan(x, dt, A, B, C, cu, D=D, initial_states=s0)
    assert y.dtype == dtype and s.dtype == torch.float32
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(s, s_ref) < TOL[torch.float32] * (10 if dtype == torch.float16 else 1)  # fp16 inputs, fp32 state


def test_ssd_packed_equals_each_sequence_alone_and_batched():
    lens = [63, 65]
    x, dt, A, B, C, D, s0 = _ssd(sum(lens), 4, 16, 2, 16, 2, torch.float32)
    cu = _cu(lens)
    with use_backend("triton"):
        y, s = kernels.ssd_varlen_scan(x, dt, A, B, C, cu, D=D, initial_states=s0)
        for b in range(len(lens)):
            sl = slice(int(cu[b]), int(cu[b + 1]))
            yb, sb = kernels.ssd_chunk_scan(x[None, sl], dt[None, sl], A, B[None, sl], C[None, sl], D=D,
                                            initial_state=s0[b:b + 1])
            assert torch.equal(yb[0], y[sl]) and torch.equal(sb[0], s[b])


def test_ssd_decode_step_continues_the_scan():
    """Scan 64 tokens, then step token 65 from the scan's final state in a slot pool: equals scanning 65."""
    L, H, P, G, N = 65, 4, 16, 2, 16
    x, dt, A, B, C, D, _ = _ssd(L, H, P, G, N, 1, torch.float32)
    with use_backend("triton"):
        y_all, s_all = kernels.ssd_varlen_scan(x, dt, A, B, C, _cu([L]), D=D)
        _, s_prefix = kernels.ssd_varlen_scan(x[:-1], dt[:-1], A, B[:-1], C[:-1], _cu([L - 1]), D=D)
        pool = torch.randn(3, H, P, N, device=DEVICE)
        pool[2] = s_prefix[0]
        y_step = kernels.ssd_step(pool, x[-1:], dt[-1:], A, B[-1:], C[-1:], D=D,
                                  slots=torch.tensor([2], device=DEVICE))
    assert rel_err(y_step, y_all[-1:]) < TOL[torch.float32]
    assert rel_err(pool[2], s_all[0]) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ssd_step_matches_reference(dtype):
    H, P, G, N = 4, 80, 2, 16
    pool = torch.randn(5, H, P, N, device=DEVICE)
    x = torch.randn(2, H, P, device=DEVICE).to(dtype)
    dt = F.softplus(torch.randn(2, H, device=DEVICE))
    A = -torch.rand(H, device=DEVICE) * 4
    B, C = (torch.randn(2, G, N, device=DEVICE).to(dtype) for _ in range(2))
    D = torch.randn(H, device=DEVICE)
    slots = torch.tensor([4, 1], device=DEVICE)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    y_ref = kernels.ssd_step(ref_pool, x, dt, A, B, C, D=D, slots=slots)  # torch path (default on CPU)
    with use_backend("triton"):
        y = kernels.ssd_step(tri_pool, x, dt, A, B, C, D=D, slots=slots)
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(tri_pool, ref_pool) < TOL[torch.float32]
    assert torch.equal(tri_pool[[0, 2, 3]], pool[[0, 2, 3]])  # other slots untouched


def test_selective_step_continues_the_scan():
    """Mamba-1: a step from the selective scan's state over 64 tokens equals the scan over 65 (no slots)."""
    L, Dm, N = 65, 24, 16
    x, dt = torch.randn(1, L, Dm, device=DEVICE), F.softplus(torch.randn(1, L, Dm, device=DEVICE))
    A = -torch.rand(Dm, N, device=DEVICE) * 4
    B, C = torch.randn(1, L, N, device=DEVICE), torch.randn(1, L, N, device=DEVICE)
    D = torch.randn(Dm, device=DEVICE)
    y_all, s_all = kernels.selective_scan_ref(x, dt, A, B, C, D=D)
    _, state = kernels.selective_scan_ref(x[:, :-1], dt[:, :-1], A, B[:, :-1], C[:, :-1], D=D)
    with use_backend("triton"):
        y = kernels.selective_step(state, x[:, -1], dt[:, -1], A, B[:, -1], C[:, -1], D=D)
    assert rel_err(y, y_all[:, -1]) < TOL[torch.float32] and rel_err(state, s_all) < TOL[torch.float32]


@pytest.mark.parametrize("lens,Cn,K,init,act,dtype", [
    ([63, 65, 2], 40, 4, True, "silu", torch.float32),
    ([257], 64, 3, False, None, torch.float32),
    ([1, 65], 24, 4, True, "silu", torch.float16),
])
def test_conv1d_varlen_matches_reference(lens, Cn, K, init, act, dtype):
    """Short sequences (< K-1 tokens) take part of their final state from the initial state."""
    cu = _cu(lens)
    x = torch.randn(sum(lens), Cn, device=DEVICE).to(dtype)
    w, bias = torch.randn(Cn, K, device=DEVICE), torch.randn(Cn, device=DEVICE)
    s0 = torch.randn(len(lens), Cn, K - 1, device=DEVICE).to(dtype) if init else None
    y_ref, f_ref = kernels.causal_conv1d_varlen_ref(x, w, bias, cu, initial_states=s0, activation=act)
    with use_backend("triton"):
        y, f = kernels.causal_conv1d_varlen(x, w, bias, cu, initial_states=s0, activation=act)
    assert rel_err(y, y_ref) < TOL[dtype]
    assert torch.equal(f, f_ref)  # a copy of inputs: exact


def test_conv1d_batched_packed_and_step_agree():
    """Batched == packed == each sequence alone, and stepping the last token from the state of the rest."""
    x = torch.randn(2, 65, 32, device=DEVICE)
    w, bias = torch.randn(32, 4, device=DEVICE), torch.randn(32, device=DEVICE)
    with use_backend("triton"):
        y, final = kernels.causal_conv1d(x, w, bias, activation="silu")
        yp, fp = kernels.causal_conv1d_varlen(x.reshape(130, 32), w, bias, _cu([65, 65]), activation="silu")
        _, state = kernels.causal_conv1d(x[:, :-1], w, bias, activation="silu")
        pool = torch.zeros(4, 32, 3, device=DEVICE)
        pool[[3, 0]] = state
        y_last = kernels.causal_conv1d_step(pool, x[:, -1], w, bias, activation="silu",
                                            slots=torch.tensor([3, 0], device=DEVICE))
    assert torch.equal(y.reshape(130, 32), yp) and torch.equal(final, fp)
    assert rel_err(y, kernels.causal_conv1d_ref(x, w, bias, activation="silu")[0]) < TOL[torch.float32]
    assert rel_err(y_last, y[:, -1]) < TOL[torch.float32]
    assert torch.equal(pool[[3, 0]], final)
