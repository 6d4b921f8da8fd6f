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

    # ---- the decode program's lowering (docs/adding-a-mixer.md) ---------------------------------
    def lower_decode(self, b, norm, view) -> None:
        """This sub-layer's decode ops (``b``: hybrid/decode/builder.py's builder, ``view``: its cache view): the
        pre-norm, q/k/v with RoPE and the K/V write in one pass, paged attention, the out-projection with the
        residual. Float K/V pools only, no pruning policy, no gate or q/k norms."""
        if self.cfg.output_gate or self.cfg.qk_norm:
            raise b.Unsupported("gated attention or q/k norms")
        if view.k_scale is not None or view.sinks is not None or view.observe is not None or view.renumber:
            raise b.Unsupported("quantised K/V pages or a pruning policy")
        k_pool, v_pool = view.k_pool, view.v_pool
        if k_pool.dtype not in (torch.float32, torch.bfloat16) or v_pool.dtype != k_pool.dtype \
                or self.head_dim > 512 or self.n_heads % self.n_kv_heads or self.n_heads // self.n_kv_heads > 64:
            raise b.Unsupported(f"a {k_pool.dtype} pool or head layout")
        rot = self.rope.rotary_dim
        if rot % 2 or rot > self.head_dim:
            raise b.Unsupported(f"rotary_dim {rot}")
        q_, k_, v_ = self.q_proj, self.k_proj, self.v_proj
        qops = [b.q(m) for m in (q_, k_, v_)]
        if any(t is not None for t in qops):  # int8dq / 8da4w: the input row quantised once for the three
            if any(t is None for t in qops) or len({t[0] for t in qops}) != 1:
                raise b.Unsupported("q/k/v not all int8dq or all 8da4w")
            self._same_biases(b)
            (kind, wq, sq), (_, wk, sk), (_, wv, sv) = qops
            return self._lower_ops(b, norm, view, "QKV_ROPE_Q", dict(
                wq=wq, sq=sq, bq=q_.bias, wk=wk, sk=sk, bk=k_.bias, wv=wv, sv=sv, bv=v_.bias, qkind=kind))
        int4 = [b.int4(m) for m in (q_, k_, v_)]
        if any(t is not None for t in int4):  # all three int4 of one group, head_dim a multiple of int4pack's 16
            if any(t is None for t in int4) or len({(t[1].dtype, t[2]) for t in int4}) != 1 or self.head_dim % 16:
                raise b.Unsupported("q/k/v not all int4 of one group, or a head_dim not a multiple of 16")
            self._same_biases(b)
            (qq, szq, group), (qk, szk, _), (qv, szv, _) = int4
            return self._lower_ops(b, norm, view, "QKV_ROPE_INT4", dict(
                qq=qq, szq=szq, bq=q_.bias, qk=qk, szk=szk, bk=k_.bias, qv=qv, szv=szv, bv=v_.bias,
                sdt=b.code(szq), G=group, bn=b.int4_block()))
        (wq, sq), (wk, sk), (wv, sv) = b.weight(q_), b.weight(k_), b.weight(v_)
        if len({wq.dtype, wk.dtype, wv.dtype}) != 1 or not b.plain(q_.bias, k_.bias, v_.bias) \
                or len({t.dtype for t in (q_.bias, k_.bias, v_.bias) if t is not None}) > 1:
            raise b.Unsupported("q/k/v weights of different dtypes")
        self._lower_ops(b, norm, view, "QKV_ROPE", dict(wq=wq, bq=q_.bias, wk=wk, bk=k_.bias, wv=wv, bv=v_.bias,
                                                         sq=sq, sk=sk, sv=sv, wdt=b.code(wq)))

    def _same_biases(self, b) -> None:
        biases = (self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)
        if not b.plain(*biases) or len({t.dtype for t in biases if t is not None}) > 1:
            raise b.Unsupported("q/k/v biases of different dtypes")

    def _lower_ops(self, b, norm, view, qkv_kind: str, weights: dict) -> None:
        """The ops once the q/k/v weights are vetted: ``qkv_kind`` with ``weights`` (its weight fields, each
        weight format's own)."""
        k_pool, v_pool = view.k_pool, view.v_pool
        d_model, Hq, Hkv, D = self.q_proj.in_features, self.n_heads, self.n_kv_heads, self.head_dim
        h, q, o = b.buffer(d_model), b.buffer(Hq * D), b.buffer(Hq * D)
        b.norm(norm, b.X, h)
        b.op(qkv_kind, **weights, x=h, q_out=q, kpool=k_pool, vpool=v_pool, bdt=b.code(self.q_proj.bias),
             xdt=b.dt, pdt=b.code(k_pool), rot=self.rope.rotary_dim, Hq=Hq, Hkv=Hkv, D=D, K=d_model)
        b.op("PAGED", q=q, k=k_pool, v=v_pool, out=o, qdt=b.dt, kvdt=b.code(k_pool), Hq=Hq, Hkv=Hkv, D=D,
             BS=k_pool.shape[1], window=view.window or 0, scale=D ** -0.5)
        b.linear(self.o_proj, o, b.X, residual=b.X)
