"""GQA attention sub-layer (``*``): projections, RoPE, and the causal attention op.

Optionally (Qwen3-Next's gated attention) q and k are RMS-normalised per head before RoPE (``qk_norm``) and
the output is gated per channel by ``sigmoid`` of a second half of ``q_proj`` (``output_gate``)."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..cache.specs import AttentionSpec, CacheDtypes
from ..config import AttentionConfig, HybridConfig
from .linear import Linear
from .norm import RMSNorm
from .rope import RotaryEmbedding


class Attention(nn.Module):
    kind = "attention"

    @classmethod
    def from_config(cls, cfg: HybridConfig) -> Attention:
        return cls(cfg.d_model, cfg.attention, cfg.norm_eps, cfg.norm_offset)

    @staticmethod
    def cache_spec(cfg: HybridConfig, dtypes: CacheDtypes) -> AttentionSpec:
        a = cfg.attention
        return AttentionSpec(n_kv_heads=a.n_kv_heads, head_dim=a.head_dim, window=a.sliding_window, dtype=dtypes.kv)

    @staticmethod
    def flops_per_token(cfg: HybridConfig, seq_len: int) -> float:
        """FLOPs of one token beyond the projections: scores and values over the average visible context of a
        causal prefill of ``seq_len`` tokens (the sliding window respected)."""
        a = cfg.attention
        w = min(a.sliding_window or seq_len, seq_len)
        avg_ctx = (w * (w + 1) / 2 + (seq_len - w) * w) / seq_len  # mean over p = 1..L of min(p, w)
        return 4.0 * a.n_heads * a.head_dim * avg_ctx

    def __init__(self, d_model: int, cfg: AttentionConfig, norm_eps: float = 1e-5, norm_offset: float = 0.0):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        # with the output gate, each head's rows are its query then its gate (Qwen3-Next's layout)
        q_rows = cfg.n_heads * cfg.head_dim * (2 if cfg.output_gate else 1)
        self.q_proj = Linear(d_model, q_rows, bias=cfg.qkv_bias)
        self.k_proj = Linear(d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = Linear(d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.n_heads * cfg.head_dim, d_model, bias=cfg.out_bias)
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, norm_eps, norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, norm_eps, norm_offset)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., L, d_model] -> q [..., L, Hq, D], k, v [..., L, Hkv, D], before RoPE (q/k normed with
        ``qk_norm``)."""
        return self.project_gated(x)[:3]

    def project_gated(self, x: torch.Tensor):
        """:meth:`project` and the output gate's pre-activation [..., L, Hq * D] (None without ``output_gate``)."""
        lead = x.shape[:-1]
        q, gate = self.q_proj(x), None
        if self.cfg.output_gate:
            q, gate = q.view(*lead, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(*lead, self.n_heads * self.head_dim)
        q = q.reshape(*lead, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.n_kv_heads, self.head_dim)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, gate

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The attention output [..., Hq * D] -> o_proj, gated by sigmoid(gate) first when there is a gate."""
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE at ``positions`` [..., L] on q and k (new tensors), from ``rope`` = (cos, sin) of ``positions``
        when the caller computed them once for all layers."""
        if not self.rope.rotary_dim:
            return q, k
        cos, sin = rope if rope is not None else self.rope.cos_sin(positions, q.dtype)
        return self.rope(q, cos, sin), self.rope(k, cos, sin)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor,
            rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., L, d_model], positions [..., L] -> q [..., L, Hq, D], k, v [..., L, Hkv, D] (RoPE applied)."""
        q, k, v = self.project(x)
        q, k = self.rotate(q, k, positions, rope)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        if self.cfg.output_gate:
            q, k, v, gate = self.project_gated(x)
            q, k = self.rotate(q, k, torch.arange(L, device=x.device))
        else:  # through qkv, the one place the full forward's post-RoPE q/k come from (tests observe it)
            (q, k, v), gate = self.qkv(x, torch.arange(L, device=x.device)), None
        out = kernels.causal_attention(q, k, v, window=self.cfg.sliding_window)
        return self.output(out.reshape(B, L, -1), gate)

    def forward_packed(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        """Packed inference: x [T, d_model] of a :class:`hybrid.engine.packed_batch.PackedBatch` -> [T, d_model].

        ``cache`` is this layer's :class:`hybrid.cache.views.AttentionCacheView`: it takes the new K/V into the
        paged pools, then attends over each sequence's cached history through its block table, the batch's
        one-token sequences (``batch.decode``) with the decode op, the rest (``batch.prefill``: prompts and
        prompt chunks) with the prefill op. What the cache stores (dtype, int8 / fp8 scales) and which keys a
        query sees (window, StreamingLLM's sinks and re-numbering, SnapKV's observation) is the view's business;
        for the re-numbering it gets the queries before RoPE and this layer's RoPE.
        ``batch.seq_lens`` count the tokens in each sequence's blocks, ``batch.positions`` the RoPE positions.
        """
        q_unrotated, k, v, gate = self.project_gated(x)
        q, k = self.rotate(q_unrotated, k, batch.positions, batch.rope)
        queries = cache.queries(q, q_unrotated, batch, self.rope)
        cache.write(k, v, batch.slot_mapping)
        parts = []
        if (d := batch.decode) is not None:
            parts.append(cache.decode(queries, d))
        if (p := batch.prefill) is not None:
            parts.append(cache.prefill(queries, p))
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        return self.output(out.reshape(x.shape[0], -1), gate)
