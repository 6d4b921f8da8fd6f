"""The gated delta rule (Gated DeltaNet, as Qwen3-Next and flash-linear-attention define it): chunked forward in
the WY/UT form for prefill, the one-token step for decode, and the token-by-token ``*_ref`` beside them.

Shapes: ``q, k: [B, L, Hk, K]`` (Hk key heads, each serving ``H / Hk`` consecutive value heads, as Qwen3-Next's
``repeat_interleave``), ``v: [B, L, H, V]``, ``g: [B, L, H]`` (log decay, <= 0), ``beta: [B, L, H]`` (write
strength in (0, 1)), state ``[B, H, K, V]`` in fp32. ``q`` and ``k`` come L2-normalised (the layer does it);
``scale`` (default ``K ** -0.5``) multiplies ``q``.

Recurrence (per value head): ``S_t = a_t S_{t-1} + k_t (beta_t (v_t - a_t S_{t-1}^T k_t))^T``, ``o_t = S_t^T q_t
scale`` with ``a_t = exp(g_t)``: decay the state, read what it predicts for ``k_t``, write the correction.

Chunked form (chunks of C tokens, running log-decay ``c_i`` inside a chunk, ``G_ij = exp(c_i - c_j)`` for
``i >= j``): the C delta updates of a chunk collapse into one triangular solve (the UT transform),
``T = (I + strictly_lower(beta K K^T * G))^-1``, ``U = T (beta V)``, ``W = T (beta K * exp(c))``; then per chunk,
from the state ``S`` at its start: ``V' = U - W S`` (the new values), ``O = (Q * exp(c)) S + (Q K^T * G) V'`` and
``S <- exp(c_C) S + (K * exp(c_C - c))^T V'``. Everything but the walk of ``S`` through the chunks is batched
over every chunk of a block of tokens; accumulation is fp32 whatever the input dtype. Inference
(:func:`_block_inference`) lays the chunks first, solves for ``U`` and ``W`` in place (:func:`ut_solve`: on a CPU
linear_attention.c's forward substitution, else ``T`` explicitly and a matmul) and walks the chunks in place;
under autograd (:func:`_block`) the same algebra runs out of place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cuda_backend, dispatch, native
from .native import ops as native_ops
from .packing import check_cu_seqlens, sequences, slot_rows
from .state_tiles import update_in_fp32_tiles

_CHUNK = 64  # chunk of the torch path: the [C, C] UT solve and decays stay small, the walk takes L / 64 steps
# Tokens processed at once: the batched intra-chunk temporaries ([H, n, C, C] and the expanded q/k) are sized by
# this block, not by the sequence, so a 32K prompt costs the working memory of a 2K one.
_BLOCK = 2048
# exp(c_i - c_j) is clamped from below at e^-80 (a normal fp32): a decay that small scales what it multiplies
# by < 2e-35, below any fp32 rounding, and the exp never produces denormals (slow on x86) or sees -inf.
_LOG_FLOOR = -80.0


def _check_shapes(q, k, v, g, beta, lead: int) -> None:
    if q.dim() != lead + 2 or k.shape != q.shape:
        raise ValueError(f"gated delta: q and k must be [..., Hk, K] of one shape, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    H, Hk = v.shape[-2], q.shape[-2]
    if v.shape[:-2] != q.shape[:-2] or H % Hk:
        raise ValueError(f"gated delta: v {tuple(v.shape)} must share q's leading dims {tuple(q.shape[:-2])} and "
                         f"have a multiple of q's {Hk} heads")
    if g.shape != v.shape[:-1] or beta.shape != v.shape[:-1]:
        raise ValueError(f"gated delta: g {tuple(g.shape)} and beta {tuple(beta.shape)} must be v's leading "
                         f"dims {tuple(v.shape[:-1])}")


def _expand(x: torch.Tensor, H: int) -> torch.Tensor:
    """Key heads [..., Hk, K] -> one per value head [..., H, K] (head h reads key head h // (H / Hk))."""
    return x if x.shape[-2] == H else x.repeat_interleave(H // x.shape[-2], dim=-2)


# ---- reference ---------------------------------------------------------------------------------------------

def gated_delta_ref(q, k, v, g, beta, *, scale=None, initial_state=None):
    """Token by token in fp32 (the recurrence as written): the reference the chunked form is checked against.
    Returns (o [B, L, H, V] in v's dtype, final state [B, H, K, V] fp32)."""
    b, L, H, V = v.shape
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    qf, kf = _expand(q, H).float() * scale, _expand(k, H).float()
    S = torch.zeros(b, H, K, V, device=v.device) if initial_state is None else initial_state.float().clone()
    out = []
    for t in range(L):
        S = S * g[:, t].float().exp()[..., None, None]
        pred = torch.einsum("bhkv,bhk->bhv", S, kf[:, t])
        delta = beta[:, t].float()[..., None] * (v[:, t].float() - pred)
        S = S + kf[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, qf[:, t]))
    return torch.stack(out, 1).to(v.dtype), S


def gated_delta_step_ref(state, q, k, v, g, beta, *, scale=None):
    """One token: state [n, H, K, V] (updated in place), q/k [n, Hk, K], v [n, H, V], g/beta [n, H] -> o [n, H, V]."""
    o, S = gated_delta_ref(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], scale=scale,
                           initial_state=state)
    state.copy_(S)
    return o[:, 0]


