"""Gated linear attention (GLA, as flash-linear-attention defines it): chunked forward for prefill, the one-token
step for decode, and the token-by-token ``*_ref`` beside them.

Shapes: ``q, k: [B, L, H, K]``, ``v: [B, L, H, V]``, ``g: [B, L, H, K]`` (the per-key-dim log decay, <= 0: the
layer's ``logsigmoid(.) / gate_logit_normalizer``), state ``[B, H, K, V]`` in fp32; ``scale`` (default
``K ** -0.5``) multiplies ``q``. Grouped heads are expanded by the layer, so every tensor has the H heads.

Recurrence (per head): ``S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t scale``.

Chunked form (chunks of C tokens, ``c`` the running log decay inside a chunk, per key dim, inclusive): from the
state ``S`` at a chunk's start, ``O = (Q * exp(c)) S + A V`` with ``A_ij = sum_d q_id k_jd exp(c_id - c_jd)``
(``j <= i``), and ``S <- diag(exp(c_C)) S + (K * exp(c_C - c))^T V``. No exponent used exceeds 0 (bar the
bounded case below), so nothing overflows whatever the decay: ``A`` is built as fla's ``chunk_gla`` builds it,
in sub-chunks of 16 tokens; a block below the diagonal, sub-chunk I against an earlier J, factors through the
log decay ``r`` at the end of sub-chunk I-1 (``exp(c_i - c_j) = exp(c_i - r) exp(r - c_j)``, both factors
<= 1), so it is one matmul; the 16 x 16 blocks on the diagonal are one matmul through the sub-chunk's start
when no sub-chunk decays by more than e^-30 (the factor exp(-c) then stays below e^30), else summed pairwise in
log space. Accumulation is fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cuda_backend, dispatch, native
from .native import ops as native_ops
from .packing import check_cu_seqlens, sequences, slot_rows
from .state_tiles import update_in_fp32_tiles

_CHUNK = 64  # chunk of the torch path (fla's): the inter-chunk walk takes L / 64 steps
_SUB = 16  # sub-chunk of the intra-chunk scores (fla's secondary chunks): the pairwise log-space blocks
# Tokens processed at once: the intra-chunk temporaries ([H, n, C, 16, K] on the diagonal) are sized by this
# block, not by the sequence, so a long prompt costs the working memory of a short one.
_BLOCK = 1024
# Largest decay (nats) within a sub-chunk for which its diagonal block is factored into one matmul: the factor
# exp(-c) reaches e^30 ~ 1e13, far inside fp32; beyond it (a gate of -2 a token and more, over 16 tokens) the
# block is summed pairwise in log space. The layer's gates (logsigmoid / 16) rarely get there.
_FACTOR_MAX = 30.0


def _check_shapes(q, k, v, g, lead: int) -> None:
    if q.dim() != lead + 2 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"gla: q, k and g must be [..., H, K] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)} and {tuple(g.shape)}")
    if v.dim() != q.dim() or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(f"gla: v {tuple(v.shape)} must share q's leading dims and heads {tuple(q.shape[:-1])}")


# ---- reference ---------------------------------------------------------------------------------------------

def gla_ref(q, k, v, g, *, scale=None, initial_state=None):
    """Token by token in fp32 (the recurrence as written): the reference the chunked form is checked against.
    Returns (o [B, L, H, V] in v's dtype, final state [B, H, K, V] fp32)."""
    b, L, H, V = v.shape
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    qf, kf, vf, gf = q.float() * scale, k.float(), v.float(), g.float()
    S = torch.zeros(b, H, K, V, device=v.device) if initial_state is None else initial_state.float().clone()
    out = []
    for t in range(L):
        S = S * gf[:, t].exp()[..., None] + kf[:, t, :, :, None] * vf[:, t, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, qf[:, t]))
    return torch.stack(out, 1).to(v.dtype), S


def gla_step_ref(state, q, k, v, g, *, scale=None):
    """One token: state [n, H, K, V] (updated in place), q/k/g [n, H, K], v [n, H, V] -> o [n, H, V]."""
    o, S = gla_ref(q[:, None], k[:, None], v[:, None], g[:, None], scale=scale, initial_state=state)
    state.copy_(S)
    return o[:, 0]


def gla_varlen_ref(q, k, v, g, cu_seqlens, *, scale=None, initial_states=None):
    return _varlen(gla_ref, q, k, v, g, cu_seqlens, scale=scale, initial_states=initial_states)


# ---- torch chunked path ------------------------------------------------------------------------------------

def _suffix(g: torch.Tensor) -> torch.Tensor:
    """Exclusive suffix sums along the tokens (dim -2): sum of g after each token, summed from the end, not as
    a difference of two running sums (which loses what a large decay before the token adds to both)."""
    return g.flip(-2).cumsum(-2).flip(-2) - g


