"""Mamba-2 mixer (``M``): in-projection, causal depthwise conv, SSD, gated RMSNorm, out-projection.

Parameter names and layouts follow mamba_ssm's ``Mamba2`` (in_proj packs ``[z, x, B, C, dt]``),
so checkpoints map over without reshuffling.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..cache.specs import CacheDtypes, MambaStateSpec, state_scale_groups
from ..config import HybridConfig, Mamba2Config
from ..kernels import mamba2_verify
from .linear import Linear
from .norm import GatedRMSNorm


def init_dt_bias(n: int, dt_min: float, dt_max: float, floor: float) -> torch.Tensor:
    """dt log-uniform in [dt_min, dt_max], stored as its inverse softplus (mamba_ssm's init)."""
    dt = torch.exp(torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


class Mamba2(nn.Module):
    kind = "mamba2"

    @classmethod
    def from_config(cls, cfg: HybridConfig) -> Mamba2:
        return cls(cfg.d_model, cfg.mamba2, cfg.norm_eps)

    @staticmethod
    def cache_spec(cfg: HybridConfig, dtypes: CacheDtypes) -> MambaStateSpec:
        m = cfg.mamba2
        return MambaStateSpec(conv_shape=(m.conv_dim, m.d_conv - 1), ssm_shape=(m.n_heads, m.head_dim, m.d_state),
                              conv_dtype=dtypes.conv, ssm_dtype=dtypes.ssm,
                              # int8: one scale per head and head_dim row of the SSM state (per head alone
                              # measured 3x the logit KL, eval/compression_bench.py), per head of the conv state
                              conv_groups=state_scale_groups(m.conv_dim, m.n_heads), ssm_groups=m.n_heads * m.head_dim)

    @staticmethod
    def flops_per_token(cfg: HybridConfig, seq_len: int) -> float:
        """FLOPs of one token beyond the projections: the SSM recurrence (~6 per state element) and the conv."""
        m = cfg.mamba2
        return 6.0 * m.d_inner * m.d_state + 2.0 * m.d_conv * m.conv_dim

    def __init__(self, d_model: int, cfg: Mamba2Config, norm_eps: float = 1e-5):
        super().__init__()
        self.cfg = cfg
        self.d_inner, self.n_heads, self.head_dim = cfg.d_inner, cfg.n_heads, cfg.head_dim
        self.n_groups, self.d_state = cfg.n_groups, cfg.d_state
        self.in_proj = Linear(d_model, 2 * cfg.d_inner + 2 * cfg.n_groups * cfg.d_state + cfg.n_heads,
                                 bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim, bias=cfg.conv_bias)
        self.dt_bias = nn.Parameter(init_dt_bias(cfg.n_heads, cfg.dt_min, cfg.dt_max, cfg.dt_init_floor))
        lo, hi = cfg.A_init_range
        self.A_log = nn.Parameter(torch.log(torch.empty(cfg.n_heads).uniform_(lo, hi)))
        self.D = nn.Parameter(torch.ones(cfg.n_heads))
        self.norm = GatedRMSNorm(cfg.d_inner, eps=norm_eps, groups=cfg.norm_groups,
                                 norm_before_gate=cfg.norm_before_gate)
        self.out_proj = Linear(cfg.d_inner, d_model, bias=cfg.proj_bias)

    def reset_special_parameters(self, std: float | None = None) -> None:
        """Re-draw the SSM parameters after a model-wide init has overwritten them (``std``, the
        model's init scale, is not used: dt, A and D have their own inits)."""
        c = self.cfg
        with torch.no_grad():
            self.dt_bias.copy_(init_dt_bias(c.n_heads, c.dt_min, c.dt_max, c.dt_init_floor))
            self.A_log.copy_(torch.log(torch.empty(c.n_heads).uniform_(*c.A_init_range)))
            self.D.fill_(1.0)
            self.conv1d.reset_parameters()

    def split_projection(self, zxbcdt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> z [..., d_inner], xBC [..., conv_dim], raw dt [..., H]."""
        return zxbcdt.split([self.d_inner, self.cfg.conv_dim, self.n_heads], dim=-1)

    def dt_A(self, dt_raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positive, clamped dt (fp32) and the negative decay rates A [H]."""
        dt = F.softplus(dt_raw.float() + self.dt_bias.float())
        lo, hi = self.cfg.dt_limit
        if lo > 0.0 or hi != math.inf:
            dt = dt.clamp(lo, hi)
        return dt, -torch.exp(self.A_log.float())

    def split_xBC(self, xBC: torch.Tensor):
        """xBC [..., conv_dim] -> x [..., H, P], B [..., G, N], C [..., G, N]."""
        gn = self.n_groups * self.d_state
        x, B, C = xBC.split([self.d_inner, gn, gn], dim=-1)
        lead = xBC.shape[:-1]
        return (x.reshape(*lead, self.n_heads, self.head_dim), B.reshape(*lead, self.n_groups, self.d_state),
                C.reshape(*lead, self.n_groups, self.d_state))

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        Bsz, L, _ = u.shape
        z, xBC, dt_raw = self.split_projection(self.in_proj(u))
        xBC, _ = kernels.causal_conv1d(xBC, self.conv1d.weight[:, 0], self.conv1d.bias, activation="silu")
        x, B, C = self.split_xBC(xBC)
        dt, A = self.dt_A(dt_raw)
        y, _ = kernels.ssd_chunk_scan(x, dt, A, B, C, chunk_size=self.cfg.chunk_size, D=self.D)
        y = self.norm(y.reshape(Bsz, L, self.d_inner), z)
        return self.out_proj(y)

    def step(self, state, xBC: torch.Tensor, dt_raw: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence through the conv and SSD step ops, updating the states of ``state`` (a
        :class:`hybrid.cache.views.StateCacheView`: rows ``slots`` of the cache, or working copies) in place:
        xBC [n, conv_dim], dt_raw [n, H] -> y [n, H, P]."""
        xBC = state["conv"].step(kernels.causal_conv1d_step, xBC, self.conv1d.weight[:, 0], self.conv1d.bias,
                                 activation="silu", slots=slots)
        x, B, C = self.split_xBC(xBC)
        dt, A = self.dt_A(dt_raw)
        return state["ssm"].step(kernels.ssd_step, x, dt, A, B, C, D=self.D, slots=slots)

    def verify_chunk(self, conv0: torch.Tensor, ssm0: torch.Tensor, xBC: torch.Tensor, dt_raw: torch.Tensor):
        """Speculative verify chunks, padded to one length, in closed form from their states conv0 [n, C, K-1],
        ssm0 [n, H, P, N]: xBC [n, L, conv_dim], dt_raw [n, L, H] -> (y [n, L, H, P], conv states
        [L, n, C, K-1], SSM states [L, n, H, P, N]: the states after each position)."""
        xBC, conv_hist = mamba2_verify.conv_states(conv0, xBC, self.conv1d.weight[:, 0], self.conv1d.bias)
        x, B, C = self.split_xBC(xBC)
        dt, A = self.dt_A(dt_raw)
        y, ssm_hist = mamba2_verify.ssd_states(ssm0, x, dt, A, B, C, self.D)
        return y.to(dt_raw.dtype), conv_hist.to(conv0.dtype), ssm_hist.to(ssm0.dtype)

    def forward_packed(self, u: torch.Tensor, batch, cache) -> torch.Tensor:
        """Packed inference: u [T, d_model] of a :class:`hybrid.engine.packed_batch.PackedBatch` -> [T, d_model].

        ``cache`` is this layer's :class:`hybrid.cache.views.StateCacheView` (states ``conv`` and ``ssm``, read
        and written in the compute dtype whatever the storage). Each sequence starts from and leaves its state
        in its rows (``state_slots``): the one-token sequences (``batch.decode``) take the O(1) step ops,
        speculative verify chunks (``batch.verify``) a closed form that keeps every position's state aside
        (:mod:`hybrid.speculative`), the rest (``batch.scan``) run the varlen conv and SSD scan from their
        slot's state (zero for a fresh sequence).
        """
        z, xBC, dt_raw = self.split_projection(self.in_proj(u))
        w, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        ys = []
        if (d := batch.decode) is not None:
            ys.append(self.step(cache, xBC[d.tokens], dt_raw[d.tokens], slots=d.state_slots))
        if (v := batch.verify) is not None:  # speculative verify chunks: states kept at every position
            ys.append(batch.verify_states.run_chunk(cache, (xBC[v.tokens], dt_raw[v.tokens]), self.verify_chunk))
        if (p := batch.scan) is not None:
            slots, cu = p.state_slots, p.cu_seqlens
            conv_pool, ssm_pool = cache["conv"], cache["ssm"]
            xBC_p, conv_final = kernels.causal_conv1d_varlen(xBC[p.tokens], w, bias, cu,
                                                             initial_states=conv_pool.read(slots), activation="silu")
            conv_pool.write(slots, conv_final)
            x, B, C = self.split_xBC(xBC_p)
            dt, A = self.dt_A(dt_raw[p.tokens])
            y, ssm_final = kernels.ssd_varlen_scan(x, dt, A, B, C, cu, chunk_size=self.cfg.chunk_size, D=self.D,
                                                   initial_states=ssm_pool.read(slots))
            ssm_pool.write(slots, ssm_final)
            ys.append(y)
        y = torch.cat(ys) if len(ys) > 1 else ys[0]
        return self.out_proj(self.norm(y.reshape(u.shape[0], self.d_inner), z))

    # ---- the decode program's lowering (docs/adding-a-mixer.md) ---------------------------------
    def lower_decode(self, b, norm, view) -> None:
        """Seven ops: the pre-norm, in_proj, the conv step (SiLU), dt / A, the SSD state step, the gated norm,
        out_proj with the residual. Plain float state pools only."""
        conv_pool, ssm_pool = b.float_pools(view, ("conv", "ssm"))
        if not isinstance(self.norm, GatedRMSNorm) or self.d_inner // self.norm.groups > 8192 or self.d_state > 512 \
                or self.n_heads % self.n_groups:
            raise b.Unsupported("the gated norm or state layout")
        conv_w = self.conv1d.weight[:, 0]
        if not b.plain(conv_w, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight):
            raise b.Unsupported("conv / dt / A / D parameters")
        d_model = self.in_proj.weight.shape[1]
        width, conv_dim = self.in_proj.weight.shape[0], self.cfg.conv_dim
        H, gn = self.n_heads, self.n_groups * self.d_state
        h, zxbcdt, xbc = b.buffer(d_model), b.buffer(width), b.buffer(conv_dim)
        dt_out, A = b.buffer(H, torch.float32), b.buffer(H, torch.float32)
        y, g = b.buffer(self.d_inner), b.buffer(self.d_inner)
        b.norm(norm, b.X, h)
        b.linear(self.in_proj, h, zxbcdt)
        b.causal_conv(self.conv1d, conv_pool, zxbcdt[:, self.d_inner:], width, xbc)  # z | xBC | dt, row stride width
        lo, hi = self.cfg.dt_limit
        clamp = lo > 0.0 or hi != float("inf")
        b.op("DT", dt_raw=zxbcdt[:, self.d_inner + conv_dim:], dt_bias=self.dt_bias, A_log=self.A_log, dt_out=dt_out,
             A_out=A, xdt=b.dt, dts=width, bdt=b.code(self.dt_bias), adt=b.code(self.A_log), clamp=int(clamp), H=H,
             lo=lo, hi=min(hi, 3.0e38))
        b.op("SSD", state=ssm_pool.data, x=xbc, dt=dt_out, A=A, B=xbc[:, self.d_inner:], C=xbc[:, self.d_inner + gn:],
             Dp=self.D, y=y, sdt=b.code(ssm_pool.data), xdt=b.dt, xs=conv_dim, dts=H, bs=conv_dim, cs=conv_dim,
             ddt=b.code(self.D), H=H, P=self.head_dim, N=self.d_state, G=self.n_groups)
        b.op("GATED_RMSNORM", y=y, z=zxbcdt, w=self.norm.weight, out=g, zs=width, dt=b.dt,
             wdt=b.code(self.norm.weight), groups=self.norm.groups, norm_before_gate=int(self.norm.norm_before_gate),
             d=self.d_inner, eps=self.norm.eps)
        b.linear(self.out_proj, g, b.X, residual=b.X)