def gated_delta_varlen_ref(q, k, v, g, beta, cu_seqlens, *, scale=None, initial_states=None):
    return _varlen(gated_delta_ref, q, k, v, g, beta, cu_seqlens, scale=scale, initial_states=initial_states)


# ---- torch chunked path ------------------------------------------------------------------------------------

def _block(q, k, v, g, beta, S, C):
    """One block of whole chunks, heads first: q/k [b, H, n, C, K] fp32 (q scaled), v [b, H, n, C, V], g/beta
    [b, H, n, C]; S [b, H, K, V] the state at the block's start. Returns (o [b, H, n, C, V], S at its end)."""
    b, H, n = q.shape[:3]
    # in place where nothing is differentiated (inference); out of place under autograd (training, e.g. MQAR),
    # which needs the tensors the in-place forms overwrite
    grad = torch.is_grad_enabled()
    c = g.cumsum(-1)  # running log-decay inside each chunk
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = c[..., :, None] - c[..., None, :]
    decay = (diff.clamp(_LOG_FLOOR, 0.0).exp().masked_fill(~lower, 0.0) if grad
             else diff.clamp_(_LOG_FLOOR, 0.0).exp_().masked_fill_(~lower, 0.0))
    kb = k * beta[..., None]
    kT = k.transpose(-1, -2)
    # the UT system I + strictly_lower(beta K K^T * G); solve_triangular ignores the diagonal (unitriangular)
    ut = torch.matmul(kb, kT) * decay if grad else torch.matmul(kb, kT).mul_(decay)
    kbe = kb * c.exp()[..., None] if grad else kb.mul_(c.exp()[..., None])
    rhs = torch.cat([v * beta[..., None], kbe], -1)  # [beta V | beta K exp(c)]
    uw = torch.linalg.solve_triangular(ut, rhs, upper=False, unitriangular=True)
    V = v.shape[-1]
    U, W = uw[..., :V], uw[..., V:]
    attn = torch.matmul(q, kT) * decay if grad else torch.matmul(q, kT).mul_(decay)  # intra-chunk, causal
    c_last = c[..., -1:]
    k_end = k.mul((c_last - c).exp()[..., None]).transpose(-1, -2)  # keys decayed to the chunk's end [.., K, C]
    chunk_decay = c_last.exp()[..., None]  # [b, H, n, 1, 1]
    starts = torch.empty(b, H, n, *S.shape[-2:], device=q.device)  # the state at each chunk's start
    Vn = torch.empty_like(U)
    starts_l, vn_l = [], []  # under autograd: kept per chunk and stacked (a slice write would bump their version)
    for i in range(n):  # the walk: two matmuls per chunk
        vn = torch.baddbmm(U[:, :, i].flatten(0, 1), W[:, :, i].flatten(0, 1), S.flatten(0, 1),
                           alpha=-1.0).view_as(U[:, :, i])
        if grad:
            starts_l.append(S)
            vn_l.append(vn)
        else:
            starts[:, :, i] = S
            Vn[:, :, i] = vn
        S = torch.baddbmm((S * chunk_decay[:, :, i]).flatten(0, 1), k_end[:, :, i].flatten(0, 1),
                          vn.flatten(0, 1)).view_as(S)
    if grad:
        starts, Vn = torch.stack(starts_l, 2), torch.stack(vn_l, 2)
    qe = q * c.exp()[..., None] if grad else q.mul_(c.exp()[..., None])
    o = torch.matmul(qe, starts) + torch.matmul(attn, Vn)
    return o, S


