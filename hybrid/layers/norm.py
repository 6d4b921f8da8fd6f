"""RMSNorm and the gated, grouped RMSNorm at the output of Mamba-2 mixers.

Both compute in fp32. The mean square comes from one fused reduction (``vector_norm``) rather than a
squared copy, and without autograd the scaling runs in place: these run on every token of every layer,
so each full pass over the activations saved is a few percent of a prefill.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, keepdim (x fp32)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    if not _in_place_ok(x):  # backward needs the norm as it was
        return torch.rsqrt(norm.square() / x.shape[-1] + eps)
    return norm.square_().div_(x.shape[-1]).add_(eps).rsqrt_()


def _in_place_ok(*tensors: torch.Tensor) -> bool:
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, computed in fp32 and cast back before the weight (as Llama does).

    ``offset=1.0``: ``(1 + weight) * x / rms(x)`` with the weight starting at 0 (Qwen3-Next, Gemma), all in fp32
    and cast back after the scale, as they compute it.
    """

    def __init__(self, dim: int, eps: float = 1e-5, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.offset:
            return (xf * _inv_rms(xf, self.eps) * (self.weight.float() + self.offset)).to(x.dtype)
        normed = (xf * _inv_rms(xf, self.eps)).to(x.dtype)
        if _in_place_ok(x, self.weight) and self.weight.dtype == normed.dtype:
            return normed.mul_(self.weight)
        return self.weight * normed

    def lower_decode(self, b, x, y) -> None:
        """The decode program's op for this norm (``b``: hybrid/decode/builder.py's builder): rows x -> y, with
        forward's rounding points. Not the zero-centred form."""
        if type(self) is not RMSNorm or self.offset:
            raise b.Unsupported(f"a {type(self).__name__}" + (f" with offset {self.offset}" if self.offset else ""))
        b.op("RMSNORM", x=x, w=self.weight, y=y, xdt=b.dt, wdt=b.code(self.weight), d=self.weight.shape[0],
             eps=self.eps)


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
        gate = F.silu(z.float())
        inplace = _in_place_ok(x, z, self.weight)
        if self.norm_before_gate:
            xf = x.float()
        else:  # the gate's fresh tensor takes the product (x * silu(z)) in place
            xf = gate.mul_(x) if inplace else gate * x.float()
        xg = xf.view(*xf.shape[:-1], self.groups, -1)
        scale = _inv_rms(xg, self.eps)
        xg = xg.mul_(scale) if inplace and xg.data_ptr() != x.data_ptr() else xg * scale
        out = xg.view(xf.shape)
        out = out.mul_(self.weight.float()) if inplace else out * self.weight.float()
        if self.norm_before_gate:
            out = out.mul_(gate) if inplace else out * gate
        return out.to(x.dtype)


def lower_head_norm(b, norm, o, z, width: int, H: int, V: int, y) -> None:
    """The decode program's per-head output norm (one [V] weight shared by the heads) of o [n, H V]:
    GatedRMSNorm(V, norm_before_gate) by silu(z) (z's rows ``width`` apart), or a plain RMSNorm(V) when z is None
    (Gated DeltaNet's and GLA's output norms)."""
    gated = z is not None
    if gated and not (type(norm) is GatedRMSNorm and norm.norm_before_gate and norm.groups == 1):
        raise b.Unsupported("an output norm other than a per-head GatedRMSNorm(norm_before_gate)")
    if not gated and not (type(norm) is RMSNorm and not norm.offset and norm.weight.dtype == b.dtype):
        raise b.Unsupported("an output norm other than a plain per-head RMSNorm in the model dtype")
    if norm.weight.shape != (V,) or not b.plain(norm.weight):
        raise b.Unsupported(f"an output norm weight of shape {tuple(norm.weight.shape)}")
    b.op("HEAD_NORM", y=o, z=z, w=norm.weight, out=y, ys=H * V, zs=width, dt=b.dt, wdt=b.code(norm.weight),
         gated=int(gated), H=H, V=V, eps=norm.eps)
