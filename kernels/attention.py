"""Causal GQA attention over a padded-free batch of equal-length sequences (training, scoring).

Layouts follow the model: ``q: [B, L, Hq, D]``, ``k, v: [B, L, Hkv, D]`` with ``Hq % Hkv == 0``.
The packed (varlen) and paged forms used by the inference engine are in ``paged_attention.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import dispatch


def causal_mask(Lq: int, Lk: int, window: int | None, device: torch.device) -> torch.Tensor:
    """Bool mask [Lq, Lk], True where query i (at absolute position Lk - Lq + i) may see key j."""
    qpos = torch.arange(Lk - Lq, Lk, device=device)[:, None]
    kpos = torch.arange(Lk, device=device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= qpos - kpos < window
    return mask


def causal_attention_ref(q, k, v, *, window=None, scale=None):
    """Naive softmax(QK^T)V with the KV heads repeated; the reference for every backend."""
    B, Lq, Hq, D = q.shape
    rep = Hq // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = torch.einsum("blhd,bshd->bhls", q.float(), k.float()) * scale
    s = s.masked_fill(~causal_mask(Lq, k.shape[1], window, q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhls,bshd->blhd", p, v.float()).to(q.dtype)


def _causal_attention_torch(q, k, v, *, window=None, scale=None):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, L, D]
    gqa = q.shape[2] != k.shape[2]
    # SDPA's is_causal aligns the mask top-left; queries that are the last Lq of Lk keys need ours.
    if (window is None or window >= k.shape[1]) and q.shape[1] == k.shape[1]:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = causal_mask(q.shape[1], k.shape[1], window, q.device)
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """Causal (optionally sliding-window) GQA attention.

    q: [B, Lq, Hq, D]; k, v: [B, Lk, Hkv, D] -> [B, Lq, Hq, D], with Lq <= Lk: the queries are the
    last Lq positions (Lq < Lk is a prefill on top of Lk - Lq cached tokens). ``window`` counts
    the query itself.
    """
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] \
            or q.shape[1] > k.shape[1]:
        raise ValueError(f"causal_attention: bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"causal_attention: {q.shape[2]} query heads is not a multiple of {k.shape[2]} KV heads")
    _, fn = dispatch.choose("causal_attention", q.device.type)
    return fn(q, k, v, window=window, scale=scale)


dispatch.register("causal_attention", "torch", _causal_attention_torch)
