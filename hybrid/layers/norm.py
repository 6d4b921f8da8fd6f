"""RMSNorm and the gated, grouped RMSNorm at the output of Mamba-2 mixers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in fp32 and cast back before the weight (as Llama does)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm over ``groups`` equal slices of the last dim, gated by ``silu(z)``.

    ``norm_before_gate=False`` (mamba_ssm's Mamba-2 default): ``norm(x * silu(z))``;
    ``True``: ``norm(x) * silu(z)``.
    """

    def __init__(self, dim: int, eps: float = 1e-5, groups: int = 1, norm_before_gate: bool = False):
        super().__init__()
        self.eps, self.groups, self.norm_before_gate = eps, groups, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        gate = F.silu(z.float())
        if not self.norm_before_gate:
            xf = xf * gate
        xg = xf.view(*xf.shape[:-1], self.groups, -1)
        xg = xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + self.eps)
        xf = xg.view_as(xf) * self.weight.float()
        if self.norm_before_gate:
            xf = xf * gate
        return xf.to(x.dtype)
