"""``linear``: ``x @ weight.T + bias (+ residual)``, the projection op of every layer.

For the few input rows of a decode step the product is a matrix-vector product whose cost is reading the
weight matrix once: torch's CPU GEMV reached 21.7 GB/s on a machine whose cores stream 57 GB/s, and each of its
calls is a fork/join of OpenMP threads. The ``native`` backend (:mod:`.native`, ``decode.c``) streams the
weights at the read bandwidth with its own pool, for fp32, bf16 and int8-with-row-scales weights, and adds the
bias and the sub-layer's residual in the same pass. Everything else — autograd, many rows (prefill, where
oneDNN's GEMM is compute-bound and fast), other devices, quantized weight subclasses — takes ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import dispatch, native


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The reference, in fp32: x [..., K], weight [N, K] (int8 codes times ``scale`` [N] when given),
    bias [N], residual [..., N] -> [..., N] in x's dtype."""
    w = weight.float() if scale is None else weight.float() * scale.float()[:, None]
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def _linear_torch(x, weight, bias=None, residual=None, scale=None):
    if scale is not None:
        weight = weight.to(x.dtype) * scale.to(x.dtype)[:, None]
    y = F.linear(x, weight, bias)
    return y if residual is None else y + residual


def _native_supports(x, weight, bias=None, residual=None, scale=None) -> str | None:
    """a few contiguous fp32/bf16 rows, a plain fp32/bf16/int8 weight, no autograd"""
    if x.device.type != "cpu":
        return "not on the CPU"
    if torch.compiler.is_compiling():
        return "compiling"
    if type(weight) is not torch.Tensor and type(weight) is not torch.nn.Parameter:
        return f"weight is a {type(weight).__name__}"
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return "autograd"
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= native.MAX_ROWS:
        return f"{rows} rows (the native product takes 1..{native.MAX_ROWS})"
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype not in native.DTYPE_CODES:
        return f"dtypes {x.dtype} x {weight.dtype}"
    if (weight.dtype == torch.int8) != (scale is not None):
        return "int8 weights need their row scales"
    if not (x.is_contiguous() and weight.is_contiguous()):
        return "not contiguous"
    if residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous()):
        return "residual of another dtype or layout"
    if bias is not None and (bias.dtype not in (torch.float32, torch.bfloat16) or not bias.is_contiguous()):
        return "bias dtype"
    return None


def _linear_native(x, weight, bias=None, residual=None, scale=None):
    lib = native.library()
    N, K = weight.shape
    rows = x.numel() // K
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype)
    codes = native.DTYPE_CODES
    lib.hl_gemv(weight.data_ptr(), codes[weight.dtype], scale.data_ptr() if scale is not None else None,
                bias.data_ptr() if bias is not None else None, codes[bias.dtype] if bias is not None else -1,
                x.data_ptr(), codes[x.dtype], residual.data_ptr() if residual is not None else None,
                y.data_ptr(), codes[x.dtype], rows, N, K)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias [N] + residual [..., N] -> [..., N] in x's dtype. ``scale`` [N]
    (fp32): the weight is int8 codes, row n worth ``weight[n] * scale[n]``."""
    _, fn = dispatch.choose("linear", x.device.type)
    return fn(x, weight, bias, residual, scale)


dispatch.register("linear", "torch", _linear_torch)
dispatch.register("linear", "native", _linear_native, native.available, _native_supports)