def _heads_first(x, s, e, n, C):
    """Tokens [s, e) of x [b, L, H, ...] -> fp32 [b, H, n, C, ...], zero-padded to n whole chunks (padded tokens:
    beta = 0 writes nothing and g = 0 decays nothing, so the state leaving the block is exact)."""
    x = x[:, s:e].float()
    pad = n * C - (e - s)
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) if pad else x
    return x.movedim(1, 2).reshape(x.shape[0], x.shape[2], n, C, *x.shape[3:])


def _chunks_first(x, s, e, n, C):
    """Tokens [s, e) of x [b, L, Hx, X] -> a fresh fp32 [n, b * Hx, C, X], zero-padded to n whole chunks, in one
    copy (the dtype cast included). Chunks first, so the walk's per-chunk operands are contiguous slices; always
    a copy, so the caller may overwrite it (padded tokens: beta = 0 writes nothing and g = 0 decays nothing, so
    the state leaving the block is exact)."""
    b, Hx, X = x.shape[0], x.shape[2], x.shape[3]
    out = torch.empty(n, b, Hx, C, X, device=x.device)
    full = (e - s) // C
    if full:
        out[:full].copy_(x[:, s:s + full * C].reshape(b, full, C, Hx, X).permute(1, 0, 3, 2, 4))
    if (tail := e - s - full * C):
        out[full, :, :, :tail].copy_(x[:, s + full * C:e].transpose(1, 2))
        out[full, :, :, tail:] = 0
    return out.view(n, b * Hx, C, X)


def _ut_solve_torch(A, *X):
    # T = (I + strictly_lower(A))^-1 explicitly, then T X as a matmul: the solve on the [C, C] identity and one
    # batched [C, C] x [C, W] product cost ~0.6x the solve on the W columns (2K block, 2 threads: 25 against
    # 42 ms), the triangular solve being the slow kernel of the two
    eye = torch.eye(A.shape[-1], device=A.device).expand(A.shape)
    T = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
    return tuple(torch.matmul(T, x) for x in X)


def _ut_solve_native(A, *X):
    return tuple(native_ops.gdn_ut_solve(A, x) for x in X)


def _ut_solve_supports(A, *X):
    for x in X:
        if (why := native_ops.supports_gdn_ut_solve(A, x)) is not None:
            return why
    return None


