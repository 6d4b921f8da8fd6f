"""GQA attention sub-layer (``*``): projections, RoPE, and the causal attention op."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..config import AttentionConfig, HybridConfig
from ..kv_pruning import StreamingLLM
from ..specs import AttentionSpec, CacheDtypes
from .linear import Linear
from .rope import RotaryEmbedding


class Attention(nn.Module):
    kind = "attention"

    @classmethod
    def from_config(cls, cfg: HybridConfig) -> Attention:
        return cls(cfg.d_model, cfg.attention)

    @staticmethod
    def cache_spec(cfg: HybridConfig, dtypes: CacheDtypes) -> AttentionSpec:
        a = cfg.attention
        return AttentionSpec(n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, window=a.sliding_window, dtype=dtypes.kv)

    def __init__(self, d_model: int, cfg: AttentionConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = Linear(d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = Linear(d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, d_model, bias=cfg.out_bias)
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor,
            rope: tuple[torch.Tensor, torch.Tensor] | None = None,
            sink_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """x [..., L, d_model], positions [..., L] -> q [..., L, Hq, D], k, v [..., L, Hkv, D] (RoPE applied,
        from ``rope`` = (cos, sin) of ``positions`` when the caller computed them once for all layers). With
        ``sink_positions`` also the queries rotated there (StreamingLLM's re-numbering): q, k, v, q_sinks."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        q_sinks = q
        if self.rope.rotary_dim:
            cos, sin = rope if rope is not None else self.rope.cos_sin(positions, q.dtype)
            if sink_positions is not None:
                q_sinks = self.rope(q, *self.rope.cos_sin(sink_positions, q.dtype))
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        return (q, k, v) if sink_positions is None else (q, k, v, q_sinks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.qkv(x, torch.arange(L, device=x.device))
        out = kernels.causal_attention(q, k, v, window=self.cfg.sliding_window)
        return self.o_proj(out.reshape(B, L, -1))

    def forward_packed(self, x: torch.Tensor, batch, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                       visible: tuple[int | None, int, bool] | None = None, observe=None) -> torch.Tensor:
        """Packed inference: x [T, d_model] of a :class:`hybrid.packed_batch.PackedBatch` -> [T, d_model].

        Writes the new K/V into the paged pools, then attends over each sequence's cached history
        through its block table; the batch's one-token sequences (``batch.decode``) take the decode op,
        the rest (``batch.prefill``: prompts and prompt chunks) the prefill op. An int8 / fp8 pool comes
        with its per-token scales (``k_scale``, ``v_scale``): the write quantises, the ops dequantise. A KV pruning
        policy (:mod:`hybrid.kv_pruning`) gives ``visible = (window, sinks, renumber)`` in place of the layer's
        window (StreamingLLM; with ``renumber`` the queries are rotated a second time at their position in the
        paper's cache numbering, ``min(p, sinks + window - 1)``, and that copy scores the sink keys), or
        ``observe(batch, q)``, which keeps the queries of SnapKV's observation window.
        ``batch.seq_lens`` count the tokens in each sequence's blocks, ``batch.positions`` the RoPE positions.
        """
        w, sc = self.cfg.sliding_window, dict(k_scale=k_scale, v_scale=v_scale)
        sink_positions = None
        if visible is not None:
            w, sc["sinks"], renumber = visible
            if renumber and self.rope.rotary_dim:
                sink_positions = StreamingLLM.sink_position(batch.positions, sc["sinks"], w)
        q, k, v, *q_sinks = self.qkv(x, batch.positions, batch.rope, sink_positions)
        q_sinks = q_sinks[0] if q_sinks else None
        if observe is not None:
            observe(batch, q)
        kernels.write_kv(k_pool, v_pool, k, v, batch.slot_mapping, k_scale, v_scale)
        parts = []
        if (d := batch.decode) is not None:
            if q_sinks is not None:
                sc["q_sinks"] = q_sinks[d.tokens]
            parts.append(kernels.paged_decode_attention(q[d.tokens], k_pool, v_pool, d.seq_lens, d.block_tables,
                                                        window=w, **sc))
        if (p := batch.prefill) is not None:
            if q_sinks is not None:
                sc["q_sinks"] = q_sinks[p.tokens]
            parts.append(kernels.paged_prefill_attention(q[p.tokens], k_pool, v_pool, p.cu_seqlens, p.seq_lens,
                                                         p.block_tables, window=w, **sc))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        return self.o_proj(out.reshape(x.shape[0], -1))
