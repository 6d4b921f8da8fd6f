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
@pytest.mark.parametrize("autograd", [False, True])
def test_selective_scan_strong_decay_stays_finite(decay_scale, autograd):
    """Inference steps the recurrence itself; under autograd, decays that would overflow fp32 (fp64) in the
    chunked cumulative form take the fp64 (recurrent) path."""
    x, dt, A, B, C, D, h0 = _scan_inputs(1, 64, 8, 4, decay_scale=decay_scale)
    y_ref, h_ref = kernels.selective_scan_ref(x, dt, A, B, C, D=D, initial_state=h0)
    y, h = kernels.selective_scan(x.requires_grad_(autograd), dt, A, B, C, D=D, initial_state=h0)
    y, h = y.detach(), h.detach()
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


# ---- packed (varlen) and paged forms ------------------------------------------------------------

CU = torch.tensor([0, 7, 8, 30], dtype=torch.int32)  # three sequences: 7, 1 and 22 tokens


def test_varlen_ops_equal_each_sequence_alone():
    T = int(CU[-1])
    x, dt, A, B, C, D, _ = _ssd_inputs(1, T, 4, 8, 2, 16, init=False)
    s0 = torch.randn(3, 4, 8, 16)
    y, fin = kernels.ssd_varlen_scan(x[0], dt[0], A, B[0], C[0], CU, chunk_size=4, D=D, initial_states=s0)
    xs, dts, As, Bs, Cs, Ds, h0 = _scan_inputs(1, T, 12, 8)
    h0 = torch.randn(3, 12, 8)
    ys, fins = kernels.selective_varlen_scan(xs[0], dts[0], As, Bs[0], Cs[0], CU, D=Ds, initial_states=h0)
    xc, w, bc, c0 = torch.randn(T, 6), torch.randn(6, 4), torch.randn(6), torch.randn(3, 6, 3)
    yc, finc = kernels.causal_conv1d_varlen(xc, w, bc, CU, initial_states=c0, activation="silu")
    for b, (lo, hi) in enumerate(zip(CU[:-1].tolist(), CU[1:].tolist(), strict=True)):
        r, f = kernels.ssd_scan_ref(x[:, lo:hi], dt[:, lo:hi], A, B[:, lo:hi], C[:, lo:hi], D=D,
                                    initial_state=s0[b:b + 1])
        assert rel_err(y[lo:hi], r[0]) < 1e-5 and rel_err(fin[b], f[0]) < 1e-5
        r, f = kernels.selective_scan_ref(xs[:, lo:hi], dts[:, lo:hi], As, Bs[:, lo:hi], Cs[:, lo:hi], D=Ds,
                                          initial_state=h0[b:b + 1])
        assert rel_err(ys[lo:hi], r[0]) < 1e-5 and rel_err(fins[b], f[0]) < 1e-5
        r, f = kernels.causal_conv1d_ref(xc[None, lo:hi], w, bc, initial_state=c0[b:b + 1], activation="silu")
        assert rel_err(yc[lo:hi], r[0]) < 1e-6 and torch.equal(finc[b], f[0])


def test_varlen_rejects_bad_cu_seqlens():
    with pytest.raises(ValueError, match="rise strictly from 0 to the 5 packed tokens"):
        kernels.causal_conv1d_varlen(torch.randn(5, 2), torch.randn(2, 3), None, torch.tensor([0, 3, 3, 5]))


def test_steps_on_slots_touch_only_their_rows():
    pool = torch.randn(5, 4, 8, 16)
    before = pool.clone()
    slots = torch.tensor([3, 0])
    x, dt, A, B, C, D, _ = _ssd_inputs(2, 1, 4, 8, 2, 16, init=False)
    own = pool[slots].clone()
    y = kernels.ssd_step(pool, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D=D, slots=slots)
    y_ref = kernels.ssd_step_ref(own, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D=D)
    # the fast path fuses the update differently from the reference: equal up to fp32 rounding
    assert rel_err(y, y_ref) < 1e-6 and rel_err(pool[slots], own) < 1e-6
    assert torch.equal(pool[[1, 2, 4]], before[[1, 2, 4]])


def _paged_pool(seqs_k, seqs_v, block_size, num_blocks):
    """Write each sequence's K/V into a shuffled set of pool blocks; return pools and block tables."""
    Hkv, D = seqs_k[0].shape[1:]
    k_pool = torch.zeros(num_blocks, block_size, Hkv, D)
    v_pool = torch.zeros_like(k_pool)
    free = torch.randperm(num_blocks).tolist()
    max_blocks = max((len(k) + block_size - 1) // block_size for k in seqs_k)
    tables = torch.zeros(len(seqs_k), max_blocks, dtype=torch.int32)
    for b, (k, v) in enumerate(zip(seqs_k, seqs_v, strict=True)):
        nb = (len(k) + block_size - 1) // block_size
        tables[b, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
        pos = torch.arange(len(k))
        slots = tables[b, pos // block_size].long() * block_size + pos % block_size
        kernels.write_kv(k_pool, v_pool, k, v, slots)
    return k_pool, v_pool, tables


@pytest.mark.parametrize("window", [None, 6])
def test_paged_prefill_and_decode_equal_contiguous(window):
    lens, new = [9, 1, 20], [3, 1, 20]  # a chunk on a cached prefix, a first token, a whole prompt
    Hq, Hkv, D = 8, 2, 16
    ks = [torch.randn(n, Hkv, D) for n in lens]
    vs = [torch.randn(n, Hkv, D) for n in lens]
    qs = [torch.randn(m, Hq, D) for m in new]
    k_pool, v_pool, tables = _paged_pool(ks, vs, block_size=4, num_blocks=16)
    cu = torch.tensor([0, 3, 4, 24], dtype=torch.int32)
    out = kernels.paged_prefill_attention(torch.cat(qs), k_pool, v_pool, cu, torch.tensor(lens), tables,
                                          window=window)
    for b in range(3):
        ref = kernels.causal_attention_ref(qs[b][None], ks[b][None], vs[b][None], window=window)[0]
        assert rel_err(out[cu[b]:cu[b + 1]], ref) < 1e-5
    q1 = torch.stack([q[-1] for q in qs])
    dec = kernels.paged_decode_attention(q1, k_pool, v_pool, torch.tensor(lens), tables, window=window)
    ref = kernels.paged_decode_attention_ref(q1, k_pool, v_pool, torch.tensor(lens), tables, window=window)
    assert rel_err(dec, ref) < 1e-5
    assert rel_err(dec, torch.stack([out[cu[b + 1] - 1] for b in range(3)])) < 1e-5


def test_varlen_attention_equals_each_sequence_alone():
    q, k, v = torch.randn(30, 8, 16), torch.randn(30, 2, 16), torch.randn(30, 2, 16)
    out = kernels.varlen_attention(q, k, v, CU, window=5)
    for lo, hi in zip(CU[:-1].tolist(), CU[1:].tolist(), strict=True):
        ref = _naive_attention(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], 5)[0]
        assert rel_err(out[lo:hi], ref) < 1e-5
