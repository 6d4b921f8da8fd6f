"""GLA mixer (``L``): gated linear attention as flash-linear-attention's ``GatedLinearAttention`` defines it.

One fused in-projection gives ``[q, k, v, g, gk_low]`` (``g`` the output gate, absent without
``use_output_gate``; ``gk_low`` the low-rank half of the decay gate, whose ``gk_proj`` up-projection has fla's
bias); an optional short causal depthwise conv (SiLU) runs over ``[q, k, v]`` (fla's three convs, one per
projection, are the same per-channel op); the per-key-dim log decay is ``logsigmoid(gk) /
gate_logit_normalizer`` (clamped from below at ``clamp_min`` when set); ``n_kv_heads`` key/value/decay heads
each serve ``n_heads / n_kv_heads`` consecutive heads (fla's ``repeat``); per head a ``[head_k_dim, head_v_dim]``
state carries ``S_t = diag(exp(gk_t)) S_{t-1} + k_t^T v_t`` and ``o_t = q_t S_t / sqrt(head_k_dim)``
(:mod:`hybrid.kernels.gla`); the output goes through an RMSNorm per head (a ``head_v_dim`` weight shared by the
heads, none without ``elementwise_affine``) times ``silu(g)``, and the out-projection.

Cached per sequence: ``recurrent`` (``[H, K, V]``), and ``conv`` (the last ``d_conv - 1`` q/k/v inputs) with
the short conv, named by :meth:`GLA.cache_spec`; the packed path follows
:meth:`hybrid.layers.gated_deltanet.GatedDeltaNet.forward_packed`.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..cache.specs import CacheDtypes, StateSpec, StateTensorSpec, state_scale_groups
from ..config import GLAConfig, HybridConfig
from .linear import Linear
from .norm import GatedRMSNorm, RMSNorm, lower_head_norm


class GLA(nn.Module):
    kind = "gla"

    @classmethod
    def from_config(cls, cfg: HybridConfig) -> GLA:
        return cls(cfg.d_model, cfg.gla)

    @staticmethod
    def cache_spec(cfg: HybridConfig, dtypes: CacheDtypes) -> StateSpec:
        g = cfg.gla
        # the matrix state accumulates over the whole sequence like Mamba's SSM state: it takes the SSM dtype
        # (fp32 by default); int8 scales per head and key row, conv scales per head's worth of channels
        rec = StateTensorSpec("recurrent", (g.n_heads, g.head_k_dim, g.head_v_dim), dtypes.ssm,
                              g.n_heads * g.head_k_dim)
        if not g.use_short_conv:
            return StateSpec((rec,))
        conv = StateTensorSpec("conv", (g.conv_dim, g.d_conv - 1), dtypes.conv,
                               state_scale_groups(g.conv_dim, g.n_heads))
        return StateSpec((conv, rec))

    @staticmethod
    def flops_per_token(cfg: HybridConfig, seq_len: int) -> float:
        """FLOPs of one token beyond the projections: the recurrence and the depthwise conv (if any)."""
        g = cfg.gla
        conv = 2.0 * g.d_conv * g.conv_dim if g.use_short_conv else 0.0
        return kernels.gla.flops_per_token(g.n_heads, g.head_k_dim, g.head_v_dim) + conv

    def __init__(self, d_model: int, cfg: GLAConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.groups = cfg.n_heads, cfg.n_heads // cfg.n_kv_heads
        self.head_k_dim, self.head_v_dim = cfg.head_k_dim, cfg.head_v_dim
        self.gate_dim = cfg.value_dim if cfg.use_output_gate else 0
        self.in_proj = Linear(d_model, cfg.conv_dim + self.gate_dim + cfg.gate_low_rank_dim, bias=False)
        self.gk_proj = Linear(cfg.gate_low_rank_dim, cfg.kv_key_dim, bias=True)
        self.conv1d = (nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim, bias=cfg.conv_bias)
                       if cfg.use_short_conv else None)
        self.norm = (GatedRMSNorm(cfg.head_v_dim, eps=cfg.norm_eps, norm_before_gate=True) if cfg.use_output_gate
                     else RMSNorm(cfg.head_v_dim, eps=cfg.norm_eps))
        if not cfg.elementwise_affine:  # a norm with no weight: ones, not a parameter (nothing trains or loads it)
            del self.norm.weight
            self.norm.register_buffer("weight", torch.ones(cfg.head_v_dim), persistent=False)
        self.out_proj = Linear(cfg.value_dim, d_model, bias=False)

    def reset_special_parameters(self, std: float | None = None) -> None:
        """Re-draw the conv after a model-wide init (which draws only the Linear and Embedding weights)."""
        if self.conv1d is not None:
            self.conv1d.reset_parameters()

    def split_projection(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """-> qkv [..., conv_dim] (the conv's input), the output gate g [..., value_dim] (None without one),
        the decay gate's low-rank projection [..., gate_low_rank_dim]."""
        c = self.cfg
        qkv, g, low = proj.split([c.conv_dim, self.gate_dim, c.gate_low_rank_dim], dim=-1)
        return qkv, (g if self.gate_dim else None), low

    def heads(self, qkv: torch.Tensor, low: torch.Tensor):
        """Post-conv qkv [..., conv_dim] and the decay's low-rank part -> q, k [..., H, K], v [..., H, V] and
        the log decay gk [..., H, K] fp32, the shared key/value heads repeated to every head."""
        c = self.cfg
        q, k, v = qkv.split([c.key_dim, c.kv_key_dim, c.kv_value_dim], dim=-1)
        lead = qkv.shape[:-1]
        # low's rows contiguous: a decode step's few rows then take the native product (the decode program's)
        gk = kernels.gla.decay(self.gk_proj(low.contiguous()), c.gate_logit_normalizer, c.clamp_min)
        q = q.reshape(*lead, self.n_heads, self.head_k_dim)
        k, gk = (x.reshape(*lead, c.n_kv_heads, self.head_k_dim) for x in (k, gk))
        v = v.reshape(*lead, c.n_kv_heads, self.head_v_dim)
        if self.groups > 1:
            k, v, gk = (x.repeat_interleave(self.groups, dim=-2) for x in (k, v, gk))
        return q, k, v, gk

    def _out(self, o: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
        """o [..., H, V] and the output gate [..., H*V] (or None) -> norm (times silu(g)), out-projection."""
        y = self.norm(o) if g is None else self.norm(o.to(g.dtype), g.reshape(o.shape))
        return self.out_proj(y.reshape(*o.shape[:-2], self.cfg.value_dim))

    def _conv_weights(self):
        return self.conv1d.weight[:, 0], self.conv1d.bias

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        qkv, g, low = self.split_projection(self.in_proj(u))
        if self.conv1d is not None:
            qkv, _ = kernels.causal_conv1d(qkv, *self._conv_weights(), activation="silu")
        q, k, v, gk = self.heads(qkv, low)
        o, _ = kernels.gla_chunk(q, k, v, gk, chunk_size=self.cfg.chunk_size)
        return self._out(o, g)

    def step(self, state, qkv: torch.Tensor, low: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence through the conv (if any) and GLA step ops, updating the states of ``state`` (a
        :class:`hybrid.cache.views.StateCacheView`: rows ``slots`` of the cache, or working copies) in place:
        qkv [n, conv_dim], low [n, gate_low_rank_dim] -> o [n, H, V]."""
        if self.conv1d is not None:
            qkv = state["conv"].step(kernels.causal_conv1d_step, qkv, *self._conv_weights(), activation="silu",
                                     slots=slots)
        q, k, v, gk = self.heads(qkv, low)
        return state["recurrent"].step(kernels.gla_step, q, k, v, gk, slots=slots)

    def forward_packed(self, u: torch.Tensor, batch, cache) -> torch.Tensor:
        """Packed inference: u [T, d_model] of a :class:`hybrid.engine.packed_batch.PackedBatch` -> [T, d_model].

        ``cache`` is this layer's :class:`hybrid.cache.views.StateCacheView` (``recurrent``, and ``conv`` with
        the short conv). As :meth:`hybrid.layers.gated_deltanet.GatedDeltaNet.forward_packed`: one-token
        sequences (``batch.decode``) take the step ops on their slots, speculative verify chunks
        (``batch.verify``) the step ops position by position on working copies with every position's state kept,
        the rest (``batch.scan``) the varlen conv and chunked GLA from their slot's state.
        """
        qkv, g, low = self.split_projection(self.in_proj(u))
        os = []
        if (d := batch.decode) is not None:
            os.append(self.step(cache, qkv[d.tokens], low[d.tokens], slots=d.state_slots))
        if (vr := batch.verify) is not None:  # speculative verify chunks: states kept at every position
            os.append(batch.verify_states.run(cache, (qkv[vr.tokens], low[vr.tokens]), self.step))
        if (p := batch.scan) is not None:
            slots, cu = p.state_slots, p.cu_seqlens
            x = qkv[p.tokens]
            if self.conv1d is not None:
                conv_pool = cache["conv"]
                x, conv_final = kernels.causal_conv1d_varlen(x, *self._conv_weights(), cu,
                                                             initial_states=conv_pool.read(slots), activation="silu")
                conv_pool.write(slots, conv_final)
            q, k, v, gk = self.heads(x, low[p.tokens])
            rec_pool = cache["recurrent"]
            o, rec_final = kernels.gla_varlen(q, k, v, gk, cu, chunk_size=self.cfg.chunk_size,
                                              initial_states=rec_pool.read(slots))
            rec_pool.write(slots, rec_final)
            os.append(o)
        o = torch.cat(os) if len(os) > 1 else os[0]
        return self._out(o, g)

    # ---- the decode program's lowering (docs/adding-a-mixer.md) ---------------------------------
    def lower_decode(self, b, norm, view) -> None:
        """Five or six ops: the pre-norm, in_proj, the conv step (with the short conv), the GLA step (the decay
        gate's low-rank up-projection and log decay inside it), the per-head norm, out_proj with the residual."""
        c = self.cfg
        pools = b.float_pools(view, ("conv", "recurrent") if self.conv1d is not None else ("recurrent",))
        H, Hkv, K, V, R = self.n_heads, c.n_kv_heads, self.head_k_dim, self.head_v_dim, c.gate_low_rank_dim
        if V > 512 or c.feature_map is not None or c.gate_fn != "swish":
            raise b.Unsupported(f"head_v_dim {V} (the native step takes up to 512), or a feature map / gate function")
        if b.int4(self.gk_proj) is not None or not b.plain(self.gk_proj.bias):
            raise b.Unsupported("an int4 (or oddly typed) decay-gate projection")
        wg, sg = b.weight(self.gk_proj)
        d_model, width = self.in_proj.in_features, self.in_proj.out_features
        h, proj = b.buffer(d_model), b.buffer(width)
        low, gk, gf = b.buffer(R), b.buffer(c.kv_key_dim), b.buffer(c.kv_key_dim, torch.float32)
        o, y = b.buffer(c.value_dim), b.buffer(c.value_dim)
        b.norm(norm, b.X, h)
        b.linear(self.in_proj, h, proj)  # q | k | v | g | gk_low
        qkv, stride = proj, width
        if self.conv1d is not None:
            qkv, stride = b.buffer(c.conv_dim), c.conv_dim
            b.causal_conv(self.conv1d, pools[0], proj, width, qkv)
        clamp = c.clamp_min is not None
        b.op("GLA", state=pools[-1].data, qkv=qkv, low=proj[:, c.conv_dim + self.gate_dim:], low_buf=low, w=wg,
             wscale=sg, bias=self.gk_proj.bias, gk=gk, g=gf, y=o, sdt=b.code(pools[-1].data), xdt=b.dt, qkv_s=stride,
             low_s=width, wdt=b.code(wg), bdt=b.code(self.gk_proj.bias), R=R, H=H, Hkv=Hkv, K=K, V=V,
             clamp=int(clamp), normalizer=c.gate_logit_normalizer, clamp_min=c.clamp_min if clamp else 0.0)
        lower_head_norm(b, self.norm, o, proj[:, c.conv_dim:] if self.gate_dim else None, width, H, V, y)
        b.linear(self.out_proj, y, b.X, residual=b.X)
