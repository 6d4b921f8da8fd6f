"""Mamba-2 state-space duality (SSD): chunked scan for prefill and the one-step state update.

Shapes: ``x: [B, L, H, P]`` (H heads of P channels), ``dt: [B, L, H]`` (already positive:
softplus(dt + dt_bias) and clamped by the caller), ``A: [H]`` (negative decay rates),
``B, C: [B, L, G, N]`` (G groups shared by H/G heads each), state ``[B, H, P, N]`` in fp32.

Recurrence (per head h): ``s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T``, ``y_t = s_t C_t + D x_t``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import cuda_backend, dispatch, inductor_backend, native, triton_support
from .compute_dtype import matmul_dtype
from .native import ops as native_ops
from .packing import check_cu_seqlens, sequences, slot_rows
from .state_tiles import update_in_fp32_tiles
from .triton_state_update import ssd_state_update
from .triton_support import INTERPRET, dot_precision, jit, needs_grad, next_pow2, tl, triton

# Chunk length of the torch path. The chunk size changes only the cost, never the result. Per token the
# per-head [T, T] decay work grows with T while the [H, P, N] chunk states shrink with it; 64 keeps both a
# chunk's decay ([H, 64, 64], 0.4 MB fp32 at H=24) and its state in a core's L2 (eval/profile_prefill.py).
_TORCH_CHUNK = 64
# Tokens scanned at once (all sequences of the batch together): every temporary is sized by this block,
# not by the sequence, so a 64K prompt costs the memory of a 2K one (~130 MB of fp32 temporaries at
# H=24, P=64, N=128). A block costs ~25 batched ops plus three small ones per chunk (the walk of the state
# through its chunks), so fewer, larger blocks mean fewer thread sync points; on a loaded CPU each one can
# wait a scheduler slice. The engine's 2048-token steps are one block each.
_TORCH_BLOCK = 2048


def ssd_scan_ref(x, dt, A, B, C, *, D=None, initial_state=None):
    """Token-by-token recurrence in fp32: the reference the chunked forms are checked against."""
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    rep = H // G
    Bh = B.float().repeat_interleave(rep, dim=2)  # [b, L, H, N]
    Ch = C.float().repeat_interleave(rep, dim=2)
    s = torch.zeros(b, H, P, N, device=x.device) if initial_state is None else initial_state.float().clone()
    ys = []
    for t in range(L):
        dA = torch.exp(dt[:, t].float() * A.float())  # [b, H]
        s = s * dA[:, :, None, None] + (dt[:, t, :, None].float() * x[:, t].float())[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", s, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype), s


# log of the smallest normal fp32: a decay below e^this would be a denormal, whose arithmetic costs
# ~100x on x86 without flush-to-zero. Such a decay is set to exactly 0 instead: it differs from the true
# value by less than 1.2e-38 of the state it scales, far below fp32 rounding of anything it is added to.
_LOG_TINY = math.log(torch.finfo(torch.float32).tiny)
# The [T, T] decays clamp their exponent to [_LOG_FLUSH, 0] before the exp and flush what lands at the
# bottom (<= _FLUSH) to exact zeros after it: CPU exp takes a slow path on -inf inputs (2.5x here) and
# on denormal results (15x), so the exp must see neither. The margin of 2 e-folds above the smallest
# normal keeps every result of the clamped exp normal; decays below e^-85.3 count as zero (as above:
# less than 1e-37 of what they scale).
_LOG_FLUSH = _LOG_TINY + 2.0
_FLUSH = math.exp(_LOG_FLUSH) * 1.01


def _decay_exp(t: torch.Tensor, inplace: bool) -> torch.Tensor:
    """exp(t) with what would underflow into the denormal range flushed to exact zeros (``t`` fp32)."""
    if inplace:
        return t.masked_fill_(t < _LOG_TINY, -math.inf).exp_()
    return t.masked_fill(t < _LOG_TINY, -math.inf).exp()


def _pairwise_decays(cs_h: torch.Tensor, inplace: bool) -> torch.Tensor:
    """[..., T] running log-decays -> [..., T, T] with (l, s) = e^{cs_l - cs_s} on and below the diagonal
    (flushed to 0 below e^-85.3) and exactly 1 above it (s > l: there the caller's causal mask is zero).
    Four passes over the [T, T] tensor, the exp on its fast path (see ``_LOG_FLUSH``)."""
    d = cs_h[..., :, None] - cs_h[..., None, :]  # <= 0 on and below the diagonal (dt A <= 0), >= 0 above
    if inplace:
        return F.threshold_(d.clamp_(_LOG_FLUSH, 0.0).exp_(), _FLUSH, 0.0)
    return F.threshold(d.clamp(_LOG_FLUSH, 0.0).exp(), _FLUSH, 0.0)


def _scan_chunks(state, xw, Bm, Cm, chunk_decay, *, mm, inplace):
    """Walk the block's chunks in order, holding the [H, P, N] state: per chunk c, with S the state
    entering it,
      y_c = C_c S^T                                  (the entering state's output, before its decay)
      S   = e^{chunk c's log-decay} S + xw_c^T B_c     (xw: dt x decayed to the chunk's end)
    ``state`` [b, H, P, N] fp32 (never written), xw [b, nc, T, G, hpg*P], Bm/Cm [b, nc*T, G, N] (``mm``),
    chunk_decay [b, nc, H]. Returns (y [b, nc, T, G, hpg*P] in ``mm``, the state leaving the block).

    Three ops per chunk, each on data a core's cache holds (the 0.8 MB state at mamba2-small's H=24,
    P=64, N=128; one chunk's xw, B, C). The chunk states, hand-over and state output as batched ops over
    all chunks instead materialised every chunk's state ([nc, H, P, N], 25 MB per 2K block) and passed
    over it three more times, and the hand-over as one matmul over all chunk pairs cost nc times the
    multiply-adds of this recurrence."""
    if inplace:
        return _walk_chunks(state, xw, Bm, Cm, chunk_decay, mm=mm)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (state, xw, Bm, Cm, chunk_decay)):
        return _chunk_walk(state, xw, Bm, Cm, chunk_decay, mm)
    return _recorded_walk(state, xw, Bm, Cm, chunk_decay, mm)


def _recorded_walk(state, xw, Bm, Cm, chunk_decay, mm, entering: list | None = None):
    """The out-of-place walk as plain ops: what the forward-only ``inductor`` backend traces (fullgraph) and
    compiles, and :class:`_ChunkWalk`'s forward, which passes ``entering`` to collect the state entering each
    chunk for its backward."""
    b, nc, T, G, GP = xw.shape
    H, P, N = state.shape[1:]
    Bv, Cv = Bm.view(b, nc, T, G, N), Cm.view(b, nc, T, G, N)
    S, ys = state, []
    for c in range(nc):
        if entering is not None:
            entering.append(S)
        C_c = Cv[:, c].transpose(1, 2).reshape(b * G, T, N)
        ys.append(torch.bmm(C_c, S.view(b * G, GP, N).transpose(1, 2).to(mm)))
        xwT = xw[:, c].permute(0, 2, 3, 1).reshape(b * G, GP, T)
        B_c = Bv[:, c].transpose(1, 2).reshape(b * G, T, N)
        S = S * chunk_decay[:, c, :, None, None] + torch.bmm(xwT, B_c).float().view(b, H, P, N)
    return torch.stack(ys).view(nc, b, G, T, GP).permute(1, 0, 3, 2, 4), S


class _ChunkWalk(torch.autograd.Function):
    """:func:`_scan_chunks` under autograd, its backward written out: the walk back over the chunks with the
    states entering each chunk saved by the forward ([nc, b, H, P, N] fp32, the 4.7 MB of a 512-token
    distillation batch of SmolLM2's students). Recorded op by op, a chunk left ~10 autograd nodes with a
    view, cast or sum each, the chunk states' copies among them; here a chunk's backward is four batched
    matmuls and two elementwise passes on the state. The operands round as the recorded ops' did: the
    products take ``mm`` operands (the state rounded to it), the state and its gradient stay fp32.

    With S_c the state entering chunk c and dS the gradient of S_{c+1}:
      y_c = C_c S_c^T                  dC_c = dy_c S_c                dS_c = w_c dS + dy_c^T C_c
      S_{c+1} = w_c S_c + xw_c^T B_c   dxw_c = B_c dS^T  dB_c = xw_c dS  dw_c = sum_{P,N} dS * S_c
    """

    @staticmethod
    def forward(ctx, state, xw, Bm, Cm, chunk_decay, mm):
        entering: list[torch.Tensor] = []
        y, S = _recorded_walk(state.float(), xw, Bm, Cm, chunk_decay, mm, entering)
        ctx.save_for_backward(torch.stack(entering), xw, Bm, Cm, chunk_decay)
        ctx.mm = mm
        return y, S

    @staticmethod
    def backward(ctx, dy, dS_out):
        entering, xw, Bm, Cm, chunk_decay = ctx.saved_tensors
        mm = ctx.mm
        b, nc, T, G, GP = xw.shape
        H, P, N = entering.shape[2:]
        Bv, Cv = Bm.view(b, nc, T, G, N), Cm.view(b, nc, T, G, N)
        dyv = dy.permute(1, 0, 3, 2, 4)  # [nc, b, G, T, GP]
        dS = dS_out.float() if dS_out is not None else xw.new_zeros(b, H, P, N, dtype=torch.float32)
        dxw = torch.empty_like(xw)
        dB = torch.empty(b, nc, T, G, N, device=xw.device, dtype=Bm.dtype)
        dC = torch.empty(b, nc, T, G, N, device=xw.device, dtype=Cm.dtype)
        dw = torch.empty(b, nc, H, device=xw.device, dtype=chunk_decay.dtype)
        for c in reversed(range(nc)):
            S_c = entering[c]
            dS_mm = dS.view(b * G, GP, N).to(mm)
            B_c = Bv[:, c].transpose(1, 2).reshape(b * G, T, N)
            xw_c = xw[:, c].transpose(1, 2).reshape(b * G, T, GP)
            dxw[:, c] = torch.bmm(B_c, dS_mm.transpose(1, 2)).view(b, G, T, GP).transpose(1, 2)
            dB[:, c] = torch.bmm(xw_c, dS_mm).view(b, G, T, N).transpose(1, 2)
            dw[:, c] = (dS * S_c).sum((2, 3))
            dy_c = dyv[c].reshape(b * G, T, GP)
            C_c = Cv[:, c].transpose(1, 2).reshape(b * G, T, N)
            dC[:, c] = torch.bmm(dy_c, S_c.view(b * G, GP, N).to(mm)).view(b, G, T, N).transpose(1, 2)
            dS = dS * chunk_decay[:, c, :, None, None] + torch.bmm(dy_c.transpose(1, 2), C_c).float().view(b, H, P, N)
        d_state = dS if ctx.needs_input_grad[0] else None
        return d_state, dxw, dB.view(b, nc * T, G, N), dC.view(b, nc * T, G, N), dw, None


# left out of torch.compile's graphs: inductor (torch 2.13) miscompiles this walk's backward at some shapes (NaN
# gradients for xw and B at b=4, G=9, 64-token chunks; right at G=3), and its eager form is already four matmuls
# and two state passes a chunk. torch._disable_dynamo is torch.compiler.disable that imports dynamo at the first
# call, not here: importing torch._dynamo costs seconds, and every `import hybrid` (every CLI run) would pay it.
@torch._disable_dynamo
def _chunk_walk(state, xw, Bm, Cm, chunk_decay, mm):
    return _ChunkWalk.apply(state, xw, Bm, Cm, chunk_decay, mm)


def _walk_chunks(state, xw, Bm, Cm, chunk_decay, *, mm):
    """:func:`_scan_chunks` without autograd: one 2-D matmul per chunk, sequence and B/C group on the fp32
    state updated in place. With bf16 operands (``mm``, where the CPU multiplies bf16 natively) the state is
    rounded into a reused bf16 copy for the output product and the chunk's input product lands in a reused
    bf16 buffer that is added to the fp32 state: 2 threads, a mamba2-small layer's [1536, 128] state and
    64-token chunks, a chunk costs ~160 us against ~550 us through ``bmm`` (bf16 ``bmm`` runs at half the
    rate of ``mm`` on these shapes) with fresh converted temporaries. fp32: ``addmm_`` in place."""
    b, nc, T, G, GP = xw.shape
    H, P, N = state.shape[1:]
    hpg = H // G
    Bv, Cv = Bm.view(b, nc, T, G, N), Cm.view(b, nc, T, G, N)
    S = state.clone().view(b, G, GP, N)
    low = mm != torch.float32
    S_mm = torch.empty(GP, N, device=xw.device, dtype=mm) if low else None
    inc = torch.empty(GP, N, device=xw.device, dtype=mm) if low else None
    ys = torch.empty(nc, b, G, T, GP, device=xw.device, dtype=mm)
    w = chunk_decay.view(b, nc, G, hpg, 1, 1)
    for c in range(nc):
        for i in range(b):
            for g in range(G):
                S2 = S[i, g]
                with torch.profiler.record_function("ssd.state_output"):
                    torch.mm(Cv[i, c, :, g], (S_mm.copy_(S2) if low else S2).t(), out=ys[c, i, g])
                with torch.profiler.record_function("ssd.state_passing"):
                    S2.view(hpg, P, N).mul_(w[i, c, g])
                with torch.profiler.record_function("ssd.chunk_states"):
                    xwT, B_c = xw[i, c, :, g].t(), Bv[i, c, :, g]
                    if low:
                        S2.add_(torch.mm(xwT, B_c, out=inc))
                    else:
                        S2.addmm_(xwT, B_c)
    return ys.permute(1, 0, 3, 2, 4), S.view(b, H, P, N)


def _ssd_block(x, dt, A, B, C, state, *, T, mm, D, inplace):
    """One block of n tokens from ``state`` [b, H, P, N] fp32 -> (y [b, n, H, P] fp32, state at its end).

    Per chunk of T tokens with cs = cumsum(dt A) (fp32, restarted at the chunk start):
      y_l   = sum_{s<=l} (C_l . B_s) e^{cs_l - cs_s} dt_s x_s  +  e^{cs_l} C_l . state  +  D x_l
      state = e^{cs_T} state + sum_s e^{cs_T - cs_s} dt_s x_s B_s^T
    The intra-chunk term and the scalings are each one batched op over all the block's chunks; the terms
    through the state walk the chunks in order, three small ops per chunk on cache-resident data
    (:func:`_scan_chunks`). The causal mask lives on the per-group C.B product ([G, T, T] per chunk), not
    on the per-head decays ([H, T, T]).
    """
    b, n, H, P = x.shape
    G, N = B.shape[2:]
    hpg = H // G
    pad = (-n) % T
    dtf = dt.float()
    Bm, Cm = B.to(mm), C.to(mm)
    xp = x
    if pad:  # dt = 0 on the padding: decay 1 and no input, so the state leaves the block as at token n-1
        xp, Bm, Cm = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, Bm, Cm))
        dtf = F.pad(dtf, (0, 0, 0, pad))
    nc = (n + pad) // T
    cs = (dtf * A).view(b, nc, T, H).cumsum(2)  # [b, nc, T, H]
    cs_h = cs.transpose(2, 3).contiguous()  # [b, nc, H, T], in order for the [T, T] differences
    Bc = Bm.view(b, nc, T, G, N).transpose(2, 3)  # [b, nc, G, T, N]
    Cc = Cm.view(b, nc, T, G, N).transpose(2, 3)
    xv, dtv = xp.view(b, nc, T, H, P), dtf.view(b, nc, T, H, 1)

    with torch.profiler.record_function("ssd.intra_chunk"):
        CB = torch.matmul(Cc, Bc.transpose(-1, -2))  # [b, nc, G, T, T]
        above = torch.ones(T, T, dtype=torch.bool, device=x.device).triu_(1)
        CB = CB.masked_fill_(above, 0.0) if inplace else CB.masked_fill(above, 0.0)
        decay = _pairwise_decays(cs_h, inplace).view(b, nc, G, hpg, T, T)
        M = decay.mul_(CB[:, :, :, None]) if inplace else decay * CB[:, :, :, None]
        # dt x written head-major, [b, nc, H, T, P], the layout the batched matmul reads without a copy
        if inplace:
            xdt_h = torch.empty(b, nc, H, T, P, device=x.device, dtype=mm)
            torch.mul(xv.transpose(2, 3), dtv.transpose(2, 3), out=xdt_h)
        else:
            xdt_h = (xv.float() * dtv).to(mm).transpose(2, 3)
        y = torch.matmul(M.view(b, nc, H, T, T).to(mm), xdt_h)  # [b, nc, H, T, P]

    with torch.profiler.record_function("ssd.chunk_states"):
        to_end = _decay_exp(cs[:, :, -1:] - cs, True)  # [b, nc, T, H]: decay from each token to its chunk's end
        xw = (xv * (dtv * to_end[..., None])).to(mm).view(b, nc, T, G, hpg * P)  # token-major: dt x to the end
        chunk_decay = _decay_exp(cs[:, :, -1].clone(), True)  # [b, nc, H]
    y_state, state = _scan_chunks(state, xw, Bm, Cm, chunk_decay, mm=mm, inplace=inplace)

    with torch.profiler.record_function("ssd.state_output"):
        y_tok = y_state.float().contiguous().view(b, nc, T, H, P)  # a copy only for G > 1 or b > 1
        at_start = _decay_exp(cs.clone(), True)[..., None]  # [b, nc, T, H, 1]
        y_tok = y_tok.mul_(at_start) if inplace else y_tok * at_start
        y_tok = y_tok.add_(y.transpose(2, 3)) if inplace else y_tok + y.transpose(2, 3)
        y_tok = y_tok.view(b, nc * T, H, P)[:, :n]
        if D is not None:
            y_tok = y_tok.addcmul_(x, D.float()[:, None]) if inplace else y_tok + x.float() * D.float()[:, None]
    return y_tok, state


def _ssd_chunk_scan_torch(x, dt, A, B, C, *, chunk_size, D=None, initial_state=None):
    b, L, H, P = x.shape
    N = B.shape[3]
    T = max(1, min(chunk_size, _TORCH_CHUNK, L))
    block = max(T, _TORCH_BLOCK // b // T * T)
    mm = matmul_dtype(x.dtype, x.device)
    inplace = not needs_grad(x, dt, A, B, C, D, initial_state)
    state = (torch.zeros(b, H, P, N, device=x.device) if initial_state is None
             else initial_state.float().reshape(b, H, P, N))
    Af = A.float()
    if L <= block:  # one block (every 2K forward, every engine step): its output is the result, no copy
        y, state = _ssd_block(x, dt, Af, B, C, state, T=T, mm=mm, D=D, inplace=inplace)
        return y.to(x.dtype), state
    # without autograd each block writes its rows of one output; with it the blocks are concatenated
    y_out = torch.empty_like(x, memory_format=torch.contiguous_format) if inplace else None
    ys = []
    for t0 in range(0, L, block):
        s = slice(t0, min(t0 + block, L))
        y, state = _ssd_block(x[:, s], dt[:, s], Af, B[:, s], C[:, s], state, T=T, mm=mm, D=D, inplace=inplace)
        if inplace:
            y_out[:, s] = y
        else:
            ys.append(y.to(x.dtype))
    if inplace:
        return y_out, state
    return (torch.cat(ys, 1) if len(ys) > 1 else ys[0]), state


_ssd_block_compiled = inductor_backend.compiled(_ssd_block)


def _ssd_chunk_scan_inductor(x, dt, A, B, C, *, chunk_size, D=None, initial_state=None):
    """The torch path's blocks through the compiled :func:`_ssd_block` (its elementwise chains fused). A
    block is padded to a power-of-two number of chunks (dt = 0 there: decay 1 and no input), so prompts
    of any length compile a handful of shapes."""
    if needs_grad(x, dt, A, B, C, D, initial_state):
        return _ssd_chunk_scan_torch(x, dt, A, B, C, chunk_size=chunk_size, D=D, initial_state=initial_state)
    b, L, H, P = x.shape
    N = B.shape[3]
    T = max(1, min(chunk_size, _TORCH_CHUNK, L))
    block = max(T, _TORCH_BLOCK // b // T * T)
    mm = matmul_dtype(x.dtype, x.device)
    state = (torch.zeros(b, H, P, N, device=x.device) if initial_state is None
             else initial_state.float().reshape(b, H, P, N).contiguous())
    Af = A.float()
    y_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    for t0 in range(0, L, block):
        s = slice(t0, min(t0 + block, L))
        n = s.stop - s.start
        padded = T * next_pow2(-(-n // T))
        xs, dts, Bs, Cs = (F.pad(t[:, s], (0, 0) * (t.dim() - 2) + (0, padded - n)) for t in (x, dt, B, C))
        y, state = _ssd_block_compiled(xs, dts, Af, Bs, Cs, state, T=T, mm=mm, D=D, inplace=False)
        y_out[:, s] = y[:, :n]
    return y_out, state


def _check_ssd_shapes(x, dt, A, B, C):
    if x.dim() != 4:
        raise ValueError(f"ssd: x must be [B, L, H, P], got {tuple(x.shape)}")
    b, L, H, _ = x.shape
    if dt.shape != (b, L, H) or A.shape != (H,):
        raise ValueError(f"ssd: dt must be [B, L, H] = {(b, L, H)} and A [H] = {(H,)}, "
                         f"got {tuple(dt.shape)} and {tuple(A.shape)}")
    if B.shape != C.shape or B.dim() != 4 or B.shape[:2] != (b, L) or H % B.shape[2]:
        raise ValueError(f"ssd: B and C must be [B, L, G, N] with H % G == 0, got {tuple(B.shape)}, {tuple(C.shape)}")


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   *, chunk_size: int = 256, D: torch.Tensor | None = None,
                   initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over whole sequences. Returns ``(y [B, L, H, P], final_state [B, H, P, N] fp32)``."""
    _check_ssd_shapes(x, dt, A, B, C)
    _, fn = dispatch.choose("ssd_chunk_scan", x.device.type)
    return fn(x, dt, A, B, C, chunk_size=chunk_size, D=D, initial_state=initial_state)


def ssd_step_ref(state, x, dt, A, B, C, *, D=None):
    """One token: state [B, H, P, N] (updated in place), x [B, H, P], dt [B, H], B/C [B, G, N] -> y [B, H, P]."""
    rep = x.shape[1] // B.shape[1]
    Bh = B.float().repeat_interleave(rep, dim=1)
    Ch = C.float().repeat_interleave(rep, dim=1)
    dA = torch.exp(dt.float() * A.float())
    new = state.float() * dA[..., None, None] + (dt.float()[..., None] * x.float())[..., None] * Bh[:, :, None, :]
    state.copy_(new)
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype)


def _ssd_step_torch(state, x, dt, A, B, C, *, D=None, slots=None):
    # Decode is bound by reading and writing the state (H*P*N floats per sequence and layer): update the
    # rows in place, a tile of sequences at a time so the passes after the first find them in cache
    # (.state_tiles), with one rank-1 update and one mat-vec per sequence and B/C group (the heads of a
    # group share B and C); one gather and one scatter for a slot pool. A bf16 / fp16 state: each tile's rows
    # are copied to fp32, updated the same way and rounded back once (ssd_step_ref's arithmetic, without its
    # [B, H, P, N] temporaries).
    rows, scatter = slot_rows(state, slots)
    # a strided state tensor handed in directly, or autograd recording (the tiles write into out= buffers):
    # the reference's broadcasting ops, the same arithmetic
    if not rows.is_contiguous() or needs_grad(x, dt, A, B, C, D):
        y = ssd_step_ref(rows, x, dt, A, B, C, D=D)
        if scatter:
            state.index_copy_(0, slots, rows)
        return y
    n, H, P, N = rows.shape
    G = B.shape[1]
    rep = H // G
    dt = dt.float()
    decay = torch.exp(dt * A.float())[..., None, None]
    dtx = (dt[..., None] * x.float()).view(n * G, rep * P, 1)
    Bf, Cf = B.float().reshape(n * G, 1, N), C.float().reshape(n * G, N, 1)
    y = torch.empty(n * G, rep * P, 1, device=x.device)

    def update(i, j, f):
        g = slice(i * G, j * G)
        fg = f.mul_(decay[i:j]).view((j - i) * G, rep * P, N).addcmul_(dtx[g], Bf[g])
        torch.bmm(fg, Cf[g], out=y[g])

    update_in_fp32_tiles(rows, update)
    if scatter:
        state.index_copy_(0, slots, rows)
    y = y.view(n, H, P)
    if D is not None:
        y = y + x.float() * D.float()[:, None]
    return y.to(x.dtype)


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, *, D: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of SSD, updating the state in place. Returns y [B, H, P].

    ``state`` is [B, H, P, N], or with ``slots`` ([B] int64) a pool [S, H, P, N] whose rows
    ``slots`` belong to the batch (mamba_ssm's ``state_batch_indices``).
    """
    _, fn = dispatch.choose("ssd_step", x.device.type)
    return fn(state, x, dt, A, B, C, D=D, slots=slots)


def _ssd_varlen_scan_torch(x, dt, A, B, C, cu_seqlens, *, chunk_size, D=None, initial_states=None):
    y = torch.empty_like(x)
    finals = []
    for b, s in sequences(cu_seqlens):
        init = None if initial_states is None else initial_states[b:b + 1]
        yb, fb = _ssd_chunk_scan_torch(x[None, s], dt[None, s], A, B[None, s], C[None, s], chunk_size=chunk_size,
                                       D=D, initial_state=init)
        y[s] = yb[0]
        finals.append(fb)
    return y, torch.cat(finals)


def _ssd_varlen_scan_inductor(x, dt, A, B, C, cu_seqlens, *, chunk_size, D=None, initial_states=None):
    y = torch.empty_like(x)
    finals = []
    for b, s in sequences(cu_seqlens):
        init = None if initial_states is None else initial_states[b:b + 1]
        yb, fb = _ssd_chunk_scan_inductor(x[None, s], dt[None, s], A, B[None, s], C[None, s],
                                          chunk_size=chunk_size, D=D, initial_state=init)
        y[s] = yb[0]
        finals.append(fb)
    return y, torch.cat(finals)


def ssd_varlen_scan_ref(x, dt, A, B, C, cu_seqlens, *, D=None, initial_states=None):
    y = torch.empty_like(x)
    finals = []
    for b, s in sequences(cu_seqlens):
        init = None if initial_states is None else initial_states[b:b + 1]
        yb, fb = ssd_scan_ref(x[None, s], dt[None, s], A, B[None, s], C[None, s], D=D, initial_state=init)
        y[s] = yb[0]
        finals.append(fb)
    return y, torch.cat(finals)


def ssd_varlen_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    cu_seqlens: torch.Tensor, *, chunk_size: int = 256, D: torch.Tensor | None = None,
                    initial_states: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over a packed batch: x [T, H, P], dt [T, H], B/C [T, G, N], cu_seqlens [B+1];
    initial_states [B, H, P, N] or None (zeros). Returns (y [T, H, P], final_states [B, H, P, N] fp32).
    The state never crosses a sequence boundary."""
    _check_ssd_shapes(x[None], dt[None], A, B[None], C[None])
    check_cu_seqlens(cu_seqlens, x.shape[0], "ssd_varlen_scan")
    _, fn = dispatch.choose("ssd_varlen_scan", x.device.type)
    return fn(x, dt, A, B, C, cu_seqlens, chunk_size=chunk_size, D=D, initial_states=initial_states)


dispatch.register("ssd_chunk_scan", "torch", _ssd_chunk_scan_torch)
dispatch.register("ssd_varlen_scan", "torch", _ssd_varlen_scan_torch)
dispatch.register("ssd_step", "torch", _ssd_step_torch)
dispatch.register("ssd_step", "native", native_ops.ssd_step, native.available, native_ops.supports_ssd_step)
dispatch.register("ssd_chunk_scan", "inductor", _ssd_chunk_scan_inductor, inductor_backend.probe)
dispatch.register("ssd_varlen_scan", "inductor", _ssd_varlen_scan_inductor, inductor_backend.probe)


# --- Triton: fused chunked scan over a packed batch -------------------------------------------------
# Grid (sequences, heads, blocks of P). A program walks its own sequence chunk by chunk (chunks start at
# the sequence's first token, so no chunk straddles a boundary and no seq_idx is needed), holding the
# [P, N] state in registers. Per chunk of T tokens with cs = cumsum(dt A):
#   y_i   = sum_{j<=i} (C_i . B_j) e^{cs_i - cs_j} dt_j x_j   +   e^{cs_i} C_i . state   +   D x_i
#   state = e^{cs_T} state + sum_j e^{cs_T - cs_j} dt_j x_j B_j^T
# Every exponent is <= 0 (A < 0), so nothing overflows. Chunks run in sequence within a program; the
# parallelism is sequences x heads x P-blocks. Tokens past the sequence end load dt = 0: decay 1 and no
# input, so the state is left as at the last token. Forward only.

@jit
def _ssd_varlen_fwd_kernel(
    X, DT, A, Bm, Cm, Dp, Y, S0, SF, cu,
    stride_xt, stride_xh, stride_dtt, stride_dth, stride_bt, stride_bg, stride_ct, stride_cg,
    stride_yt, stride_yh, stride_s0b, stride_s0h, stride_s0p, stride_sfb, stride_sfh, stride_sfp,
    P, N, HEADS_PER_GROUP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr, HAS_S0: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_p = tl.program_id(2)
    g = h // HEADS_PER_GROUP
    start = tl.load(cu + b)
    end = tl.load(cu + b + 1)
    offs_t = tl.arange(0, BLOCK_T)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    p_valid = offs_p < P
    n_valid = offs_n < N
    pn_mask = p_valid[:, None] & n_valid[None, :]
    a = tl.load(A + h).to(tl.float32)
    if HAS_S0:
        state = tl.load(S0 + b * stride_s0b + h * stride_s0h + offs_p[:, None] * stride_s0p + offs_n[None, :],
                        mask=pn_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    if HAS_D:
        d = tl.load(Dp + h).to(tl.float32)
    causal = offs_t[:, None] >= offs_t[None, :]
    for t0 in range(start, end, BLOCK_T):
        rows = (t0 + offs_t).to(tl.int64)
        t_valid = rows < end
        x = tl.load(X + rows[:, None] * stride_xt + h * stride_xh + offs_p[None, :],
                    mask=t_valid[:, None] & p_valid[None, :], other=0.0).to(tl.float32)
        dt = tl.load(DT + rows * stride_dtt + h * stride_dth, mask=t_valid, other=0.0).to(tl.float32)
        bmat = tl.load(Bm + rows[:, None] * stride_bt + g * stride_bg + offs_n[None, :],
                       mask=t_valid[:, None] & n_valid[None, :], other=0.0).to(tl.float32)
        cmat = tl.load(Cm + rows[:, None] * stride_ct + g * stride_cg + offs_n[None, :],
                       mask=t_valid[:, None] & n_valid[None, :], other=0.0).to(tl.float32)
        cs = tl.cumsum(dt * a, 0)
        # within the chunk: a causal, decaying attention over the chunk's tokens
        cb = tl.dot(cmat, tl.trans(bmat), input_precision=PRECISION)
        decay = tl.exp(tl.where(causal, cs[:, None] - cs[None, :], float("-inf")))
        y = tl.dot(cb * decay * dt[None, :], x, input_precision=PRECISION)
        # the state entering the chunk, decayed to each token
        y += tl.exp(cs)[:, None] * tl.dot(cmat, tl.trans(state), input_precision=PRECISION)
        if HAS_D:
            y += d * x
        tl.store(Y + rows[:, None] * stride_yt + h * stride_yh + offs_p[None, :], y.to(Y.dtype.element_ty),
                 mask=t_valid[:, None] & p_valid[None, :])
        total = tl.sum(tl.where(offs_t == BLOCK_T - 1, cs, 0.0), 0)
        weight = tl.exp(total - cs) * dt
        state = state * tl.exp(total) + tl.dot(tl.trans(x * weight[:, None]), bmat, input_precision=PRECISION)
    tl.store(SF + b * stride_sfb + h * stride_sfh + offs_p[:, None] * stride_sfp + offs_n[None, :], state,
             mask=pn_mask)


def ssd_varlen_scan_triton(x, dt, A, B, C, cu_seqlens, *, D=None, initial_states=None):
    """Launch the fused scan. Same contract as :func:`ssd_varlen_scan`; the chunk length is the
    kernel's own (64 tokens), which changes only the cost, never the result."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    nseq = cu_seqlens.numel() - 1
    x, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, B, C))
    A = A.contiguous()
    D = None if D is None else D.contiguous()
    y = torch.empty_like(x)
    final = torch.empty(nseq, H, P, N, device=x.device, dtype=torch.float32)
    s0 = initial_states
    if s0 is not None and s0.stride(-1) != 1:
        s0 = s0.contiguous()
    block_p = min(next_pow2(P, 16), 64)
    dummy = final
    _ssd_varlen_fwd_kernel[(nseq, H, triton.cdiv(P, block_p))](
        x, dt, A, B, C, D if D is not None else dummy, y, s0 if s0 is not None else dummy, final,
        cu_seqlens.to(torch.int32),
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        y.stride(0), y.stride(1), *(s0.stride()[:3] if s0 is not None else (0, 0, 0)), *final.stride()[:3],
        P, N, HEADS_PER_GROUP=H // G, BLOCK_T=32 if INTERPRET else 64, BLOCK_P=block_p,
        BLOCK_N=next_pow2(N, 16), HAS_D=D is not None, HAS_S0=s0 is not None,
        # the [P, N] state, the [T, T] decay and the [T, N] B/C tiles all live in registers
        PRECISION=dot_precision(x.dtype), num_warps=8 if block_p * next_pow2(N, 16) >= 8192 else 4,
    )
    return y, final


def _ssd_varlen_scan_triton(x, dt, A, B, C, cu_seqlens, *, chunk_size, D=None, initial_states=None):
    if needs_grad(x, dt, A, B, C, D, initial_states):  # forward-only kernel: training uses the torch path
        return _ssd_varlen_scan_torch(x, dt, A, B, C, cu_seqlens, chunk_size=chunk_size, D=D,
                                      initial_states=initial_states)
    return ssd_varlen_scan_triton(x, dt, A, B, C, cu_seqlens, D=D, initial_states=initial_states)


def _ssd_chunk_scan_triton(x, dt, A, B, C, *, chunk_size, D=None, initial_state=None):
    if needs_grad(x, dt, A, B, C, D, initial_state):
        return _ssd_chunk_scan_torch(x, dt, A, B, C, chunk_size=chunk_size, D=D, initial_state=initial_state)
    b, L, H, P = x.shape
    cu = torch.arange(b + 1, device=x.device, dtype=torch.int32) * L
    y, final = ssd_varlen_scan_triton(x.reshape(b * L, H, P), dt.reshape(b * L, H), A, B.reshape(b * L, *B.shape[2:]),
                                      C.reshape(b * L, *C.shape[2:]), cu, D=D, initial_states=initial_state)
    return y.view(b, L, H, P), final


def _ssd_step_triton(state, x, dt, A, B, C, *, D=None, slots=None):
    if needs_grad(x, dt, A, B, C, D):
        return _ssd_step_torch(state, x, dt, A, B, C, D=D, slots=slots)
    return ssd_state_update(state, x, dt, A, B, C, D=D, slots=slots)


dispatch.register("ssd_chunk_scan", "triton", _ssd_chunk_scan_triton, triton_support.probe)
dispatch.register("ssd_varlen_scan", "triton", _ssd_varlen_scan_triton, triton_support.probe)
dispatch.register("ssd_step", "triton", _ssd_step_triton, triton_support.probe)

_mamba = cuda_backend.probe("mamba_ssm")
dispatch.register("ssd_chunk_scan", "cuda", cuda_backend.ssd_chunk_scan, _mamba)
dispatch.register("ssd_varlen_scan", "cuda", cuda_backend.ssd_varlen_scan, _mamba, cuda_backend.supports_packed_ssd)
dispatch.register("ssd_step", "cuda", cuda_backend.ssd_step, _mamba)
