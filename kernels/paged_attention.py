"""Attention for the inference engine's packed batches: no padding, K/V in a paged pool.

Packed layout: the tokens of B sequences are concatenated, ``q: [T, Hq, D]`` with
``cu_seqlens_q: [B+1]`` (int32) marking where each sequence's new tokens start.

Paged pool: ``k_pool, v_pool: [num_blocks, block_size, Hkv, D]``; ``block_tables: [B, max_blocks]``
(int32) lists each sequence's blocks in order; ``seq_lens: [B]`` counts each sequence's tokens
in the cache *including* the new ones (written with :func:`write_kv` before attending). Token
``p`` of sequence ``b`` lives at slot ``block_tables[b, p // block_size] * block_size + p % block_size``.

Quantised pools (int8 / fp8, :mod:`.kv_quant`) come with ``k_scale, v_scale: [num_blocks, block_size, Hkv]``
(one scale per token slot and KV head, fp16): :func:`write_kv` quantises into them, the torch ops dequantise
the pages they gather, the Triton kernels load each token's codes and scale and dequantise in registers.
"""

from __future__ import annotations

import functools
import math

import torch

from . import cuda_backend, dispatch, kv_quant, native, triton_support
from .attention import _LOG2E, causal_attention, causal_attention_ref, causal_mask, flash_attention_triton
from .native import ops as native_ops
from .packing import check_cu_seqlens, host_values, sequences, with_host_values
from .triton_support import INTERPRET, dot_precision, jit, needs_grad, next_pow2, tl


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter new keys/values into the pool. k, v: [T, Hkv, D]; slot_mapping: [T] int64 slots. A quantised
    pool gets codes and each token's scales (:func:`.kv_quant.write_kv_quantized`)."""
    if k_scale is not None:
        kv_quant.write_kv_quantized(k_pool, k_scale, k, slot_mapping)
        kv_quant.write_kv_quantized(v_pool, v_scale, v, slot_mapping)
        return
    if kv_quant.is_quantized(k_pool.dtype):
        raise ValueError(f"write_kv: a {k_pool.dtype} pool needs its k_scale / v_scale")
    k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slot_mapping, k.to(k_pool.dtype))
    v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slot_mapping, v.to(v_pool.dtype))


