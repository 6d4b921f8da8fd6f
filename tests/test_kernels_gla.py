"""Gated linear attention: chunked (sub-chunked, log-space stable) = step by step = the token-by-token reference =
the quadratic closed form, packed = alone, initial states carried, bf16 within bf16 noise of the fp32 reference."""

import pytest
import torch
import torch.nn.functional as F
from conftest import rel_err
from hybrid.kernels import gla

from hybrid import kernels


def _inputs(b, L, H, K, V, init=True, dtype=torch.float32, strength=1.0):
    q, k, v = torch.randn(b, L, H, K), torch.randn(b, L, H, K), torch.randn(b, L, H, V)
    # per-key-dim log decays as the layer makes them (logsigmoid / normalizer), some near 0 and some strong
    g = F.logsigmoid(torch.randn(b, L, H, K) * 3) * torch.rand(H, K) * strength
    s0 = torch.randn(b, H, K, V) * 0.5 if init else None
    return q.to(dtype), k.to(dtype), v.to(dtype), g, s0


def _closed_form(q, k, v, g, s0, scale):
    """o_t = sum_{j <= t} (q_t exp(c_t - c_j)) . k_j v_j + (q_t exp(c_t)) S0, c the inclusive cumsum of g over
    the whole sequence: an independent statement of the recurrence (fine for short, mildly decayed inputs)."""
    c = g.double().cumsum(1)
    qd, kd, vd = q.double() * scale, k.double(), v.double()
    L = q.shape[1]
    decay = (c[:, :, None] - c[:, None, :]).exp()  # [b, t, j, H, K]
    mask = torch.ones(L, L, dtype=torch.bool).tril()[None, :, :, None, None]
    scores = (qd[:, :, None] * kd[:, None] * decay * mask).sum(-1)  # [b, t, j, H]
    o = torch.einsum("btjh,bjhv->bthv", scores, vd)
    return o + torch.einsum("bthk,bhkv->bthv", qd * c.exp(), s0.double())


def test_reference_is_the_closed_form():
    q, k, v, g, s0 = _inputs(2, 20, 2, 4, 3, strength=0.3)
    o, _ = kernels.gla_ref(q, k, v, g, initial_state=s0)
    assert rel_err(o, _closed_form(q, k, v, g, s0, 4 ** -0.5)) < 1e-5


