"""Gated DeltaNet mixer (``G``): the gated delta rule as Qwen3-Next and flash-linear-attention define it.

One fused in-projection gives ``[q, k, v, z, b, a]``; a short causal depthwise conv (SiLU) runs over
``[q, k, v]``; q and k are L2-normalised per head; per value head the decay ``g = -exp(A_log) *
softplus(a + dt_bias)`` (log space, <= 0) and the write strength ``beta = sigmoid(b)`` drive the delta rule over
a ``[head_k_dim, head_v_dim]`` state (:mod:`hybrid.kernels.gated_delta`); the output goes through an RMSNorm
per head (a ``head_v_dim`` weight shared by the heads, as Qwen3-Next's) gated by ``silu(z)`` and the
out-projection. ``n_k_heads`` key heads each serve ``n_heads / n_k_heads`` consecutive value heads (GQA-style,
Qwen3-Next's ``repeat_interleave``).

Cached per sequence: ``conv`` (the last ``d_conv - 1`` q/k/v inputs) and ``recurrent`` (``[H, K, V]``), named
by :meth:`GatedDeltaNet.cache_spec`; the packed path follows :meth:`hybrid.layers.mamba2.Mamba2.forward_packed`.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels
from ..cache.specs import CacheDtypes, StateSpec, StateTensorSpec, state_scale_groups
from ..config import GatedDeltaNetConfig, HybridConfig
from .linear import Linear
from .mamba2 import init_dt_bias
from .norm import GatedRMSNorm, lower_head_norm

# Tokens of a long prompt the inference forward takes at once (rounded down to whole chunks): see forward. 1024
# keeps every temporary under glibc's 32 MB mmap ceiling (a block's fp32 [1024, 4632] projection is 19 MB), so
# the allocator reuses them instead of mapping and faulting them in afresh: 24 gdn-small layers, bf16, 2 threads
# on the Zen 4, 2K tokens 73.0 -> 62.5 us/token/layer and 8K 57.0 -> 52.7 (median, against 2048; 512: 62.1, 56.5).
_TOKEN_BLOCK = 1024


class GatedDeltaNet(nn.Module):
    kind = "gated_deltanet"

    @classmethod
    def from_config(cls, cfg: HybridConfig) -> GatedDeltaNet:
        return cls(cfg.d_model, cfg.gated_deltanet, cfg.norm_eps)

    @staticmethod
    def cache_spec(cfg: HybridConfig, dtypes: CacheDtypes) -> StateSpec:
        g = cfg.gated_deltanet
        # the matrix state accumulates over the whole sequence like Mamba's SSM state: it takes the SSM dtype
        # (fp32 by default); int8 scales per head and key row, conv scales per value head's worth of channels
        return StateSpec((
            StateTensorSpec("conv", (g.conv_dim, g.d_conv - 1), dtypes.conv, state_scale_groups(g.conv_dim, g.n_heads)),
            StateTensorSpec("recurrent", (g.n_heads, g.head_k_dim, g.head_v_dim), dtypes.ssm,
                            g.n_heads * g.head_k_dim),
        ))

    @staticmethod
    def flops_per_token(cfg: HybridConfig, seq_len: int) -> float:
        """FLOPs of one token beyond the projections: the recurrence and the depthwise conv."""
        g = cfg.gated_deltanet
        return (kernels.gated_delta.flops_per_token(g.n_heads, g.head_k_dim, g.head_v_dim)
                + 2.0 * g.d_conv * g.conv_dim)

    def __init__(self, d_model: int, cfg: GatedDeltaNetConfig, norm_eps: float = 1e-5):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_k_heads = cfg.n_heads, cfg.n_k_heads
        self.head_k_dim, self.head_v_dim = cfg.head_k_dim, cfg.head_v_dim
        self.key_dim, self.value_dim = cfg.n_k_heads * cfg.head_k_dim, cfg.n_heads * cfg.head_v_dim
        self.in_proj = Linear(d_model, cfg.conv_dim + self.value_dim + 2 * cfg.n_heads, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(init_dt_bias(cfg.n_heads, cfg.dt_min, cfg.dt_max, cfg.dt_init_floor))
        self.A_log = nn.Parameter(torch.log(torch.empty(cfg.n_heads).uniform_(*cfg.A_init_range)))
        self.norm = GatedRMSNorm(cfg.head_v_dim, eps=norm_eps, norm_before_gate=True)
        self.out_proj = Linear(self.value_dim, d_model, bias=cfg.proj_bias)

    def reset_special_parameters(self, std: float | None = None) -> None:
        """Re-draw dt_bias, A_log and the conv after a model-wide init has overwritten them."""
        c = self.cfg
        with torch.no_grad():
            self.dt_bias.copy_(init_dt_bias(c.n_heads, c.dt_min, c.dt_max, c.dt_init_floor))
            self.A_log.copy_(torch.log(torch.empty(c.n_heads).uniform_(*c.A_init_range)))
            self.conv1d.reset_parameters()

    def split_projection(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> qkv [..., conv_dim] (the conv's input), z [..., H*V], b [..., H], a [..., H]."""
        return proj.split([self.cfg.conv_dim, self.value_dim, self.n_heads, self.n_heads], dim=-1)

    def split_qkv(self, qkv: torch.Tensor):
        """Post-conv qkv [..., conv_dim] -> L2-normalised (in fp32) q, k [..., Hk, K] and v [..., H, V]."""
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        lead = qkv.shape[:-1]
        q = kernels.gated_delta.l2norm_heads(q.reshape(*lead, self.n_k_heads, self.head_k_dim))
        k = kernels.gated_delta.l2norm_heads(k.reshape(*lead, self.n_k_heads, self.head_k_dim))
        return q, k, v.reshape(*lead, self.n_heads, self.head_v_dim)

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> log decay g = -exp(A_log) softplus(a + dt_bias) and write strength beta = sigmoid(b), fp32 [..., H]."""
        return kernels.gated_delta.gates(b, a, self.A_log, self.dt_bias)

    def _out(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o [..., H, V], z [..., H*V] -> the gated per-head norm and the out-projection [..., d_model]."""
        y = self.norm(o.to(z.dtype), z.reshape(o.shape))
        return self.out_proj(y.reshape(*o.shape[:-2], self.value_dim))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        L = u.shape[1]
        block = max(self.cfg.chunk_size, _TOKEN_BLOCK // self.cfg.chunk_size * self.cfg.chunk_size)
        if torch.is_grad_enabled() or L <= block:
            return self._forward_span(u, None, None)[0]
        # Inference on a long prompt: the whole layer a block of tokens at a time, the conv and recurrent states
        # carried from block to block. Every whole-prompt temporary (the [L, 4632] projection, the conv output,
        # the fp32 q/k, the gate, the norm's fp32 copies) was a fresh allocation of hundreds of MB that the
        # elementwise passes page-faulted in and then streamed from memory; block-sized they stay in the cache
        # and the allocator reuses them. Blocks are whole chunks, so the recurrence sees the same chunks.
        out = torch.empty(*u.shape[:-1], self.out_proj.out_features, dtype=u.dtype, device=u.device)
        conv, S = None, None
        for s in range(0, L, block):
            e = min(L, s + block)
            out[:, s:e], conv, S = self._forward_span(u[:, s:e], conv, S)
        return out

    def _forward_span(self, u, conv, S):
        """u [B, l, d_model] from the conv state ``conv`` and recurrent state ``S`` (None: zeros) -> (y, the conv
        state and the recurrent state after it)."""
        qkv, z, b, a = self.split_projection(self.in_proj(u))
        qkv, conv = kernels.causal_conv1d(qkv, self.conv1d.weight[:, 0], self.conv1d.bias, initial_state=conv,
                                          activation="silu")
        q, k, v = self.split_qkv(qkv)
        g, beta = self.gates(b, a)
        o, S = kernels.gated_delta_chunk(q, k, v, g, beta, initial_state=S, chunk_size=self.cfg.chunk_size)
        return self._out(o, z), conv, S

    def step(self, state, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
             slots: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence through the conv and gated-delta step ops, updating the states of ``state``
        (a :class:`hybrid.cache.views.StateCacheView`: rows ``slots`` of the cache, or working copies) in place:
        qkv [n, conv_dim], b/a [n, H] -> o [n, H, V]."""
        qkv = state["conv"].step(kernels.causal_conv1d_step, qkv, self.conv1d.weight[:, 0], self.conv1d.bias,
                                 activation="silu", slots=slots)
        q, k, v = self.split_qkv(qkv)
        g, beta = self.gates(b, a)
        return state["recurrent"].step(kernels.gated_delta_step, q, k, v, g, beta, slots=slots)

    def forward_packed(self, u: torch.Tensor, batch, cache) -> torch.Tensor:
        """Packed inference: u [T, d_model] of a :class:`hybrid.engine.packed_batch.PackedBatch` -> [T, d_model].

        ``cache`` is this layer's :class:`hybrid.cache.views.StateCacheView` (states ``conv`` and ``recurrent``).
        As :meth:`hybrid.layers.mamba2.Mamba2.forward_packed`: one-token sequences (``batch.decode``) take the
        step ops on their slots, speculative verify chunks (``batch.verify``) the step ops position by position
        on working copies with every position's state kept (:meth:`hybrid.speculative.VerifyStates.run`), the
        rest (``batch.scan``) the varlen conv and chunked delta rule from their slot's state.
        """
        qkv, z, b, a = self.split_projection(self.in_proj(u))
        w, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        os = []
        if (d := batch.decode) is not None:
            os.append(self.step(cache, qkv[d.tokens], b[d.tokens], a[d.tokens], slots=d.state_slots))
        if (vr := batch.verify) is not None:  # speculative verify chunks: states kept at every position
            os.append(batch.verify_states.run(cache, (qkv[vr.tokens], b[vr.tokens], a[vr.tokens]), self.step))
        if (p := batch.scan) is not None:
            slots, cu = p.state_slots, p.cu_seqlens
            conv_pool, rec_pool = cache["conv"], cache["recurrent"]
            qkv_p, conv_final = kernels.causal_conv1d_varlen(qkv[p.tokens], w, bias, cu,
                                                             initial_states=conv_pool.read(slots), activation="silu")
            conv_pool.write(slots, conv_final)
            q, k, v = self.split_qkv(qkv_p)
            g, beta = self.gates(b[p.tokens], a[p.tokens])
            o, rec_final = kernels.gated_delta_varlen(q, k, v, g, beta, cu, chunk_size=self.cfg.chunk_size,
                                                      initial_states=rec_pool.read(slots))
            rec_pool.write(slots, rec_final)
            os.append(o)
        o = torch.cat(os) if len(os) > 1 else os[0]
        return self._out(o, z)

    # ---- the decode program's lowering (docs/adding-a-mixer.md) ---------------------------------
    def lower_decode(self, b, norm, view) -> None:
        """Six ops: the pre-norm, in_proj, the conv step, q/k L2 norm with the gates and the delta-rule step,
        the per-head gated norm, out_proj with the residual. Head dims up to 512, float state pools."""
        conv_pool, rec_pool = b.float_pools(view, ("conv", "recurrent"))
        H, Hk, K, V = self.n_heads, self.n_k_heads, self.head_k_dim, self.head_v_dim
        if K > 512 or V > 512:
            raise b.Unsupported(f"head dims {K}x{V} (the native step takes up to 512)")
        if not b.plain(self.A_log, self.dt_bias):
            raise b.Unsupported("A_log / dt_bias parameters")
        d_model, width, conv_dim = self.in_proj.in_features, self.in_proj.out_features, self.cfg.conv_dim
        h, proj, qkv = b.buffer(d_model), b.buffer(width), b.buffer(conv_dim)
        qk, o, y = b.buffer(2 * self.key_dim), b.buffer(self.value_dim), b.buffer(self.value_dim)
        g, beta = b.buffer(H, torch.float32), b.buffer(H, torch.float32)
        b.norm(norm, b.X, h)
        b.linear(self.in_proj, h, proj)  # q | k | v | z | b | a
        b.causal_conv(self.conv1d, conv_pool, proj, width, qkv)
        b.op("GDN", state=rec_pool.data, qkv=qkv, ba=proj[:, conv_dim + self.value_dim:], A_log=self.A_log,
             dt_bias=self.dt_bias, qk=qk, g=g, beta=beta, y=o, sdt=b.code(rec_pool.data), xdt=b.dt, qkv_s=conv_dim,
             ba_s=width, adt=b.code(self.A_log), bdt=b.code(self.dt_bias), H=H, Hk=Hk, K=K, V=V,
             eps=1e-6, scale=K ** -0.5)  # kernels.gated_delta.l2norm's eps; the step's default scale
        lower_head_norm(b, self.norm, o, proj[:, conv_dim:], width, H, V, y)
        b.linear(self.out_proj, y, b.X, residual=b.X)
