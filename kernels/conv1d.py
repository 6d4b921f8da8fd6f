"""Causal depthwise conv1d (the short conv in front of every Mamba mixer) and its one-step form.

Layouts: ``x: [B, L, C]`` (channels last, as in the model), ``weight: [C, K]``, ``bias: [C]``,
conv state ``[B, C, K-1]``: the last K-1 inputs, oldest first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import dispatch
from .packing import check_cu_seqlens, sequences, step_on_slots

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


def _causal_conv1d_step_torch(state, x, weight, bias=None, *, activation=None, slots=None):
    return step_on_slots(causal_conv1d_step_ref, state, slots, x, weight, bias, activation=activation)


def causal_conv1d_step(state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, *, activation: str | None = None,
                       slots: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of the causal conv, shifting the state in place: ``state`` [B, C, K-1], or
    with ``slots`` a pool [S, C, K-1] whose rows ``slots`` belong to the batch. x [B, C] -> y [B, C]."""
    _, fn = dispatch.choose("causal_conv1d_step", x.device.type)
    return fn(state, x, weight, bias, activation=activation, slots=slots)


def _varlen(conv, x, weight, bias, cu_seqlens, initial_states, activation):
    y = torch.empty_like(x)
    finals = []
    for b, s in sequences(cu_seqlens):
        init = None if initial_states is None else initial_states[b:b + 1]
        yb, fb = conv(x[None, s], weight, bias, initial_state=init, activation=activation)
        y[s] = yb[0]
        finals.append(fb)
    return y, torch.cat(finals)


def causal_conv1d_varlen_ref(x, weight, bias, cu_seqlens, *, initial_states=None, activation=None):
    return _varlen(causal_conv1d_ref, x, weight, bias, cu_seqlens, initial_states, activation)


def _causal_conv1d_varlen_torch(x, weight, bias, cu_seqlens, *, initial_states=None, activation=None):
    return _varlen(_causal_conv1d_torch, x, weight, bias, cu_seqlens, initial_states, activation)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         cu_seqlens: torch.Tensor, *, initial_states: torch.Tensor | None = None,
                         activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv over a packed batch: x [T, C], cu_seqlens [B+1], initial_states [B, C, K-1] or
    None. Returns (y [T, C], final_states [B, C, K-1]); no tap reaches across a sequence boundary."""
    check_cu_seqlens(cu_seqlens, x.shape[0], "causal_conv1d_varlen")
    _, fn = dispatch.choose("causal_conv1d_varlen", x.device.type)
    return fn(x, weight, bias, cu_seqlens, initial_states=initial_states, activation=activation)


dispatch.register("causal_conv1d", "torch", _causal_conv1d_torch)
dispatch.register("causal_conv1d_varlen", "torch", _causal_conv1d_varlen_torch)
dispatch.register("causal_conv1d_step", "torch", _causal_conv1d_step_torch)