@pytest.mark.parametrize("L", [1, 7, 15, 16, 17, 63, 64, 65, 130])
def test_chunked_matches_recurrence(L):
    q, k, v, g, s0 = _inputs(2, L, 3, 16, 24)
    o_ref, s_ref = kernels.gla_ref(q, k, v, g, initial_state=s0)
    o, s = kernels.gla_chunk(q, k, v, g, initial_state=s0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_no_initial_state_is_zeros():
    q, k, v, g, _ = _inputs(1, 40, 2, 8, 8, init=False)
    o_ref, s_ref = kernels.gla_ref(q, k, v, g, initial_state=torch.zeros(1, 2, 8, 8))
    o, s = kernels.gla_chunk(q, k, v, g)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_strong_decays_stay_finite_and_exact():
    """Log decays down to -40 a token: a one-reference-per-chunk form would overflow exp(-c) within a chunk;
    the sub-chunked form never takes an exponent above 0."""
    q, k, v, g, s0 = _inputs(1, 130, 2, 8, 8, strength=40.0)
    assert g.min() < -30
    o_ref, s_ref = kernels.gla_ref(q, k, v, g, initial_state=s0)
    o, s = kernels.gla_chunk(q, k, v, g, initial_state=s0)
    assert torch.isfinite(o).all() and rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("factor_max", [0.0, float("inf")])
def test_both_forms_of_the_diagonal_blocks_agree(monkeypatch, factor_max):
    """The diagonal sub-chunk blocks summed pairwise in log space (forced: factor_max 0) and factored into one
    matmul (forced: inf; the default for mild decays) give the reference."""
    q, k, v, g, s0 = _inputs(2, 70, 2, 16, 8, strength=0.5)
    assert -g.sum(1).min() > 1.0  # decays that matter
    monkeypatch.setattr(gla, "_FACTOR_MAX", factor_max)
    o_ref, s_ref = kernels.gla_ref(q, k, v, g, initial_state=s0)
    o, s = kernels.gla_chunk(q, k, v, g, initial_state=s0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("chunk_size", [16, 24, 32])  # 24: not a multiple of the sub-chunk (one block per chunk)
def test_chunk_size_and_block_change_nothing(monkeypatch, chunk_size):
    """Other chunk sizes and a block boundary inside the sequence (the walk carries the state across blocks)."""
    q, k, v, g, s0 = _inputs(1, 100, 2, 8, 8)
    o_ref, s_ref = kernels.gla_ref(q, k, v, g, initial_state=s0)
    monkeypatch.setattr(gla, "_BLOCK", 48)
    o, s = kernels.gla_chunk(q, k, v, g, initial_state=s0, chunk_size=chunk_size)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


def test_step_matches_recurrence_and_split_carries_state():
    q, k, v, g, s0 = _inputs(3, 9, 4, 16, 8)
    o_ref, s_ref = kernels.gla_ref(q, k, v, g, initial_state=s0)
    state = s0.clone()
    ys = [kernels.gla_step(state, q[:, t], k[:, t], v[:, t], g[:, t]) for t in range(9)]
    assert rel_err(torch.stack(ys, 1), o_ref) < 1e-5 and rel_err(state, s_ref) < 1e-5
    o1, s1 = kernels.gla_chunk(q[:, :5], k[:, :5], v[:, :5], g[:, :5], initial_state=s0)
    o2, s2 = kernels.gla_chunk(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], initial_state=s1)
    assert rel_err(torch.cat([o1, o2], 1), o_ref) < 1e-5 and rel_err(s2, s_ref) < 1e-5


def test_step_on_pool_slots_and_bf16_state():
    q, k, v, g, _ = _inputs(2, 1, 2, 8, 8)
    pool = torch.randn(5, 2, 8, 8)
    slots = torch.tensor([3, 1])
    expect = pool[slots].clone()
    low = pool.to(torch.bfloat16)  # the same rows stored in bf16 (before the fp32 pool is stepped)
    y_ref = kernels.gla_step_ref(expect, q[:, 0], k[:, 0], v[:, 0], g[:, 0], scale=0.3)
    untouched = pool[[0, 2, 4]].clone()
    y = kernels.gla_step(pool, q[:, 0], k[:, 0], v[:, 0], g[:, 0], scale=0.3, slots=slots)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(pool[slots], expect) < 1e-5
    assert torch.equal(pool[[0, 2, 4]], untouched)
    before = low.clone()
    y_low = kernels.gla_step(low, q[:, 0], k[:, 0], v[:, 0], g[:, 0], scale=0.3, slots=slots)
    assert rel_err(y_low, y_ref) < 2e-2 and rel_err(low[slots], expect) < 1e-2
    assert torch.equal(low[[0, 2, 4]], before[[0, 2, 4]])  # rows of other sequences untouched


def test_varlen_equals_each_sequence_alone():
    lens = [5, 64, 70, 1, 17]
    T = sum(lens)
    q, k, v, g, _ = _inputs(1, T, 4, 16, 8)
    s0 = torch.randn(len(lens), 4, 16, 8)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o, finals = kernels.gla_varlen(q[0], k[0], v[0], g[0], cu, initial_states=s0)
    o_ref, f_ref = kernels.gla_varlen_ref(q[0], k[0], v[0], g[0], cu, initial_states=s0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(finals, f_ref) < 1e-5
    for i in range(len(lens)):
        s = slice(int(cu[i]), int(cu[i + 1]))
        oi, fi = kernels.gla_chunk(q[:, s], k[:, s], v[:, s], g[:, s], initial_state=s0[i:i + 1])
        assert torch.allclose(o[s], oi[0], atol=1e-6) and torch.allclose(finals[i], fi[0], atol=1e-6)


def test_bf16_within_bf16_noise_of_fp32_reference():
    """bf16 inputs: the chunked output is as close to the fp32 reference as feeding bf16-rounded inputs
    through the exact reference and rounding its output to bf16 (the noise bf16 itself brings), within 2x."""
    q, k, v, g, s0 = _inputs(1, 150, 2, 32, 32)
    o32, _ = kernels.gla_ref(q, k, v, g, initial_state=s0)
    lo = [t.to(torch.bfloat16) for t in (q, k, v)]
    o16, s16 = kernels.gla_chunk(*lo, g, initial_state=s0)
    noise_ref, _ = kernels.gla_ref(*lo, g, initial_state=s0)
    noise = rel_err(noise_ref, o32)
    assert o16.dtype == torch.bfloat16 and s16.dtype == torch.float32
    assert rel_err(o16, o32) <= 2 * noise + 1e-6


def test_chunked_backprops_like_the_reference():
    """The torch chunked path runs under autograd (a GLA model trains, e.g. the MQAR family): same gradients."""
    q, k, v, g, s0 = _inputs(1, 40, 2, 8, 8)
    grads = []
    for fn in (kernels.gla_ref, lambda *a, **kw: kernels.gla_chunk(*a, chunk_size=16, **kw)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
        o, s = fn(*leaves, initial_state=s0)
        (o.square().sum() + s.sum()).backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads, strict=True):
        assert rel_err(b, a) < 1e-4


def test_bad_shapes_are_refused():
    q, k, v, g, _ = _inputs(1, 4, 2, 8, 8)
    with pytest.raises(ValueError, match="q, k and g"):
        kernels.gla_chunk(q, k, v, g[..., :4])
    with pytest.raises(ValueError, match="v"):
        kernels.gla_chunk(q, k, v[:, :, :1], g)
