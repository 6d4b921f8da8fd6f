"""Attention for the inference engine's packed batches: no padding, K/V in a paged pool.

Packed layout: the tokens of B sequences are concatenated, ``q: [T, Hq, D]`` with
``cu_seqlens_q: [B+1]`` (int32) marking where each sequence's new tokens start.

Paged pool: ``k_pool, v_pool: [num_blocks, block_size, Hkv, D]``; ``block_tables: [B, max_blocks]``
(int32) lists each sequence's blocks in order; ``seq_lens: [B]`` counts each sequence's tokens
in the cache *including* the new ones (written with :func:`write_kv` before attending). Token
``p`` of sequence ``b`` lives at slot ``block_tables[b, p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import torch

from . import dispatch
from .attention import causal_attention, causal_attention_ref


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into the pool. k, v: [T, Hkv, D]; slot_mapping: [T] int64 slots."""
    k_pool.view(-1, *k_pool.shape[2:]).index_copy_(0, slot_mapping, k.to(k_pool.dtype))
    v_pool.view(-1, *v_pool.shape[2:]).index_copy_(0, slot_mapping, v.to(v_pool.dtype))


def gather_kv(pool: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` cached tokens of one sequence, contiguous: [n, Hkv, D] (a copy of n tokens)."""
    bs = pool.shape[1]
    blocks = block_table[: (n + bs - 1) // bs].long()
    return pool[blocks].reshape(-1, *pool.shape[2:])[:n]


def _per_sequence(attend, q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, window, scale):
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_pool, block_tables[b], n)[None]
        v = gather_kv(v_pool, block_tables[b], n)[None]
        out[cu[b]:cu[b + 1]] = attend(q[None, cu[b]:cu[b + 1]], k, v, window=window, scale=scale)[0]
    return out


def paged_prefill_attention_ref(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, *, window=None,
                                scale=None):
    """Naive reference: gather each sequence's history, softmax(QK^T)V with the causal mask."""
    return _per_sequence(causal_attention_ref, q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables,
                         window, scale)


def _paged_prefill_attention_torch(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, *, window=None,
                                   scale=None):
    return _per_sequence(causal_attention, q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables,
                         window, scale)


def _check_paged(q, k_pool, v_pool, seq_lens, block_tables):
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
                            window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' paged history.

    q: [T, Hq, D]; pools [NB, BS, Hkv, D]; cu_seqlens_q: [B+1]; seq_lens: [B] (history + new);
    block_tables: [B, MB] -> [T, Hq, D]. The new tokens of sequence b are its last
    ``cu_seqlens_q[b+1] - cu_seqlens_q[b]`` positions, so this serves whole prompts, chunks of a
    prompt on top of earlier chunks, and (one token each) decode.
    """
    _check_paged(q, k_pool, v_pool, seq_lens, block_tables)
    _, fn = dispatch.choose("paged_prefill_attention", q.device.type)
    return fn(q, k_pool, v_pool, cu_seqlens_q, seq_lens, block_tables, window=window, scale=scale)


def paged_decode_attention_ref(q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None):
    """Reference: decode is a prefill of one new token per sequence."""
    cu = torch.arange(q.shape[0] + 1, device=q.device, dtype=torch.int32)
    return paged_prefill_attention_ref(q, k_pool, v_pool, cu, seq_lens, block_tables, window=window, scale=scale)


def _paged_decode_attention_torch(q, k_pool, v_pool, seq_lens, block_tables, *, window=None, scale=None):
    # Batched over sequences: walk the block tables a group of columns at a time with an online
    # softmax, so K/V are read through the tables and at most `group_tokens` positions per
    # sequence are gathered at once (never a padded copy of every whole history), and there is
    # no Python loop over sequences. A few sequences are cheaper one by one (gather + SDPA: fewer,
    # larger ops; measured crossover on CPU near 8 sequences).
    group_tokens, per_sequence_below = 1024, 5
    B, Hq, D = q.shape
    if B < per_sequence_below:
        cu = torch.arange(B + 1, device=q.device, dtype=torch.int32)
        return _paged_prefill_attention_torch(q, k_pool, v_pool, cu, seq_lens, block_tables, window=window,
                                              scale=scale)
    BS, Hkv = k_pool.shape[1], k_pool.shape[2]
    rep = Hq // Hkv
    qf = q.float().view(B, Hkv, rep, D) * (D ** -0.5 if scale is None else scale)
    lens = seq_lens.to(device=q.device, dtype=torch.long)
    first = (lens - window).clamp_min(0) if window is not None else torch.zeros_like(lens)
    m = torch.full((B, Hkv, rep), float("-inf"), device=q.device)
    l = torch.zeros(B, Hkv, rep, device=q.device)
    acc = torch.zeros(B, Hkv, rep, D, device=q.device)
    cols = max(1, group_tokens // BS)
    for c0 in range(int(first.min()) // BS, -(-int(lens.max()) // BS), cols):
        blocks = block_tables[:, c0:c0 + cols].long()
        g = blocks.shape[1]
        k = k_pool[blocks].view(B, g * BS, Hkv, D).float()
        v = v_pool[blocks].view(B, g * BS, Hkv, D).float()
        pos = torch.arange(c0 * BS, (c0 + g) * BS, device=q.device)
        visible = (pos[None] < lens[:, None]) & (pos[None] >= first[:, None])  # [B, t]
        s = torch.einsum("bhrd,bthd->bhrt", qf, k).masked_fill(~visible[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing visible yet
        p = torch.exp(s - m_safe[..., None])
        corr = torch.exp(m - m_safe)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.einsum("bhrt,bthd->bhrd", p, v)
        m = m_new
    return (acc / l[..., None]).view(B, Hq, D).to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, *, window: int | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """One new token per sequence over its paged history. q: [B, Hq, D] -> [B, Hq, D]."""
    _check_paged(q, k_pool, v_pool, seq_lens, block_tables)
    _, fn = dispatch.choose("paged_decode_attention", q.device.type)
    return fn(q, k_pool, v_pool, seq_lens, block_tables, window=window, scale=scale)


def varlen_attention_ref(q, k, v, cu_seqlens, *, window=None, scale=None):
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        s = slice(cu[b], cu[b + 1])
        out[s] = causal_attention_ref(q[None, s], k[None, s], v[None, s], window=window, scale=scale)[0]
    return out


def _varlen_attention_torch(q, k, v, cu_seqlens, *, window=None, scale=None):
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        s = slice(cu[b], cu[b + 1])
        out[s] = causal_attention(q[None, s], k[None, s], v[None, s], window=window, scale=scale)[0]
    return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, *,
                     window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal self-attention within each packed sequence (no cache).

    q: [T, Hq, D]; k, v: [T, Hkv, D]; cu_seqlens: [B+1] -> [T, Hq, D].
    """
    if q.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: need q [T, Hq, D], k/v [T, Hkv, D] with Hq % Hkv == 0; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    _, fn = dispatch.choose("varlen_attention", q.device.type)
    return fn(q, k, v, cu_seqlens, window=window, scale=scale)


dispatch.register("paged_prefill_attention", "torch", _paged_prefill_attention_torch)
dispatch.register("paged_decode_attention", "torch", _paged_decode_attention_torch)
dispatch.register("varlen_attention", "torch", _varlen_attention_torch)
