"""Mamba-1 mixer (``m``): in-projection to (x, z), causal conv, input-dependent (dt, B, C),
selective scan, gating, out-projection. Names follow mamba_ssm's ``Mamba``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..cache.specs import CacheDtypes, MambaStateSpec, state_scale_groups
from ..config import HybridConfig, Mamba1Config
from .linear import Linear
from .mamba2 import init_dt_bias
from .norm import RMSNorm


class Mamba1(nn.Module):
    kind = "mamba1"

    @classmethod
    def from_config(cls, cfg: HybridConfig) -> Mamba1:
        return cls(cfg.d_model, cfg.mamba1, cfg.norm_eps)

    @staticmethod
    def cache_spec(cfg: HybridConfig, dtypes: CacheDtypes) -> MambaStateSpec:
        m = cfg.mamba1
        # no heads: one scale per 16 channels (a Mamba-2 head's worth of rows, in elements, is far more)
        groups = state_scale_groups(m.d_inner, m.d_inner // 16)
        return MambaStateSpec(conv_shape=(m.d_inner, m.d_conv - 1), ssm_shape=(m.d_inner, m.d_state),
                              conv_dtype=dtypes.conv, ssm_dtype=dtypes.ssm, conv_groups=groups, ssm_groups=groups)

    @staticmethod
    def flops_per_token(cfg: HybridConfig, seq_len: int) -> float:
        """FLOPs of one token beyond the projections: the selective scan (~6 per state element) and the conv."""
        m = cfg.mamba1
        return 6.0 * m.d_inner * m.d_state + 2.0 * m.d_conv * m.d_inner

    def __init__(self, d_model: int, cfg: Mamba1Config, norm_eps: float = 1e-5):
        super().__init__()
        self.cfg = cfg
        self.d_inner, self.d_state, self.dt_rank = cfg.d_inner, cfg.d_state, cfg.dt_rank
        self.in_proj = Linear(d_model, 2 * cfg.d_inner, bias=cfg.proj_bias)
        self.conv1d = nn.Conv1d(cfg.d_inner, cfg.d_inner, cfg.d_conv, groups=cfg.d_inner, bias=cfg.conv_bias)
        self.x_proj = Linear(cfg.d_inner, cfg.dt_rank + 2 * cfg.d_state, bias=False)
        self.dt_proj = Linear(cfg.dt_rank, cfg.d_inner, bias=True)
        self.A_log = nn.Parameter(torch.empty(cfg.d_inner, cfg.d_state))
        self.D = nn.Parameter(torch.ones(cfg.d_inner))
        self.out_proj = Linear(cfg.d_inner, d_model, bias=cfg.proj_bias)
        if cfg.inner_norms:
            self.dt_norm = RMSNorm(cfg.dt_rank, norm_eps)
            self.B_norm = RMSNorm(cfg.d_state, norm_eps)
            self.C_norm = RMSNorm(cfg.d_state, norm_eps)
        self.reset_special_parameters()

    def reset_special_parameters(self, std: float | None = None) -> None:
        # std (the model's init scale) is not used: dt, A and D have their own inits (as in Mamba2)
        c = self.cfg
        with torch.no_grad():
            std = c.dt_rank ** -0.5
            self.dt_proj.weight.uniform_(-std, std)
            self.dt_proj.bias.copy_(init_dt_bias(c.d_inner, c.dt_min, c.dt_max, c.dt_init_floor))
            # S4D-real init: A[d, n] = -(n + 1)
            self.A_log.copy_(torch.log(torch.arange(1, c.d_state + 1, dtype=torch.float32)).repeat(c.d_inner, 1))
            self.D.fill_(1.0)
            self.conv1d.reset_parameters()
            for name in ("dt_norm", "B_norm", "C_norm"):
                if hasattr(self, name):
                    getattr(self, name).weight.fill_(1.0)

    def dt_B_C(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-conv x [..., d_inner] -> positive dt [..., d_inner] (fp32), B, C [..., d_state]."""
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.cfg.inner_norms:
            dt, B, C = self.dt_norm(dt), self.B_norm(B), self.C_norm(C)
        dt = F.softplus((dt @ self.dt_proj.weight.t()).float() + self.dt_proj.bias.float())
        return dt, B, C

    def A(self) -> torch.Tensor:
        return -torch.exp(self.A_log.float())

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        x, z = self.in_proj(u).chunk(2, dim=-1)
        x, _ = kernels.causal_conv1d(x, self.conv1d.weight[:, 0], self.conv1d.bias, activation="silu")
        dt, B, C = self.dt_B_C(x)
        y, _ = kernels.selective_scan(x, dt, self.A(), B, C, D=self.D)
        return self.out_proj(y * F.silu(z))

    def step(self, state, x: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence through the conv and selective-scan step ops, updating the states of ``state``
        (a :class:`hybrid.cache.views.StateCacheView`: rows ``slots`` of the cache, or working copies) in
        place: x [n, d_inner] -> y [n, d_inner]."""
        x = state["conv"].step(kernels.causal_conv1d_step, x, self.conv1d.weight[:, 0], self.conv1d.bias,
                               activation="silu", slots=slots)
        dt, B, C = self.dt_B_C(x)
        return state["ssm"].step(kernels.selective_step, x, dt, self.A(), B, C, D=self.D, slots=slots)

    def forward_packed(self, u: torch.Tensor, batch, cache) -> torch.Tensor:
        """Packed inference: u [T, d_model] of a :class:`hybrid.engine.packed_batch.PackedBatch` -> [T, d_model];
        states in the sequences' rows of ``cache`` (this layer's :class:`hybrid.cache.views.StateCacheView`;
        step ops for ``batch.decode``, step ops with every position's state kept for ``batch.verify``, varlen
        scans for ``batch.scan``), as in :meth:`Mamba2.forward_packed`."""
        x, z = self.in_proj(u).chunk(2, dim=-1)
        w, bias = self.conv1d.weight[:, 0], self.conv1d.bias
        ys = []
        if (d := batch.decode) is not None:
            ys.append(self.step(cache, x[d.tokens], slots=d.state_slots))
        if (v := batch.verify) is not None:  # speculative verify chunks: states kept at every position
            ys.append(batch.verify_states.run(cache, (x[v.tokens],), self.step))
        if (p := batch.scan) is not None:
            slots, cu = p.state_slots, p.cu_seqlens
            conv_pool, ssm_pool = cache["conv"], cache["ssm"]
            xp, conv_final = kernels.causal_conv1d_varlen(x[p.tokens], w, bias, cu,
                                                          initial_states=conv_pool.read(slots), activation="silu")
            conv_pool.write(slots, conv_final)
            dt, B, C = self.dt_B_C(xp)
            y, ssm_final = kernels.selective_varlen_scan(xp, dt, self.A(), B, C, cu, D=self.D,
                                                         initial_states=ssm_pool.read(slots))
            ssm_pool.write(slots, ssm_final)
            ys.append(y)
        y = torch.cat(ys) if len(ys) > 1 else ys[0]
        return self.out_proj(y * F.silu(z))