def ut_solve(A: torch.Tensor, *X: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The UT transform's systems: (I + strictly_lower(A))^-1 x for fp32 A [..., C, C] (the diagonal and above
    not read) and each x [..., C, W] of X. Inference only; each x may be overwritten (the native forward
    substitution solves in place and returns them)."""
    _, fn = dispatch.choose("gated_delta_ut", A.device.type)
    return fn(A, *X)


def _chunk_prep_torch(q, k, kk, qk, c, beta, v):
    n, Hk, C, K = q.shape
    bH = v.shape[1]
    rep = bH // Hk

    def per_head(x):  # [n, H, ...] -> [n, Hk, rep, ...]: value heads grouped by their key head
        return x.view(n, Hk, rep, *x.shape[2:])

    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu_(1)
    decay = (c[..., :, None] - c[..., None, :]).clamp_(_LOG_FLOOR, 0.0).exp_().masked_fill_(upper, 0.0)
    # the UT system I + strictly_lower(beta K K^T * G); the solve ignores the diagonal and above
    ut = torch.mul(kk[:, :, None], per_head(decay)).mul_(per_head(beta)[..., None]).view(n, bH, C, C)
    ec = c.exp()
    U = v.mul_(beta[..., None])  # beta V (v is our own copy)
    W = torch.empty(n, bH, C, K, device=q.device)  # beta K exp(c)
    torch.mul(k[:, :, None], per_head(beta * ec)[..., None], out=per_head(W))
    U, W = ut_solve(ut, U, W)  # each contiguous: a strided operand cost the walk's products a copy
    del ut
    qe = torch.empty(n, bH, C, K, device=q.device)  # Q exp(c) per value head
    torch.mul(q[:, :, None], per_head(ec)[..., None], out=per_head(qe))
    attn = per_head(decay).mul_(qk[:, :, None]).view(n, bH, C, C)  # intra-chunk, causal
    # keys decayed to their chunk's end, written in k's layout and read transposed by the state update (the
    # transposed write cost 0.3 ms more a 1024-token block; the product takes either at one speed)
    k_end = torch.empty(n, bH, C, K, device=q.device)
    torch.mul(k[:, :, None], per_head((c[..., -1:] - c).exp_())[..., None], out=per_head(k_end))
    return U, W, qe, k_end, attn


def chunk_prep(q, k, kk, qk, c, beta, v):
    """The walk's operands for a block of chunks (inference): q/k [n, Hk, C, K] fp32 (q scaled), their products
    kk = K K^T and qk = Q K^T [n, Hk, C, C], the running log decay c and beta [n, H, C], v [n, H, C, V] (the
    caller's copy, overwritten) -> U, W (the UT transform's solutions), Q e^c, K e^(c_C - c) [n, H, C, K] and
    the intra-chunk attention lower(Q K^T * G) [n, H, C, C]. On a CPU linear_attention.c's one pass per chunk and
    key head (hl_gdn_chunk_prep)."""
    _, fn = dispatch.choose("gated_delta_chunk_prep", q.device.type)
    return fn(q, k, kk, qk, c, beta, v)


def _block_inference(q, k, v, g, beta, S, C):
    """:func:`_block` without autograd, chunks first and in place: q/k [n, b, Hk, C, K] fp32 on the key heads
    (q scaled), v [n, b * H, C, V], g/beta [n, b * H, C], all the caller's own copies (overwritten); S
    [b * H, K, V] the state at the block's start, updated in place. Returns o [n, b * H, C, V] fp32.

    The walk's operands come from :func:`chunk_prep` (on a CPU one native pass per chunk and key head: 4.6 ->
    2.6 ms a 1024-token block of gdn-small's heads against torch's elementwise passes, min of 20), everything
    batched over the block's chunks except the walk itself, five ops per chunk on contiguous
    slices: the new values U - W S in U's place, the output (Q e^c) S + (Q K^T * G) V', the decay and the
    rank-C write; no per-chunk copies, no stored chunk-start states. (The stacked [W; Q e^c] S in one matmul,
    then a subtraction, and the intra-chunk product batched after the walk took 15.5 ms against these 12.5 for
    a 1024-token block of gdn-small's heads, 2 threads, Zen 4: that batched [64, 64] x [64, 128] product ran at
    ~67 GFLOP/s, and the strided [U | W] halves cost the products a copy.) The products K K^T and Q K^T are
    taken once per key head (each serves H / Hk value heads, which differ only in their decays and betas) and
    the value heads' q/k are never materialised beyond the operands that need them."""
    n, b, Hk = q.shape[:3]
    K, V = q.shape[-1], v.shape[-1]
    bH = v.shape[1]
    c = g.cumsum_(-1)  # running log-decay inside each chunk
    kT = k.transpose(-1, -2)
    kk, qk = torch.matmul(k, kT), torch.matmul(q, kT)  # per key head
    U, W, qe, k_end, attn = chunk_prep(q.view(n, b * Hk, C, K), k.view(n, b * Hk, C, K), kk.view(n, b * Hk, C, C),
                                       qk.view(n, b * Hk, C, C), c, beta, v)
    k_end = k_end.transpose(-1, -2)
    chunk_decay = c[..., -1:].exp()[..., None]  # [n, bH, 1, 1]
    o = torch.empty(n, bH, C, V, device=q.device)
    for i in range(n):  # the walk, the only sequential part
        Vn = U[i].baddbmm_(W[i], S, alpha=-1.0)  # the new values U - W S, in U's place
        torch.bmm(qe[i], S, out=o[i]).baddbmm_(attn[i], Vn)  # the state's share of the output, then the chunk's
        S.mul_(chunk_decay[i]).baddbmm_(k_end[i], Vn)
    return o


