"""Causal GQA attention (prefill / training) and its one-step (decode) form.

Layouts follow the model: ``q: [B, L, Hq, D]``, ``k, v: [B, L, Hkv, D]`` with ``Hq % Hkv == 0``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import dispatch


def _causal_mask(Lq: int, Lk: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Bool mask [Lq, Lk], True where query i (at absolute position Lk - Lq + i) may see key j."""
    qpos = torch.arange(Lk - Lq, Lk, device=device)[:, None]
    kpos = torch.arange(Lk, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= qpos - kpos < window
    return mask


def causal_attention_ref(q, k, v, *, window=None, scale=None):
    """Naive softmax(QK^T)V with the KV heads repeated; the reference for every backend."""
    B, L, Hq, D = q.shape
    rep = Hq // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("blhd,bshd->bhls", q.float(), k.float()) * scale
    s = s.masked_fill(~_causal_mask(L, k.shape[1], window, q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhls,bshd->blhd", p, v.float()).to(q.dtype)


def _causal_attention_torch(q, k, v, *, window=None, scale=None):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
    gqa = q.shape[2] != k.shape[2]
    if window is None or window >= k.shape[1]:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = _causal_mask(q.shape[1], k.shape[1], window, q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) GQA attention.

    q: [B, L, Hq, D]; k, v: [B, L, Hkv, D] -> [B, L, Hq, D]. ``window`` counts the query itself.
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"causal_attention: bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"causal_attention: {q.shape[2]} query heads is not a multiple of {k.shape[2]} KV heads")
    _, fn = dispatch.choose("causal_attention", q.device.type)
    return fn(q, k, v, window=window, scale=scale)


def decode_attention_ref(q, k_cache, v_cache, cache_seqlens, *, window=None, scale=None):
    """One query token per sequence against its cached keys (naive reference).

    q: [B, Hq, D]; k_cache, v_cache: [B, S, Hkv, D]; cache_seqlens: [B] valid lengths (incl. the
    current token, already written) -> [B, Hq, D].
    """
    B, Hq, D = q.shape
    S = k_cache.shape[1]
    rep = Hq // k_cache.shape[2]
    k = k_cache.repeat_interleave(rep, dim=2).float()
    v = v_cache.repeat_interleave(rep, dim=2).float()
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("bhd,bshd->bhs", q.float(), k) * scale
    pos = torch.arange(S, device=q.device)[None, :]
    valid = pos < cache_seqlens[:, None]
    if window is not None:
        valid &= pos >= cache_seqlens[:, None] - window
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhs,bshd->bhd", torch.softmax(s, -1), v).to(q.dtype)


def _decode_attention_torch(q, k_cache, v_cache, cache_seqlens, *, window=None, scale=None):
    S = k_cache.shape[1]
    pos = torch.arange(S, device=q.device)[None, :]
    valid = pos < cache_seqlens[:, None]
    if window is not None:
        valid &= pos >= cache_seqlens[:, None] - window
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k_cache.transpose(1, 2), v_cache.transpose(1, 2),
        attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=q.shape[1] != k_cache.shape[2])
    return out[:, :, 0, :]


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_seqlens: torch.Tensor, *, window: int | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """One-step attention for decode over a contiguous cache.

    q: [B, Hq, D]; k_cache, v_cache: [B, S, Hkv, D]; cache_seqlens: [B] int -> [B, Hq, D].
    """
    _, fn = dispatch.choose("decode_attention", q.device.type)
    return fn(q, k_cache, v_cache, cache_seqlens, window=window, scale=scale)


dispatch.register("causal_attention", "torch", _causal_attention_torch)
dispatch.register("decode_attention", "torch", _decode_attention_torch)
