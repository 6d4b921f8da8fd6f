"""The native library's matrix products as ``torch.library`` ops (``torch.ops.hybrid.linear``, ``linear_int4``,
``linear_q``), as kernels/native/ops.py makes the state steps: per op one ``check_*`` (shapes, dtypes, devices,
layouts; a one-line error naming the argument), a CPU implementation that checks and then makes the ctypes call,
and a fake implementation for torch.compile / torch.export. The decode step's products: a few rows (1..64) against
a weight streamed once. kernels/projection.py's dispatch decides which calls come here (its ``*_supports``) and
holds the references (``linear_ref``, ``linear_int8dq_ref``, ``linear_8da4w_ref``)."""

from __future__ import annotations

import torch

from . import DTYPE_CODES, MAX_ROWS, library
from .arguments import FLOATS, bad, contiguous, off_cpu, shape
from .ops import _define, _ptr

_WEIGHTS = (torch.float32, torch.bfloat16, torch.int8)
QK_I8DQ, QK_8DA4W = 0, 1  # int8_activation.c's kinds (kernels.projection names them too)


def _rows_and_epilogue(op: str, x, N: int, bias, residual) -> str | None:
    """x [..., K] contiguous fp32/bf16 with 1..MAX_ROWS rows; bias [N] fp32/bf16; residual [..., N] in x's dtype."""
    why = off_cpu(op, "x bias residual", x, bias, residual)
    if why:
        return why
    if x.dim() < 1 or x.shape[-1] < 1:
        return bad(op, "x", shape(x), "[..., K] with K >= 1")
    rows = x.numel() // x.shape[-1]
    if not 0 < rows <= MAX_ROWS:
        return bad(op, "x", f"has {rows} rows", f"1..{MAX_ROWS} (a decode step's rows; more go through a GEMM)")
    why = contiguous(op, "x", x, tuple(x.shape)) or (bias is not None and contiguous(op, "bias", bias, (N,))) \
        or (residual is not None and contiguous(op, "residual", residual, (*x.shape[:-1], N), (x.dtype,)))
    return why or None


def _out(x, N: int):
    return torch.empty(*x.shape[:-1], N, dtype=x.dtype)


def _out_fake(x, N: int):
    return x.new_empty(*x.shape[:-1], N)


# ---- fp32 / bf16 / int8 weights (amx.c / gemv.c) ------------------------------------------------------------------

def check_linear(x, weight, bias=None, residual=None, scale=None) -> str | None:
    op = "linear"
    if weight.dim() != 2:
        return bad(op, "weight", shape(weight), "[N, K]")
    N, K = weight.shape
    why = off_cpu(op, "weight scale", weight, scale) or _rows_and_epilogue(op, x, N, bias, residual) \
        or (x.shape[-1] != K and bad(op, "x", shape(x), f"[..., {K}] (the weight's K)")) \
        or contiguous(op, "weight", weight, (N, K), _WEIGHTS)
    if why:
        return why
    if weight.dtype == torch.int8 and scale is None:
        return bad(op, "scale", "is None for int8 weight codes", "the fp32 row scales [N]")
    if weight.dtype != torch.int8 and scale is not None:
        return bad(op, "scale", f"is given for a {weight.dtype} weight", "None (row scales are for int8 codes)")
    return (scale is not None and contiguous(op, "scale", scale, (N,), (torch.float32,))) or None