def _chunk_inference(q, k, v, g, beta, S, scale, C):
    """The blocks of :func:`_chunk_torch` through :func:`_block_inference`; S [b, H, K, V] fp32 (a copy)."""
    b, L, H, V = v.shape
    Hk, K = q.shape[-2:]
    o = torch.empty(b, L, H, V, device=v.device, dtype=v.dtype)
    Sf = S.view(b * H, K, V)
    block = max(C, _BLOCK // C * C)
    for s in range(0, L, block):
        e = min(L, s + block)
        n = -(-(e - s) // C)
        qb = _chunks_first(q, s, e, n, C).mul_(scale).view(n, b, Hk, C, K)
        kb = _chunks_first(k, s, e, n, C).view(n, b, Hk, C, K)
        gb, bb = (_chunks_first(x[..., None], s, e, n, C)[..., 0] for x in (g, beta))
        ob = _block_inference(qb, kb, _chunks_first(v, s, e, n, C), gb, bb, Sf, C).view(n, b, H, C, V)
        full = (e - s) // C
        if full:
            o[:, s:s + full * C].view(b, full, C, H, V).copy_(ob[:full].permute(1, 0, 3, 2, 4))
        if (tail := e - s - full * C):
            o[:, s + full * C:e].copy_(ob[full, :, :, :tail].transpose(1, 2))
    return o, S

def _chunk_torch(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=_CHUNK):
    b, L, H, V = v.shape
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    C = chunk_size
    S = (torch.zeros(b, H, K, V, device=v.device) if initial_state is None
         else initial_state.float().clone())
    if not torch.is_grad_enabled():  # inference: in place, chunks first
        return _chunk_inference(q, k, v, g, beta, S.contiguous(), scale, C)
    o = torch.empty(b, L, H, V, device=v.device, dtype=v.dtype)
    block = max(C, _BLOCK // C * C)
    for s in range(0, L, block):
        e = min(L, s + block)
        n = -(-(e - s) // C)
        qb = _heads_first(_expand(q, H), s, e, n, C) * scale
        ob, S = _block(qb, *(_heads_first(x, s, e, n, C) for x in (_expand(k, H), v, g, beta)), S, C)
        o[:, s:e] = ob.reshape(b, H, n * C, V)[:, :, :e - s].transpose(1, 2)
    return o, S


def _varlen(chunk, q, k, v, g, beta, cu_seqlens, *, scale=None, initial_states=None, **kw):
    o = torch.empty_like(v)
    finals = []
    for i, s in sequences(cu_seqlens):
        init = None if initial_states is None else initial_states[i:i + 1]
        oi, fi = chunk(q[None, s], k[None, s], v[None, s], g[None, s], beta[None, s], scale=scale,
                       initial_state=init, **kw)
        o[s] = oi[0]
        finals.append(fi)
    return o, torch.cat(finals)


def _varlen_torch(q, k, v, g, beta, cu_seqlens, *, scale=None, initial_states=None, chunk_size=_CHUNK):
    return _varlen(_chunk_torch, q, k, v, g, beta, cu_seqlens, scale=scale, initial_states=initial_states,
                   chunk_size=chunk_size)


def _step_torch(state, q, k, v, g, beta, *, scale=None, slots=None):
    # Decode is bound by moving the state (H K V floats per sequence and layer): update the rows in place a
    # tile of sequences at a time (.state_tiles), as one read (S^T [k, q]), one decay and one rank-1 write per
    # head, batched (three passes over S, not four); a bf16 state's tile is copied to fp32, updated and rounded
    # back once.
    rows, scatter = slot_rows(state, slots)
    n, H, K, V = rows.shape
    scale = K ** -0.5 if scale is None else scale
    if not rows.is_contiguous():
        y = gated_delta_step_ref(rows, q, k, v, g, beta, scale=scale)
    else:
        qf = _expand(q, H).float() * scale
        kf = _expand(k, H).float()
        kq = torch.stack([kf, qf], -2).reshape(n * H, 2, K)  # one read of S serves the prediction and the output
        kqdot = (kf * qf).sum(-1).reshape(n * H, 1, 1)
        kT = kf.reshape(n * H, K, 1)
        decay = g.float().exp().reshape(n * H, 1, 1)
        bv = beta.float().reshape(n * H, 1, 1)
        vf = v.float().reshape(n * H, 1, V)
        y = torch.empty(n * H, 1, V, device=v.device)

        def update(i, j, f):
            r = slice(i * H, j * H)
            S = f.view((j - i) * H, K, V)
            # from the old state: S^T k and S^T q at once; with a the decay, the new state's read-out is
            # S'^T q = a S^T q + (k . q) delta, so S is read once and written twice (decay, rank-1 write)
            read = torch.bmm(kq[r], S).mul_(decay[r])  # [.., 2, V]: a S^T k, a S^T q
            delta = (vf[r] - read[:, :1]).mul_(bv[r])  # beta (v - a S^T k)  [.., 1, V]
            torch.addcmul(read[:, 1:], kqdot[r], delta, out=y[r])
            S.mul_(decay[r]).baddbmm_(kT[r], delta)

        update_in_fp32_tiles(rows, update)
        y = y.view(n, H, V).to(v.dtype)
    if scatter:
        state.index_copy_(0, slots, rows)
    return y


# ---- cuda: flash-linear-attention (fla-core) ---------------------------------------------------------------

def _fla_chunk(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=_CHUNK):
    fn = cuda_backend.fla("chunk")
    H = v.shape[-2]
    o, S = fn(q=_expand(q, H), k=_expand(k, H), v=v, g=g.float(), beta=beta, scale=scale,
              initial_state=initial_state, output_final_state=True)
    return o, S.float()


def _fla_varlen(q, k, v, g, beta, cu_seqlens, *, scale=None, initial_states=None, chunk_size=_CHUNK):
    fn = cuda_backend.fla("chunk")
    H = v.shape[-2]
    o, S = fn(q=_expand(q, H)[None], k=_expand(k, H)[None], v=v[None], g=g.float()[None], beta=beta[None],
              scale=scale, initial_state=initial_states, output_final_state=True, cu_seqlens=cu_seqlens.long())
    return o[0], S.float()


def _fla_step(state, q, k, v, g, beta, *, scale=None, slots=None):
    fn = cuda_backend.fla("recurrent")
    H = v.shape[-2]

    def run(rows):
        o, S = fn(q=_expand(q, H)[:, None], k=_expand(k, H)[:, None], v=v[:, None], g=g.float()[:, None],
                  beta=beta[:, None], scale=scale, initial_state=rows.float(), output_final_state=True)
        rows.copy_(S)
        return o[:, 0]

    rows, scatter = slot_rows(state, slots)
    y = run(rows)
    if scatter:
        state.index_copy_(0, slots, rows)
    return y


# ---- public ops --------------------------------------------------------------------------------------------

def gated_delta_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                      scale: float | None = None, initial_state: torch.Tensor | None = None,
                      chunk_size: int = _CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a batch: q/k [B, L, Hk, K], v [B, L, H, V], g/beta [B, L, H], initial_state
    [B, H, K, V] or None (zeros). Returns (o [B, L, H, V] in v's dtype, final state [B, H, K, V] fp32)."""
    _check_shapes(q, k, v, g, beta, 2)
    _, fn = dispatch.choose("gated_delta_chunk", v.device.type)
    return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size)


def gated_delta_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       cu_seqlens: torch.Tensor, *, scale: float | None = None,
                       initial_states: torch.Tensor | None = None,
                       chunk_size: int = _CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Over a packed batch: q/k [T, Hk, K], v [T, H, V], g/beta [T, H], cu_seqlens [N+1], initial_states
    [N, H, K, V] or None. Returns (o [T, H, V], final states [N, H, K, V] fp32); no state crosses a boundary."""
    _check_shapes(q, k, v, g, beta, 1)
    check_cu_seqlens(cu_seqlens, v.shape[0], "gated_delta_varlen")
    _, fn = dispatch.choose("gated_delta_varlen", v.device.type)
    return fn(q, k, v, g, beta, cu_seqlens, scale=scale, initial_states=initial_states, chunk_size=chunk_size)


def gated_delta_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, *, scale: float | None = None,
                     slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step, updating the state in place: ``state`` [n, H, K, V] (fp32 or bf16), or with ``slots``
    ([n] int64) a pool [S, H, K, V] whose rows ``slots`` belong to the batch. q/k [n, Hk, K], v [n, H, V],
    g/beta [n, H] -> o [n, H, V]."""
    _, fn = dispatch.choose("gated_delta_step", v.device.type)
    return fn(state, q, k, v, g, beta, scale=scale, slots=slots)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim in fp32 (flash-linear-attention's and Qwen3-Next's form)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)


def _l2norm_heads_torch(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return l2norm(x, eps).to(x.dtype)


def l2norm_heads(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """:func:`l2norm` of x [..., heads, K], rounded back to x's dtype (the layer's q / k). On a CPU without
    autograd, for a decode step's rows (up to 64), linear_attention.c's loop, the one the decode program runs:
    the two then agree to the bit (prefill keeps torch's vectorised op)."""
    _, fn = dispatch.choose("gated_delta_l2norm", x.device.type)
    return fn(x, eps)


def _gates_torch(b, a, A_log, dt_bias):
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
          dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log decay ``g = -exp(A_log) softplus(a + dt_bias)`` and write strength ``beta = sigmoid(b)``, fp32
    [..., H]. On a CPU without autograd, for a decode step's rows [n <= 64, H], linear_attention.c's loop, the
    decode program's: libm's exp / log1p, where torch's are Sleef's (the two differ in the last fp32 bit now and
    then)."""
    _, fn = dispatch.choose("gated_delta_gates", b.device.type)
    return fn(b, a, A_log, dt_bias)


def flops_per_token(n_heads: int, head_k_dim: int, head_v_dim: int) -> float:
    """FLOPs one token costs in the recurrent form (decay, read S^T k, rank-1 write, output S^T q: 7 per state
    element), the count the GFLOP/s of a prefill are reported against (the chunked form does more work)."""
    return 7.0 * n_heads * head_k_dim * head_v_dim


dispatch.register("gated_delta_chunk", "torch", _chunk_torch)
dispatch.register("gated_delta_varlen", "torch", _varlen_torch)
dispatch.register("gated_delta_step", "torch", _step_torch)
# decode on the CPU: decode.c's one loop per (sequence, head), two passes over the state (torch takes three)
dispatch.register("gated_delta_step", "native", native_ops.gdn_step, native.available, native_ops.supports_gdn_step)
dispatch.register("gated_delta_l2norm", "torch", _l2norm_heads_torch)
dispatch.register("gated_delta_l2norm", "native", native_ops.l2norm_heads, native.available,
                  native_ops.supports_l2norm_heads)
dispatch.register("gated_delta_gates", "torch", _gates_torch)
dispatch.register("gated_delta_chunk_prep", "torch", _chunk_prep_torch)
dispatch.register("gated_delta_chunk_prep", "native", native_ops.gdn_chunk_prep, native.available,
                  native_ops.supports_gdn_chunk_prep)
dispatch.register("gated_delta_ut", "torch", _ut_solve_torch)
# prefill on the CPU: linear_attention.c's forward substitution, one (chunk, head) system a pool chunk
dispatch.register("gated_delta_ut", "native", _ut_solve_native, native.available, _ut_solve_supports)
dispatch.register("gated_delta_gates", "native", native_ops.gdn_gates, native.available, native_ops.supports_gdn_gates)
_fla = cuda_backend.probe("fla")
dispatch.register("gated_delta_chunk", "cuda", _fla_chunk, _fla)
dispatch.register("gated_delta_varlen", "cuda", _fla_varlen, _fla)
dispatch.register("gated_delta_step", "cuda", _fla_step, _fla)

__all__ = ["gated_delta_chunk", "gated_delta_ref", "gated_delta_step", "gated_delta_step_ref", "gated_delta_varlen",
           "gated_delta_varlen_ref", "gates", "l2norm", "l2norm_heads", "flops_per_token"]
