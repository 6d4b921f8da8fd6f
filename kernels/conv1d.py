"""Causal depthwise conv1d (the short conv in front of every Mamba mixer) and its one-step form.

Layouts: ``x: [B, L, C]`` (channels last, as in the model), ``weight: [C, K]``, ``bias: [C]``,
conv state ``[B, C, K-1]``: the last K-1 inputs, oldest first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import dispatch

_ACTIVATIONS = {None: lambda t: t, "silu": F.silu}


def causal_conv1d_ref(x, weight, bias=None, *, initial_state=None, activation=None):
    """Explicit sum over taps, the reference. Returns (y [B, L, C], final_state [B, C, K-1])."""
    b, L, Cn = x.shape
    K = weight.shape[1]
    prev = x.new_zeros(b, Cn, K - 1) if initial_state is None else initial_state.to(x.dtype)
    xs = torch.cat([prev, x.transpose(1, 2)], dim=-1).float()  # [B, C, K-1+L]
    y = sum(xs[:, :, k:k + L] * weight[:, k, None].float() for k in range(K))
    if bias is not None:
        y = y + bias.float()[:, None]
    y = _ACTIVATIONS[activation](y)
    return y.transpose(1, 2).to(x.dtype), xs[:, :, xs.shape[-1] - (K - 1):].to(x.dtype)


def _causal_conv1d_torch(x, weight, bias=None, *, initial_state=None, activation=None):
    b, L, Cn = x.shape
    K = weight.shape[1]
    xt = x.transpose(1, 2)
    prev = x.new_zeros(b, Cn, K - 1) if initial_state is None else initial_state.to(x.dtype)
    xs = torch.cat([prev, xt], dim=-1)
    y = F.conv1d(xs, weight[:, None, :].to(x.dtype), None if bias is None else bias.to(x.dtype), groups=Cn)
    return _ACTIVATIONS[activation](y).transpose(1, 2), xs[:, :, xs.shape[-1] - (K - 1):].contiguous()


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  initial_state: torch.Tensor | None = None,
                  activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d. x [B, L, C] -> (y [B, L, C], final conv state [B, C, K-1])."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"causal_conv1d: need x [B, L, C] and weight [C, K]; "
                         f"got {tuple(x.shape)}, {tuple(weight.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be one of {list(_ACTIVATIONS)}, got {activation!r}")
    _, fn = dispatch.choose("causal_conv1d", x.device.type)
    return fn(x, weight, bias, initial_state=initial_state, activation=activation)


def causal_conv1d_step_ref(state, x, weight, bias=None, *, activation=None):
    """One token: state [B, C, K-1] (shifted in place), x [B, C] -> y [B, C]."""
    window = torch.cat([state, x[:, :, None].to(state.dtype)], dim=-1)  # [B, C, K]
    y = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    state.copy_(window[:, :, 1:])
    return _ACTIVATIONS[activation](y).to(x.dtype)


def causal_conv1d_step(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, *, activation: str | None = None) -> torch.Tensor:
    """One decode step of the causal conv; ``state`` [B, C, K-1] is updated in place."""
    _, fn = dispatch.choose("causal_conv1d_step", x.device.type)
    return fn(state, x, weight, bias, activation=activation)


dispatch.register("causal_conv1d", "torch", _causal_conv1d_torch)
dispatch.register("causal_conv1d_step", "torch", causal_conv1d_step_ref)