def _linear_kernel(x, weight, bias=None, residual=None, scale=None):
    N, K = weight.shape
    y = _out(x, N)
    rc = library().hl_gemv(weight.data_ptr(), DTYPE_CODES[weight.dtype], _ptr(scale), _ptr(bias),
                           -1 if bias is None else DTYPE_CODES[bias.dtype], x.data_ptr(), DTYPE_CODES[x.dtype],
                           _ptr(residual), y.data_ptr(), DTYPE_CODES[x.dtype], x.numel() // K, N, K)
    if rc:
        raise RuntimeError(f"hl_gemv refused N={N} K={K} (a bug: check_linear passed it)")
    return y


def _linear_fake(x, weight, bias=None, residual=None, scale=None):
    return _out_fake(x, weight.shape[0])


_define("linear", "(Tensor x, Tensor weight, Tensor? bias=None, Tensor? residual=None, Tensor? scale=None) -> Tensor",
        check_linear, _linear_kernel, _linear_fake)


# ---- int4 weight-only, aten's int4pack layout (int4.c) ------------------------------------------------------------

INT4_BLOCKS = (32, 64)  # the int4pack row blocks int4.c reads (aten's AVX2 and AVX512 layouts)


def check_linear_int4(x, qdata, scale_and_zero, group, bias=None, residual=None, block=64) -> str | None:
    op = "linear_int4"
    if qdata.dim() != 2:
        return bad(op, "qdata", shape(qdata), "[N, K / 2] uint8 (two int4 codes a byte)")
    N = qdata.shape[0]
    why = off_cpu(op, "qdata scale_and_zero", qdata, scale_and_zero) or _rows_and_epilogue(op, x, N, bias, residual)
    if why:
        return why
    K = x.shape[-1]
    if group < 2 or group > 1024 or group % 2 or K % group:
        return bad(op, "group", f"is {group}", f"an even group size of 2..1024 dividing K={K}")
    if N % 16:
        return bad(op, "qdata", shape(qdata), "N a multiple of 16")
    if block not in INT4_BLOCKS:
        return bad(op, "block", f"is {block}", f"one of {INT4_BLOCKS} (aten's AVX2 / AVX512 int4pack layouts)")
    return contiguous(op, "qdata", qdata, (N, K // 2), (torch.uint8,)) \
        or contiguous(op, "scale_and_zero", scale_and_zero, (K // group, N, 2), FLOATS) or None


def _linear_int4_kernel(x, qdata, scale_and_zero, group, bias=None, residual=None, block=64):
    N, K = qdata.shape[0], x.shape[-1]
    y = _out(x, N)
    rc = library().hl_gemv_int4(qdata.data_ptr(), scale_and_zero.data_ptr(), DTYPE_CODES[scale_and_zero.dtype], group,
                                _ptr(bias), -1 if bias is None else DTYPE_CODES[bias.dtype], x.data_ptr(),
                                DTYPE_CODES[x.dtype], _ptr(residual), y.data_ptr(), DTYPE_CODES[x.dtype],
                                x.numel() // K, N, K, block)
    if rc:
        raise RuntimeError(f"hl_gemv_int4 refused N={N} K={K} group {group} (a bug: check_linear_int4 passed it)")
    return y


def _linear_int4_fake(x, qdata, scale_and_zero, group, bias=None, residual=None, block=64):
    return _out_fake(x, qdata.shape[0])


_define("linear_int4", "(Tensor x, Tensor qdata, Tensor scale_and_zero, int group, Tensor? bias=None, "
        "Tensor? residual=None, int block=64) -> Tensor", check_linear_int4, _linear_int4_kernel, _linear_int4_fake)


# ---- int8 activations: int8dq and 8da4w (int8_activation.c) -------------------------------------------------------

def check_linear_q(x, kind, w, ws, bias=None, residual=None) -> str | None:
    op = "linear_q"
    if kind not in (QK_I8DQ, QK_8DA4W):
        return bad(op, "kind", f"is {kind}", f"{QK_I8DQ} (int8dq) or {QK_8DA4W} (8da4w)")
    if w.dim() != 2:
        return bad(op, "w", shape(w), "[N, K] int8 codes or [N, K / 2] 8da4w nibbles")
    N = w.shape[0]
    why = off_cpu(op, "w ws", w, ws) or _rows_and_epilogue(op, x, N, bias, residual)
    if why:
        return why
    K = x.shape[-1]
    if kind == QK_I8DQ:
        return contiguous(op, "w", w, (N, K), (torch.int8,)) or contiguous(op, "ws", ws, (N,), (torch.float32,)) \
            or None
    if K % 32:
        return bad(op, "x", shape(x), "K a multiple of 32 (8da4w's groups)")
    return contiguous(op, "w", w, (N, K // 2), (torch.uint8,)) \
        or contiguous(op, "ws", ws, (N * (K // 32) + N,), (torch.float32,)) or None


def _linear_q_kernel(x, kind, w, ws, bias=None, residual=None):
    N, K = w.shape[0], x.shape[-1]
    y = _out(x, N)
    rc = library().hl_gemv_q(kind, w.data_ptr(), ws.data_ptr(), _ptr(bias),
                             -1 if bias is None else DTYPE_CODES[bias.dtype], x.data_ptr(), DTYPE_CODES[x.dtype],
                             _ptr(residual), y.data_ptr(), DTYPE_CODES[x.dtype], x.numel() // K, N, K)
    if rc:
        raise RuntimeError(f"hl_gemv_q refused kind {kind} N={N} K={K} (a bug: check_linear_q passed it)")
    return y


def _linear_q_fake(x, kind, w, ws, bias=None, residual=None):
    return _out_fake(x, w.shape[0])


_define("linear_q", "(Tensor x, int kind, Tensor w, Tensor ws, Tensor? bias=None, Tensor? residual=None) -> Tensor",
        check_linear_q, _linear_q_kernel, _linear_q_fake)

# the kernels alone, for kernels/projection.py's dispatch once its supports (which end in check_*) passed
linear_after_check = _linear_kernel
linear_int4_after_check = _linear_int4_kernel
linear_q_after_check = _linear_q_kernel