def _intra(q, k, g, s):
    """The causal intra-chunk scores A [.., n, C, C] of q/k/g [.., n, C, K] (q scaled, g the log decay), in
    sub-chunks of s tokens: no exponent above 0, and every log decay a sum within the sub-chunks it spans (so its
    fp32 rounding is that of 16 tokens' decays, not of the whole chunk's)."""
    *lead, C, K = q.shape
    ns = C // s
    qs, ks, gs = (x.reshape(*lead, ns, s, K) for x in (q, k, g))
    cl = gs.cumsum(-2)  # running log decay inside each sub-chunk
    # diagonal sub-chunks: sum_d q_id k_jd exp(c_id - c_jd) for j <= i   [.., ns, s, s]
    if -float(cl.detach()[..., -1, :].min()) <= _FACTOR_MAX:
        # every sub-chunk decays by at most e^-_FACTOR_MAX: factored through its start, (q exp(c)) (k exp(-c))^T,
        # one matmul; k exp(-c) <= e^_FACTOR_MAX, and each product q_i k_j exp(c_i - c_j) (j <= i) is as exact
        # as the pairwise one (those above the diagonal may be large, never inf, and are masked out)
        diag = torch.matmul(qs * cl.exp(), (ks * (-cl).exp()).transpose(-1, -2))
    else:
        # pairwise in log space (what fla's chunk_gla does on the diagonal). In place where nothing is
        # differentiated (inference: one [.., s, s, K] temporary); out of place under autograd (a GLA model
        # training), which needs what the in-place forms overwrite
        decay = cl[..., :, None, :] - cl[..., None, :, :]
        kd = (decay.clamp(max=0.0).exp() * ks[..., None, :, :] if torch.is_grad_enabled()
              else decay.clamp_(max=0.0).exp_().mul_(ks[..., None, :, :]))  # k_j exp(c_i - c_j)  [.., i, j, K]
        diag = torch.matmul(kd, qs[..., :, :, None]).squeeze(-1)  # . q_i over K  [.., i, j]
        del decay, kd
    A = q.new_zeros(*lead, ns, s, ns, s)
    tri = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    idx = torch.arange(ns, device=q.device)
    A[..., idx, :, idx, :] = diag.masked_fill(~tri, 0.0).movedim(-3, 0)
    if ns > 1:
        # below the diagonal, sub-chunk I (>= 1) against J < I: exp(c_i - c_j) = exp(c_i - r) exp(r - c_j) with
        # r the log decay at the end of sub-chunk I-1: c_i - r is I's own running sum, r - c_j the decay after j
        # in J plus the whole of the sub-chunks between (J < M < I)
        total = cl[..., -1, :]  # [.., ns, K]
        between = torch.ones(ns, ns, ns, dtype=torch.bool, device=q.device)
        ar = torch.arange(ns, device=q.device)
        between &= (ar[None, :, None] < ar[None, None, :]) & (ar[None, None, :] < ar[:, None, None])  # J < M < I
        mid = torch.einsum("IJM,...MK->...IJK", between[1:].to(g.dtype), total)  # [.., ns-1, ns, K]
        qr = qs[..., 1:, :, :] * cl[..., 1:, :, :].exp()  # [.., I, s, K]
        # J >= I gives exponents that mean nothing (and may be > 0): clamped, then masked out
        kr = ks[..., None, :, :, :] * (_suffix(gs)[..., None, :, :, :] + mid[..., None, :]).clamp(max=0.0).exp()
        off = torch.einsum("...Iik,...IJjk->...IiJj", qr, kr)  # [.., ns-1, s, ns, s]
        below = torch.ones(ns - 1, ns, dtype=torch.bool, device=q.device).tril()  # J <= I-1
        A[..., 1:, :, :, :] += off * below[:, None, :, None]
    return A.reshape(*lead, C, C)


def _block(q, k, v, g, S, C):
    """One block of whole chunks, heads first: q/k/g [b, H, n, C, K] fp32 (q scaled), v [b, H, n, C, V]; S
    [b, H, K, V] the state at the block's start. Returns (o [b, H, n, C, V], S at its end)."""
    b, H, n = q.shape[:3]
    c = g.cumsum(-2)  # running log decay inside each chunk, per key dim
    s = _SUB if C % _SUB == 0 else C
    A = _intra(q, k, g, s)
    k_end = (k * _suffix(g).exp()).transpose(-1, -2)  # keys decayed to the chunk's end [.., K, C]
    chunk_decay = c[..., -1:, :].exp().transpose(-1, -2)  # [b, H, n, K, 1]
    starts = []  # the state at each chunk's start (a list: stacking keeps autograd free of in-place writes)
    for i in range(n):  # the walk: one matmul per chunk
        starts.append(S)
        S = torch.baddbmm((S * chunk_decay[:, :, i]).flatten(0, 1), k_end[:, :, i].flatten(0, 1),
                          v[:, :, i].flatten(0, 1)).view_as(S)
    o = torch.matmul(q * c.exp(), torch.stack(starts, 2)) + torch.matmul(A, v)
    return o, S