def gather_kv(pool: torch.Tensor, block_table: torch.Tensor, n: int, scale: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first ``n`` cached tokens of one sequence, contiguous: [n, Hkv, D] (a copy of n tokens), in
    ``dtype`` when given; a quantised pool's pages are dequantised with their per-token ``scale`` (default fp32)."""
    bs = pool.shape[1]
    blocks = block_table[: (n + bs - 1) // bs].long()
    pages = pool[blocks]
    if scale is not None:
        pages = kv_quant.dequantize_pages(pages, scale[blocks], dtype or torch.float32)
    elif dtype is not None:
        pages = pages.to(dtype)  # a float pool in another dtype than the queries (bf16 K/V, fp32 model)
    return pages.reshape(-1, *pool.shape[2:])[:n]


def sink_attention(q, k, v, *, window=None, scale=None, sinks=0, q_sinks=None):
    """Causal attention where each query sees its last ``window`` keys and the first ``sinks`` keys of the
    sequence (StreamingLLM's attention sinks): q [1, Lq, Hq, D], k, v [1, Lk, Hkv, D], the queries the last Lq
    positions. ``q_sinks`` (like q): the queries rotated at their position in the paper's cache numbering,
    which score the sink keys in place of q (StreamingLLM re-numbering, :mod:`hybrid.cache.pruning`). Naive fp32
    softmax; the reference and the torch path of the pruned cache."""
    _, Lq, Hq, D = q.shape
    Lk = k.shape[1]
    rep = Hq // k.shape[2]
    mask = causal_mask(Lq, Lk, window, q.device)
    kpos = torch.arange(Lk, device=q.device)[None, :]
    mask |= (kpos < sinks) & (kpos <= torch.arange(Lk - Lq, Lk, device=q.device)[:, None])
    kf = k.float().repeat_interleave(rep, dim=2)
    s = torch.einsum("blhd,bshd->bhls", q.float(), kf)
    if q_sinks is not None and sinks:
        n = min(sinks, Lk)
        s[..., :n] = torch.einsum("blhd,bshd->bhls", q_sinks.float(), kf[:, :n])
    s = (s * (D ** -0.5 if scale is None else scale)).masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhls,bshd->blhd", p, v.float().repeat_interleave(rep, dim=2)).to(q.dtype)


def _per_sequence(attend, q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, window, scale,
                  k_scale=None, v_scale=None, sinks=0, q_sinks=None):
    if sinks:
        attend = functools.partial(sink_attention, sinks=sinks)
    out = torch.empty_like(q)
    cu = host_values(cu_seqlens_q)
    for b, n in enumerate(host_values(seq_lens)):
        k = gather_kv(k_pool, block_tables[b], n, k_scale, q.dtype)[None]
        v = gather_kv(v_pool, block_tables[b], n, v_scale, q.dtype)[None]
        extra = {} if q_sinks is None else {"q_sinks": q_sinks[None, cu[b]:cu[b + 1]]}
        out[cu[b]:cu[b + 1]] = attend(q[None, cu[b]:cu[b + 1]], k, v, window=window, scale=scale, **extra)[0]
    return out


def paged_prefill_attention_ref(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, *, window=None,
                                scale=None, k_scale=None, v_scale=None, sinks=0, q_sinks=None):
    """Naive reference: gather each sequence's history (dequantised), softmax(QK^T)V with the causal mask."""
    return _per_sequence(causal_attention_ref, q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables,
                         window, scale, k_scale, v_scale, sinks, q_sinks)


def _paged_prefill_attention_torch(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, *, window=None,
                                   scale=None, k_scale=None, v_scale=None, sinks=0, q_sinks=None):
    return _per_sequence(causal_attention, q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables,
                         window, scale, k_scale, v_scale, sinks, q_sinks)


def _check_sinks(q, sinks, q_sinks):
    if q_sinks is not None and (not sinks or q_sinks.shape != q.shape):
        raise ValueError(f"paged attention: q_sinks (the queries that score the sink keys, StreamingLLM "
                         f"re-numbering) needs sinks > 0 and q's shape {tuple(q.shape)}; got sinks={sinks}, "
                         f"q_sinks {tuple(q_sinks.shape)}")


def _check_paged(q, k_pool, v_pool, seq_lens, block_tables, k_scale=None, v_scale=None):
    if kv_quant.is_quantized(k_pool.dtype) != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(f"paged attention: a quantised (int8/fp8) pool needs k_scale and v_scale, a {k_pool.dtype} "
                         f"pool takes none (got k_scale {k_scale is not None}, v_scale {v_scale is not None})")
    if k_scale is not None and (k_scale.shape != k_pool.shape[:3] or v_scale.shape != k_scale.shape):
        raise ValueError(f"paged attention: scales must be per token, [blocks, block_size, Hkv] = "
                         f"{tuple(k_pool.shape[:3])}, got {tuple(k_scale.shape)}, {tuple(v_scale.shape)}")
    if k_pool.shape != v_pool.shape or k_pool.dim() != 4 or q.shape[-1] != k_pool.shape[-1]:
        raise ValueError(f"paged attention: pools must be [blocks, block_size, Hkv, D] with D = {q.shape[-1]}, "
                         f"got {tuple(k_pool.shape)}, {tuple(v_pool.shape)}")
    if q.shape[-2] % k_pool.shape[2]:
        raise ValueError(f"paged attention: {q.shape[-2]} query heads is not a multiple of {k_pool.shape[2]} KV heads")
    if block_tables.dim() != 2 or block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"paged attention: block_tables must be [B, max_blocks] with B = {seq_lens.shape[0]}, "
                         f"got {tuple(block_tables.shape)}")


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, *,
                            window: int | None = None, scale: float | None = None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            sinks: int = 0, q_sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged history.

    q: [T, Hq, D]; pools [NB, BS, Hkv, D]; cu_seqlens_q: [B+1]; seq_lens: [B] (history + new);
    block_tables: [B, MB] -> [T, Hq, D]. The new tokens of sequence b are its last
    ``cu_seqlens_q[b+1] - cu_seqlens_q[b]`` positions, so this serves whole prompts, chunks of a
    prompt on top of earlier chunks, and (one token each) decode. Quantised pools pass their per-token scales.
    ``sinks``: the first ``sinks`` tokens stay visible beside the window (StreamingLLM, :mod:`hybrid.cache.pruning`;
    the torch path only: the Triton and flash-attn kernels have no sinks); ``q_sinks`` [T, Hq, D]: the queries
    that score the sink keys (rotated at the paper's cache positions), q scoring the rest.
    """
    _check_paged(q, k_pool, v_pool, seq_lens, block_tables, k_scale, v_scale)
    _check_sinks(q, sinks, q_sinks)
    if sinks:
        return _paged_prefill_attention_torch(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, window=window,
                                              scale=scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                                              q_sinks=q_sinks)
    if k_scale is None:
        _, fn = dispatch.choose("paged_prefill_attention", q.device.type)
        return fn(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, window=window, scale=scale)
    fn = _quantized_impl("paged_prefill_attention", q.device.type)
    return fn(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, window=window, scale=scale,
              k_scale=k_scale, v_scale=v_scale)


def _quantized_impl(op: str, device_type: str):
    """The backend for quantised pages: the dispatch's choice unless it cannot read them (flash-attn's
    paged ops take bf16/fp16 pages only), then Triton where it runs, else torch."""
    name, fn = dispatch.choose(op, device_type)
    if name != "cuda":
        return fn
    return _QUANTIZED_FALLBACK[op][0 if triton_support.probe() is None else 1]


def paged_decode_attention_ref(q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None,
                               k_scale=None, v_scale=None, sinks=0, q_sinks=None):
    """Reference: decode is a prefill of one new token per sequence."""
    cu = torch.arange(q.shape[0] + 1, device=q.device, dtype=torch.int32)
    return paged_prefill_attention_ref(q, k_pool, v_pool, cu, seq_lens, block_tables, window=window, scale=scale,
                                       k_scale=k_scale, v_scale=v_scale, sinks=sinks, q_sinks=q_sinks)


# The batched decode walk gathers the K (and V) of this many bytes (fp32) per column group, at most this many
# tokens per sequence: a group small enough that its temporaries stay in cache and under glibc's mmap
# threshold (a fresh mmap'd temporary page-faults on first touch, ~1 GB/s here: the old 1024-token groups of 32
# sequences, 33 MB, spent most of the op on page faults). Measured on this CPU (batch 8 / 32 / 128, context
# 144-4096, fp32 and bf16 pages): 4 MB groups 1.5-3.5x faster than 1024-token groups, 1-2 MB and 8 MB close.
DECODE_GROUP_BYTES = 4 << 20
DECODE_GROUP_TOKENS = 1024


def _bmm_per_kv_head(a: torch.Tensor, kv: torch.Tensor, *, scores: bool) -> torch.Tensor:
    """``a [B, Hkv, rep, x]`` with a gathered ``kv [B, t, Hkv, D]``, one bmm per KV head on kv's strided
    [B, t, D] slice (BLAS takes the row stride Hkv * D; an einsum over [B, t, Hkv, D] would first copy K or V
    into head-major order, a second pass over it): ``scores`` a = queries (x = D) -> a kv^T [B, Hkv, rep, t];
    else a = probabilities (x = t) -> a kv [B, Hkv, rep, D]."""
    return torch.stack([torch.bmm(a[:, h], kv[:, :, h].transpose(1, 2) if scores else kv[:, :, h])
                        for h in range(kv.shape[2])], 1)


def _gather_group(pool: torch.Tensor, flat: torch.Tensor, role: str, buffered: bool) -> tuple[torch.Tensor, float]:
    """One column group's pages of ``pool`` as fp32 and the factor their values still need. ``buffered`` (eager,
    CPU, no autograd): gathered and converted into reused buffers (:func:`.kv_quant.gather_pages_as_float`: no
    fresh multi-MB temporaries, which page-fault); else plain tensor ops (torch.compile plans its own memory)."""
    if buffered:
        return kv_quant.gather_pages_as_float(pool, flat, role)
    return kv_quant.codes_to_float(pool.index_select(0, flat))


def _paged_decode_attention_torch(q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None,
                                  k_scale=None, v_scale=None, sinks=0, q_sinks=None):
    # Batched over sequences: walk the block tables a group of columns at a time with an online
    # softmax, so K/V are read through the tables and only a group's positions are gathered at once
    # (never a padded copy of every whole history), and there is no Python loop over sequences. A few
    # sequences are cheaper one by one (gather + SDPA: fewer, larger ops; measured crossover on CPU near
    # 8 sequences). The column range comes from the host copies of the lengths that the engine attaches
    # to seq_lens (no sync); under torch.compile (the compiled decode step) it is the whole block table,
    # a static shape, with the lengths only masking.
    per_sequence_below = 5
    B, Hq, D = q.shape
    compiling = torch.compiler.is_compiling()
    if B < per_sequence_below and not compiling:
        cu = with_host_values(torch.arange(B + 1, device=q.device, dtype=torch.int32), tuple(range(B + 1)))
        return _paged_prefill_attention_torch(q, k_pool, v_pool, cu, seq_lens, block_tables, window=window,
                                              scale=scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                                              q_sinks=q_sinks)
    BS, Hkv = k_pool.shape[1], k_pool.shape[2]
    rep = Hq // Hkv
    sm_scale = D ** -0.5 if scale is None else scale
    qf = q.float().view(B, Hkv, rep, D) * sm_scale
    # re-numbered sinks: the sink keys are scored by the queries rotated at their cache positions
    qf_sinks = None if q_sinks is None else q_sinks.float().view(B, Hkv, rep, D) * sm_scale
    lens = seq_lens.to(device=q.device, dtype=torch.long)
    first = (lens - window).clamp_min(0) if window is not None else torch.zeros_like(lens)
    m = torch.full((B, Hkv, rep), float("-inf"), device=q.device)
    l = torch.zeros(B, Hkv, rep, device=q.device)
    acc = torch.zeros(B, Hkv, rep, D, device=q.device)
    cols = max(1, min(DECODE_GROUP_TOKENS, DECODE_GROUP_BYTES // (B * Hkv * D * 4)) // BS)
    sink_cols = -(-sinks // BS)  # the sink blocks, then the window's: the freed blocks between are never read
    if compiling:
        spans = [(c0, min(c0 + cols, block_tables.shape[1])) for c0 in range(0, block_tables.shape[1], cols)]
    else:
        lens_host = host_values(seq_lens)
        lo = min(max(0, n - window) for n in lens_host) if window is not None else 0
        hi = -(-max(lens_host) // BS)
        start = max(lo // BS, sink_cols) if sinks else lo // BS
        spans = ([(c0, min(c0 + cols, sink_cols, hi)) for c0 in range(0, min(sink_cols, hi), cols)]
                 + [(c0, min(c0 + cols, hi)) for c0 in range(start, hi, cols)])
    # eager on CPU: each group's pages land in reused buffers (no autograd through an out= gather)
    buffered = not compiling and q.device.type == "cpu" and not (torch.is_grad_enabled() and k_pool.requires_grad)
    for c0, c1 in spans:
        blocks = block_tables[:, c0:c1].long()
        g = blocks.shape[1]
        flat = blocks.flatten()  # index_select on dim 0: whole contiguous blocks, memcpy-fast
        k, fk = _gather_group(k_pool, flat, "k", buffered)
        v, fv = _gather_group(v_pool, flat, "v", buffered)
        k, v = k.view(B, g * BS, Hkv, D), v.view(B, g * BS, Hkv, D)
        if k_scale is not None:
            # quantised pages: only the codes are converted (as bf16 pages are cast); the per-token scales
            # multiply the scores and the probabilities instead ([B, Hkv, t], D times smaller than K, V)
            ks = (k_scale[blocks].float() * fk).view(B, g * BS, Hkv).transpose(1, 2)[:, :, None, :]  # [B, Hkv, 1, t]
            vs = (v_scale[blocks].float() * fv).view(B, g * BS, Hkv).transpose(1, 2)[:, :, None, :]
        pos = torch.arange(c0 * BS, (c0 + g) * BS, device=q.device)
        visible = (pos[None] < lens[:, None]) & ((pos[None] >= first[:, None]) | (pos[None] < sinks))  # [B, t]
        s = _bmm_per_kv_head(qf, k, scores=True)
        if qf_sinks is not None and c0 * BS < sinks:  # only the column groups that hold sink keys
            s = torch.where(pos < sinks, _bmm_per_kv_head(qf_sinks, k, scores=True), s)
        if k_scale is not None:
            s.mul_(ks)  # in place: the scores are this loop's own, and a fresh [B, Hkv, rep, t] costs page faults
        s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing visible yet
        p = torch.exp(s - m_safe[..., None])
        corr = torch.exp(m - m_safe)
        l = l * corr + p.sum(-1)
        pv = p if v_scale is None else p.mul_(vs)
        acc = acc * corr[..., None] + _bmm_per_kv_head(pv, v, scores=False)
        m = m_new
    return (acc / l[..., None]).view(B, Hq, D).to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, *, window: int | None = None,
                           scale: float | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, sinks: int = 0,
                           q_sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence over its paged history. q: [B, Hq, D] -> [B, Hq, D]. Quantised pools
    pass their per-token scales; ``sinks`` and ``q_sinks`` as in :func:`paged_prefill_attention` (torch path)."""
    _check_paged(q, k_pool, v_pool, seq_lens, block_tables, k_scale, v_scale)
    _check_sinks(q, sinks, q_sinks)
    if sinks:
        return _paged_decode_attention_torch(q, k_pool, v_pool, seq_lens, block_tables, window=window, scale=scale,
                                             k_scale=k_scale, v_scale=v_scale, sinks=sinks, q_sinks=q_sinks)
    if k_scale is None:
        _, fn = dispatch.choose("paged_decode_attention", q.device.type)
        return fn(q, k_pool, v_pool, seq_lens, block_tables, window=window, scale=scale)
    fn = _quantized_impl("paged_decode_attention", q.device.type)
    return fn(q, k_pool, v_pool, seq_lens, block_tables, window=window, scale=scale, k_scale=k_scale,
              v_scale=v_scale)


