"""The fast torch paths of every op against their naive references (fp32)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err

from hybrid import kernels


def _ssd_inputs(b, L, H, P, G, N, init=True):
    x = torch.randn(b, L, H, P)
    dt = F.softplus(torch.randn(b, L, H) - 1.0)
    A = -torch.empty(H).uniform_(0.5, 8.0)
    B, C = torch.randn(b, L, G, N), torch.randn(b, L, G, N)
    D = torch.randn(H)
    s0 = torch.randn(b, H, P, N) if init else None
    return x, dt, A, B, C, D, s0


@pytest.mark.parametrize("L,chunk", [(1, 16), (15, 16), (16, 16), (63, 16), (65, 32), (100, 64)])
@pytest.mark.parametrize("G", [1, 2])
def test_ssd_chunked_matches_recurrence(L, chunk, G):
    x, dt, A, B, C, D, s0 = _ssd_inputs(2, L, 4, 8, G, 16)
    y_ref, s_ref = kernels.ssd_scan_ref(x, dt, A, B, C, D=D, initial_state=s0)
    y, s = kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size=chunk, D=D, initial_state=s0)
    assert rel_err(y, y_ref) < 1e-5
    assert rel_err(s, s_ref) < 1e-5


def test_ssd_no_initial_state_and_no_D():
    x, dt, A, B, C, _, _ = _ssd_inputs(1, 40, 2, 4, 1, 8, init=False)
    y_ref, s_ref = kernels.ssd_scan_ref(x, dt, A, B, C)
    y, s = kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size=16)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_ssd_split_scan_carries_state():
    """Scanning [0, 30) then [30, 50) from the carried state equals one scan over [0, 50)."""
    x, dt, A, B, C, D, _ = _ssd_inputs(2, 50, 4, 8, 2, 16, init=False)
    y_full, s_full = kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size=16, D=D)
    y1, s1 = kernels.ssd_chunk_scan(x[:, :30], dt[:, :30], A, B[:, :30], C[:, :30], chunk_size=16, D=D)
    y2, s2 = kernels.ssd_chunk_scan(x[:, 30:], dt[:, 30:], A, B[:, 30:], C[:, 30:], chunk_size=16, D=D,
                                    initial_state=s1)
    assert rel_err(torch.cat([y1, y2], 1), y_full) < 1e-5 and rel_err(s2, s_full) < 1e-5


def test_ssd_step_matches_scan_last_token():
    x, dt, A, B, C, D, s0 = _ssd_inputs(2, 9, 4, 8, 2, 16)
    y_ref, s_ref = kernels.ssd_scan_ref(x, dt, A, B, C, D=D, initial_state=s0)
    state = s0.clone()
    ys = [kernels.ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=D) for t in range(9)]
    assert rel_err(torch.stack(ys, 1), y_ref) < 1e-5 and rel_err(state, s_ref) < 1e-5


def _scan_inputs(b, L, Dm, N, decay_scale=8.0):
    x = torch.randn(b, L, Dm)
    dt = F.softplus(torch.randn(b, L, Dm))
    A = -torch.rand(Dm, N) * decay_scale
    return x, dt, A, torch.randn(b, L, N), torch.randn(b, L, N), torch.randn(Dm), torch.randn(b, Dm, N)


@pytest.mark.parametrize("L", [1, 5, 16, 63, 257, 300])
def test_selective_scan_matches_recurrence(L):
    x, dt, A, B, C, D, h0 = _scan_inputs(2, L, 12, 8)
    y_ref, h_ref = kernels.selective_scan_ref(x, dt, A, B, C, D=D, initial_state=h0)
    y, h = kernels.selective_scan(x, dt, A, B, C, D=D, initial_state=h0)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


@pytest.mark.parametrize("decay_scale", [6.0, 200.0])
def test_selective_scan_strong_decay_stays_finite(decay_scale):
    """Decays that would overflow fp32 (fp64) in the cumulative form take the fp64 (recurrent) path."""
    x, dt, A, B, C, D, h0 = _scan_inputs(1, 64, 8, 4, decay_scale=decay_scale)
    y_ref, h_ref = kernels.selective_scan_ref(x, dt, A, B, C, D=D, initial_state=h0)
    y, h = kernels.selective_scan(x, dt, A, B, C, D=D, initial_state=h0)
    assert torch.isfinite(y).all()
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


def test_selective_step_matches_scan():
    x, dt, A, B, C, D, h0 = _scan_inputs(2, 7, 12, 8)
    y_ref, h_ref = kernels.selective_scan_ref(x, dt, A, B, C, D=D, initial_state=h0)
    h = h0.clone()
    ys = [kernels.selective_step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=D) for t in range(7)]
    assert rel_err(torch.stack(ys, 1), y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("L", [1, 2, 9])
def test_causal_conv1d_matches_reference(K, L):
    x, w, b, st = torch.randn(2, L, 6), torch.randn(6, K), torch.randn(6), torch.randn(2, 6, K - 1)
    y_ref, s_ref = kernels.causal_conv1d_ref(x, w, b, initial_state=st, activation="silu")
    y, s = kernels.causal_conv1d(x, w, b, initial_state=st, activation="silu")
    assert rel_err(y, y_ref) < 1e-6 and torch.equal(s, s_ref)
    state = st.clone()
    ys = [kernels.causal_conv1d_step(state, x[:, t], w, b, activation="silu") for t in range(L)]
    assert rel_err(torch.stack(ys, 1), y_ref) < 1e-6 and torch.equal(state, s_ref)


def _naive_attention(q, k, v, window):
    """softmax(QK^T / sqrt(d)) V with KV heads repeated and an explicit causal (window) mask."""
    B, L, Hq, D = q.shape
    rep = Hq // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    out = torch.empty_like(q)
    for i in range(L):
        lo = 0 if window is None else max(0, i - window + 1)
        s = torch.einsum("bhd,bshd->bhs", q[:, i], k[:, lo:i + 1]) / D ** 0.5
        out[:, i] = torch.einsum("bhs,bshd->bhd", s.softmax(-1), v[:, lo:i + 1])
    return out


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("window", [None, 7])
def test_causal_attention_matches_naive(Hq, Hkv, window):
    q, k, v = torch.randn(2, 33, Hq, 16), torch.randn(2, 33, Hkv, 16), torch.randn(2, 33, Hkv, 16)
    ref = _naive_attention(q, k, v, window)
    assert rel_err(kernels.causal_attention(q, k, v, window=window), ref) < 1e-5
    assert rel_err(kernels.causal_attention_ref(q, k, v, window=window), ref) < 1e-5


@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_matches_last_row_of_prefill(window):
    q, k, v = torch.randn(3, 20, 8, 16), torch.randn(3, 20, 2, 16), torch.randn(3, 20, 2, 16)
    lens = torch.tensor([20, 11, 1])
    out = kernels.decode_attention(q[torch.arange(3), lens - 1], k, v, lens, window=window)
    for b, n in enumerate(lens.tolist()):
        full = _naive_attention(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], window)
        assert rel_err(out[b], full[0, -1]) < 1e-5
    ref = kernels.decode_attention_ref(q[torch.arange(3), lens - 1], k, v, lens, window=window)
    assert rel_err(out, ref) < 1e-5


def test_ops_validate_shapes():
    with pytest.raises(ValueError, match="multiple of"):
        kernels.causal_attention(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"dt must be \[B, L, H\]"):
        kernels.ssd_chunk_scan(torch.randn(1, 4, 2, 3), torch.randn(1, 4, 3), torch.randn(2),
                               torch.randn(1, 4, 1, 5), torch.randn(1, 4, 1, 5))


def test_backend_override_rejects_unknown(monkeypatch):
    monkeypatch.setenv("HYBRID_BACKEND", "fortran")
    with pytest.raises(kernels.BackendError, match="not a backend"):
        kernels.causal_conv1d(torch.randn(1, 3, 2), torch.randn(2, 4))