def _heads_first(x, s, e, n, C):
    """Tokens [s, e) of x [b, L, H, D] -> fp32 [b, H, n, C, D], zero-padded to n whole chunks (padded tokens:
    k = 0 writes nothing and g = 0 decays nothing, so the state leaving the block is exact)."""
    x = x[:, s:e].float()
    pad = n * C - (e - s)
    x = F.pad(x, (0, 0, 0, 0, 0, pad)) if pad else x
    return x.movedim(1, 2).reshape(x.shape[0], x.shape[2], n, C, x.shape[3])


def _chunk_torch(q, k, v, g, *, scale=None, initial_state=None, chunk_size=_CHUNK):
    b, L, H, V = v.shape
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    C = chunk_size
    S = torch.zeros(b, H, K, V, device=v.device) if initial_state is None else initial_state.float().clone()
    o = torch.empty(b, L, H, V, device=v.device, dtype=v.dtype)
    block = max(C, _BLOCK // C * C)
    for s in range(0, L, block):
        e = min(L, s + block)
        n = -(-(e - s) // C)
        ob, S = _block(_heads_first(q, s, e, n, C) * scale, _heads_first(k, s, e, n, C),
                       _heads_first(v, s, e, n, C), _heads_first(g, s, e, n, C), S, C)
        o[:, s:e] = ob.reshape(b, H, n * C, V)[:, :, :e - s].transpose(1, 2)
    return o, S


def _varlen(chunk, q, k, v, g, cu_seqlens, *, scale=None, initial_states=None, **kw):
    o = torch.empty_like(v)
    finals = []
    for i, s in sequences(cu_seqlens):
        init = None if initial_states is None else initial_states[i:i + 1]
        oi, fi = chunk(q[None, s], k[None, s], v[None, s], g[None, s], scale=scale, initial_state=init, **kw)
        o[s] = oi[0]
        finals.append(fi)
    return o, torch.cat(finals)


def _varlen_torch(q, k, v, g, cu_seqlens, *, scale=None, initial_states=None, chunk_size=_CHUNK):
    return _varlen(_chunk_torch, q, k, v, g, cu_seqlens, scale=scale, initial_states=initial_states,
                   chunk_size=chunk_size)


def _step_torch(state, q, k, v, g, *, scale=None, slots=None):
    # Decode is bound by moving the state (H K V floats per sequence and layer): update the rows in place a tile
    # of sequences at a time (.state_tiles), one decay-and-write pass (S = a S + k v^T) and one read (q^T S); a
    # bf16 state's tile is copied to fp32, updated and rounded back once.
    rows, scatter = slot_rows(state, slots)
    n, H, K, V = rows.shape
    scale = K ** -0.5 if scale is None else scale
    if not rows.is_contiguous():
        y = gla_step_ref(rows, q, k, v, g, scale=scale)
    else:
        decay = g.float().exp().reshape(n * H, K, 1)
        kT = k.float().reshape(n * H, K, 1)
        vf = v.float().reshape(n * H, 1, V)
        qf = (q.float() * scale).reshape(n * H, 1, K)
        y = torch.empty(n * H, 1, V, device=v.device)

        def update(i, j, f):
            r = slice(i * H, j * H)
            Sv = f.view((j - i) * H, K, V)
            Sv.mul_(decay[r]).baddbmm_(kT[r], vf[r])
            torch.bmm(qf[r], Sv, out=y[r])

        update_in_fp32_tiles(rows, update)
        y = y.view(n, H, V).to(v.dtype)
    if scatter:
        state.index_copy_(0, slots, rows)
    return y


# ---- cuda: flash-linear-attention (fla-core) ---------------------------------------------------------------
# Wired as the gated delta rule's is, but never run here (no GPU in the sessions that wrote it): chunk_gla and
# fused_recurrent_gla take our [B, T, H, K] layout and a [N, H, K, V] state.

def _fla_chunk(q, k, v, g, *, scale=None, initial_state=None, chunk_size=_CHUNK):
    o, S = cuda_backend.fla_gla("chunk")(q=q, k=k, v=v, g=g.float(), scale=scale, initial_state=initial_state,
                                         output_final_state=True)
    return o, S.float()


def _fla_varlen(q, k, v, g, cu_seqlens, *, scale=None, initial_states=None, chunk_size=_CHUNK):
    o, S = cuda_backend.fla_gla("chunk")(q=q[None], k=k[None], v=v[None], g=g.float()[None], scale=scale,
                                         initial_state=initial_states, output_final_state=True,
                                         cu_seqlens=cu_seqlens.long())
    return o[0], S.float()


def _fla_step(state, q, k, v, g, *, scale=None, slots=None):
    rows, scatter = slot_rows(state, slots)
    o, S = cuda_backend.fla_gla("recurrent")(q=q[:, None], k=k[:, None], v=v[:, None], gk=g.float()[:, None],
                                             scale=scale, initial_state=rows.float(), output_final_state=True)
    rows.copy_(S)
    if scatter:
        state.index_copy_(0, slots, rows)
    return o[:, 0]


# ---- public ops --------------------------------------------------------------------------------------------

def gla_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *, scale: float | None = None,
              initial_state: torch.Tensor | None = None,
              chunk_size: int = _CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """GLA over a batch: q/k/g [B, L, H, K], v [B, L, H, V], initial_state [B, H, K, V] or None (zeros).
    Returns (o [B, L, H, V] in v's dtype, final state [B, H, K, V] fp32)."""
    _check_shapes(q, k, v, g, 2)
    _, fn = dispatch.choose("gla_chunk", v.device.type)
    return fn(q, k, v, g, scale=scale, initial_state=initial_state, chunk_size=chunk_size)


def gla_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, cu_seqlens: torch.Tensor, *,
               scale: float | None = None, initial_states: torch.Tensor | None = None,
               chunk_size: int = _CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Over a packed batch: q/k/g [T, H, K], v [T, H, V], cu_seqlens [N+1], initial_states [N, H, K, V] or
    None. Returns (o [T, H, V], final states [N, H, K, V] fp32); no state crosses a boundary."""
    _check_shapes(q, k, v, g, 1)
    check_cu_seqlens(cu_seqlens, v.shape[0], "gla_varlen")
    _, fn = dispatch.choose("gla_varlen", v.device.type)
    return fn(q, k, v, g, cu_seqlens, scale=scale, initial_states=initial_states, chunk_size=chunk_size)


def gla_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *,
             scale: float | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step, updating the state in place: ``state`` [n, H, K, V] (fp32 or bf16), or with ``slots``
    ([n] int64) a pool [S, H, K, V] whose rows ``slots`` belong to the batch. q/k/g [n, H, K], v [n, H, V]
    -> o [n, H, V]."""
    _check_shapes(q, k, v, g, 1)
    _, fn = dispatch.choose("gla_step", v.device.type)
    return fn(state, q, k, v, g, scale=scale, slots=slots)


def _decay_torch(x, normalizer, clamp_min=None):
    g = F.logsigmoid(x.float()) / normalizer
    return g if clamp_min is None else g.clamp(min=clamp_min)


def decay(x: torch.Tensor, normalizer: float, clamp_min: float | None = None) -> torch.Tensor:
    """The per-key-dim log decay ``logsigmoid(x) / normalizer`` (clamped from below at ``clamp_min``), fp32. On a
    CPU without autograd, for a decode step's rows [n <= 64, width], linear_attention.c's loop, the decode
    program's: libm's exp / log1p, where torch's are Sleef's (the two differ in the last fp32 bit now and then,
    and a state carries it on)."""
    _, fn = dispatch.choose("gla_decay", x.device.type)
    return fn(x, normalizer, clamp_min)


def flops_per_token(n_heads: int, head_k_dim: int, head_v_dim: int) -> float:
    """FLOPs one token costs in the recurrent form (decay, rank-1 write, output q^T S: 5 per state element), the
    count the GFLOP/s of a prefill are reported against (the chunked form does more work)."""
    return 5.0 * n_heads * head_k_dim * head_v_dim


dispatch.register("gla_chunk", "torch", _chunk_torch)
dispatch.register("gla_varlen", "torch", _varlen_torch)
dispatch.register("gla_step", "torch", _step_torch)
# decode on the CPU: linear_attention.c's one pass over the state per (sequence, head) (torch takes two)
dispatch.register("gla_step", "native", native_ops.gla_step, native.available, native_ops.supports_gla_step)
dispatch.register("gla_decay", "torch", _decay_torch)
dispatch.register("gla_decay", "native", native_ops.gla_decay, native.available, native_ops.supports_gla_decay)
_fla = cuda_backend.probe("fla_gla")
dispatch.register("gla_chunk", "cuda", _fla_chunk, _fla)
dispatch.register("gla_varlen", "cuda", _fla_varlen, _fla)
dispatch.register("gla_step", "cuda", _fla_step, _fla)

__all__ = ["decay", "flops_per_token", "gla_chunk", "gla_ref", "gla_step", "gla_step_ref", "gla_varlen",
           "gla_varlen_ref"]