def _each_sequence(attend, q, k, v, cu_seqlens, window, scale):
    out = torch.empty_like(q)
    for _, s in sequences(cu_seqlens):
        out[s] = attend(q[None, s], k[None, s], v[None, s], window=window, scale=scale)[0]
    return out


def varlen_attention_ref(q, k, v, cu_seqlens, *, window=None, scale=None):
    return _each_sequence(causal_attention_ref, q, k, v, cu_seqlens, window, scale)


def _varlen_attention_torch(q, k, v, cu_seqlens, *, window=None, scale=None):
    return _each_sequence(causal_attention, q, k, v, cu_seqlens, window, scale)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal self-attention within each packed sequence (no cache).

    q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: [B+1] -> [T, Hq, D].
    """
    if q.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: need q [T, Hq, D], k/v [T, Hkv, D] with Hq % Hkv == 0; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    check_cu_seqlens(cu_seqlens, q.shape[0], "varlen_attention")
    _, fn = dispatch.choose("varlen_attention", q.device.type)
    return fn(q, k, v, cu_seqlens, window=window, scale=scale)


dispatch.register("paged_prefill_attention", "torch", _paged_prefill_attention_torch)
dispatch.register("paged_decode_attention", "torch", _paged_decode_attention_torch)
dispatch.register("paged_decode_attention", "native", native_ops.paged_decode, native.available,
                  native_ops.supports_paged_decode)
dispatch.register("varlen_attention", "torch", _varlen_attention_torch)


# --- Triton ----------------------------------------------------------------------------------------
# Packed prefill (with or without a paged history) reuses the flash kernel of attention.py.

def _varlen_attention_triton(q, k, v, cu_seqlens, *, window=None, scale=None):
    if needs_grad(q, k, v):  # forward-only kernel: training goes through the torch path
        return _varlen_attention_torch(q, k, v, cu_seqlens, window=window, scale=scale)
    cu = cu_seqlens.to(torch.int32)
    return flash_attention_triton(q, k, v, cu, cu_seqlens_k=cu, window=window, scale=scale)


def _paged_prefill_attention_triton(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, *, window=None,
                                    scale=None, k_scale=None, v_scale=None):
    if needs_grad(q, k_pool, v_pool):
        return _paged_prefill_attention_torch(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables,
                                              window=window, scale=scale, k_scale=k_scale, v_scale=v_scale)
    return flash_attention_triton(q, k_pool, v_pool, cu_seqlens_q.to(torch.int32), seq_lens=seq_lens.to(torch.int32),
                                  block_tables=block_tables.to(torch.int32), window=window, scale=scale,
                                  k_scale=k_scale, v_scale=v_scale)


# Decode: one query per sequence. Grid (sequences, KV heads, splits): a program loads the GROUP query
# heads that share a KV head as one [GROUP, D] block, so every K/V tile read from the pool serves the
# whole group, and covers one split of the visible context (flash-decoding: long contexts fill the GPU
# even at batch 1). It writes its normalised partial output and log-sum-exp (base 2); a second kernel
# merges the splits, weighting each by 2^(lse - max lse).

@jit
def _paged_decode_split_kernel(
    Q, K, V, O_part, LSE_part, seq_lens, block_tables, K_scale, V_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_bt, stride_sb, stride_st, scale_log2, window,
    split_len,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    QUANT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(0, seq_len - window)
    start = first + sp * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_valid = offs_g < GROUP
    d_valid = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_valid[:, None] & d_valid[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < end
        blk = tl.load(block_tables + b * stride_bt + offs_n // PAGE, mask=n_valid, other=0).to(tl.int64)
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(K + (blk * stride_kb + (offs_n % PAGE) * stride_kt)[:, None] + kvh * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if QUANT:  # int8 / fp8 codes times their token's scale, dequantised in registers
            s_rows = blk * stride_sb + (offs_n % PAGE) * stride_st + kvh
            ks = tl.load(K_scale + s_rows, mask=n_valid, other=0.0).to(tl.float32)
            k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + (blk * stride_vb + (offs_n % PAGE) * stride_vt)[:, None] + kvh * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        if QUANT:
            vs = tl.load(V_scale + s_rows, mask=n_valid, other=0.0).to(tl.float32)
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    empty = l_i == 0.0  # a split past the end of a short sequence
    acc = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(O_part + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os + offs_d[None, :], acc,
             mask=g_valid[:, None] & d_valid[None, :])
    tl.store(LSE_part + b * stride_lb + heads * stride_lh + sp, lse, mask=g_valid)


@jit
def _paged_decode_merge_kernel(O_part, LSE_part, O, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                               stride_b, stride_h, SPLITS, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_valid = offs_s < SPLITS
    lse = tl.load(LSE_part + b * stride_lb + h * stride_lh + offs_s, mask=s_valid, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # every sequence has >= 1 token, so some split is non-empty
    part = tl.load(O_part + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
                   mask=s_valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(O + b * stride_b + h * stride_h + offs_d, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


_DECODE_MIN_SPLIT = 256  # tokens per split below which splitting costs more (merge) than it gains
_DECODE_TARGET_PROGRAMS = 512  # enough programs to fill a large GPU a few times over


def decode_splits(batch: int, kv_heads: int, max_context: int) -> int:
    """How many context splits a decode launch uses: enough programs to fill the GPU, none tiny."""
    by_length = max(1, -(-max_context // _DECODE_MIN_SPLIT))
    by_occupancy = max(1, -(-_DECODE_TARGET_PROGRAMS // (batch * kv_heads)))
    return min(by_length, by_occupancy, 64)


def paged_decode_attention_triton(q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None,
                                  num_splits=None, k_scale=None, v_scale=None):
    """The split decode launch. q: [B, Hq, D] -> [B, Hq, D]; ``num_splits`` None picks by shape; quantised
    pools with their per-token scales ``k_scale, v_scale [NB, BS, Hkv]``."""
    B, Hq, D = q.shape
    page, Hkv = k_pool.shape[1], k_pool.shape[2]
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_pool = k_pool if k_pool.stride(-1) == 1 else k_pool.contiguous()
    v_pool = v_pool if v_pool.stride(-1) == 1 else v_pool.contiguous()
    # Bound the context by the block table, not seq_lens.max(): no host sync per decode step.
    max_context = block_tables.shape[1] * page if window is None else min(window, block_tables.shape[1] * page)
    splits = num_splits or decode_splits(B, Hkv, max_context)
    block_n = 32 if INTERPRET else 64
    per_split = -(-max_context // splits)
    split_len = -(-per_split // block_n) * block_n  # whole key blocks
    o_part = torch.empty(B, Hq, splits, D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B, Hq, splits, device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    block_tables = block_tables.to(torch.int32)
    quant = k_scale is not None
    k_scale, v_scale = (k_scale.contiguous(), v_scale.contiguous()) if quant else (o_part, o_part)
    _paged_decode_split_kernel[(B, Hkv, splits)](
        q, k_pool, v_pool, o_part, lse_part, seq_lens.to(torch.int32), block_tables, k_scale, v_scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), block_tables.stride(0), k_scale.stride(0) if quant else 0,
        k_scale.stride(1) if quant else 0, scale * _LOG2E, window or 0, split_len,
        GROUP=Hq // Hkv, BLOCK_G=next_pow2(Hq // Hkv, 16), HEAD_DIM=D, BLOCK_D=next_pow2(D, 16), BLOCK_N=block_n,
        PAGE=page, HAS_WINDOW=window is not None, PRECISION=dot_precision(q.dtype), QUANT=quant,
    )
    out = torch.empty_like(q)
    _paged_decode_merge_kernel[(B, Hq)](
        o_part, lse_part, out, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1), out.stride(0), out.stride(1), splits, HEAD_DIM=D, BLOCK_D=next_pow2(D),
        BLOCK_S=next_pow2(splits),
    )
    return out


def _paged_decode_attention_triton(q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None,
                                   k_scale=None, v_scale=None):
    if needs_grad(q, k_pool, v_pool):
        return _paged_decode_attention_torch(q, k_pool, v_pool, seq_lens, block_tables, window=window, scale=scale,
                                             k_scale=k_scale, v_scale=v_scale)
    return paged_decode_attention_triton(q, k_pool, v_pool, seq_lens, block_tables, window=window, scale=scale,
                                         k_scale=k_scale, v_scale=v_scale)


# quantised pages on a device whose dispatch picks flash-attn: (Triton, torch)
_QUANTIZED_FALLBACK = {"paged_prefill_attention": (_paged_prefill_attention_triton, _paged_prefill_attention_torch),
                       "paged_decode_attention": (_paged_decode_attention_triton, _paged_decode_attention_torch)}

dispatch.register("varlen_attention", "triton", _varlen_attention_triton, triton_support.probe)
dispatch.register("paged_prefill_attention", "triton", _paged_prefill_attention_triton, triton_support.probe)
dispatch.register("paged_decode_attention", "triton", _paged_decode_attention_triton, triton_support.probe)

_flash = cuda_backend.probe("flash_attn")
dispatch.register("varlen_attention", "cuda", cuda_backend.varlen_attention, _flash, cuda_backend.supports_flash)
dispatch.register("paged_prefill_attention", "cuda", cuda_backend.paged_prefill_attention, _flash,
                  cuda_backend.supports_flash_paged)
dispatch.register("paged_decode_attention", "cuda", cuda_backend.paged_decode_attention, _flash,
                  cuda_backend.supports_flash_paged)
