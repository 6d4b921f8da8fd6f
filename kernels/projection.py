"""``linear``: ``x @ weight.T + bias (+ residual)``, the projection op of every layer.

For the few input rows of a decode step the product is a matrix-vector product whose cost is reading the
weight matrix once: torch's CPU GEMV reached 21.7 GB/s on a machine whose cores stream 57 GB/s, and each of its
calls is a fork/join of OpenMP threads. The ``native`` backend (:mod:`.native`, ``decode.c``) streams the
weights at the read bandwidth with its own pool, for fp32, bf16 and int8-with-row-scales weights, and adds the
bias and the sub-layer's residual in the same pass; ``linear_int4`` does the same for torchao's CPU int4
weight-only codes. Everything else — autograd, many rows (prefill, where
oneDNN's GEMM is compute-bound and fast), other devices, quantized weight subclasses — takes ``F.linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import dispatch, native
from .native import products as _native_products  # defines torch.ops.hybrid.linear*


def _epilogue_refusal(x, bias, residual) -> str | None:
    """Why the native product cannot add this bias or residual in its epilogue (None: it can)."""
    if residual is not None and (residual.dtype != x.dtype or not residual.is_contiguous()):
        return "residual of another dtype or layout"
    if bias is not None and (bias.dtype not in (torch.float32, torch.bfloat16) or not bias.is_contiguous()):
        return "bias dtype"
    return None


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
    return _epilogue_refusal(x, bias, residual) or _native_products.check_linear(x, weight, bias, residual, scale)


def _linear_native(x, weight, bias=None, residual=None, scale=None):
    return torch.ops.hybrid.linear.default(x, weight, bias, residual, scale)  # kernels/native/products.py


_linear_native.after_supports = _native_products.linear_after_check  # _native_supports ran check_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias [N] + residual [..., N] -> [..., N] in x's dtype. ``scale`` [N]
    (fp32): the weight is int8 codes, row n worth ``weight[n] * scale[n]``."""
    _, fn = dispatch.choose("linear", x.device.type)
    return fn(x, weight, bias, residual, scale)


dispatch.register("linear", "torch", _linear_torch)
dispatch.register("linear", "native", _linear_native, native.available, _native_supports)


# ---- int4 weight-only (torchao's CPU Int4OpaqueTensor: aten's int4pack layout, docs/notes/int4-cpu-layout.md) ----

@functools.cache
def int4pack_block() -> int:
    """Rows per block of aten's CPU int4pack layout on this machine: aten packs for the CPU capability it was
    dispatched to, 32-row blocks on AVX2 and 64-row blocks on AVX512 (measured: docs/notes/int4-cpu-layout.md).
    Found by packing a one-hot matrix: row 32's code lands in byte 0's high nibble only with 64-row blocks."""
    w = torch.zeros(64, 2, dtype=torch.int32)
    w[32, 0] = 1
    q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1).contiguous().view(-1)
    return 64 if int(q[0]) == 16 else 32


INT4_BLOCKS = _native_products.INT4_BLOCKS  # the int4pack block sizes the native product reads (one definition)


def int4_codes(qdata: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The codes (int32 [N, K], 0..15) that int4pack bytes ``qdata`` (uint8 [N, K/2] in aten's layout: blocks of BN =
    ``block`` rows (32 or 64; default :func:`int4pack_block`, this machine's), K-major; the BN/2 bytes of block nb
    at input k hold rows nb*BN + i in the low nibble and nb*BN + BN/2 + i in the high one; the last N % BN rows hold
    (N % BN)/2 bytes per k, rows 2j low and 2j + 1 high) hold."""
    N, K = qdata.shape[0], qdata.shape[1] * 2
    BN = int4pack_block() if block is None else block
    flat = qdata.contiguous().view(-1).to(torch.int32)
    full, tail_rows = N // BN, N % BN
    q = torch.empty(N, K, dtype=torch.int32)
    body = flat[:full * BN // 2 * K].view(full, K, BN // 2)
    q[:full * BN] = torch.cat([body & 15, body >> 4], 2).permute(0, 2, 1).reshape(full * BN, K)
    if tail_rows:
        tail = flat[full * BN // 2 * K:].view(K, tail_rows // 2)
        q[full * BN:] = torch.stack([tail & 15, tail >> 4], 2).reshape(K, tail_rows).t()
    return q


def int4_dequantize(qdata: torch.Tensor, scale_and_zero: torch.Tensor, group: int,
                    block: int | None = None) -> torch.Tensor:
    """The fp32 weight [N, K] that int4pack codes ``qdata`` (:func:`int4_codes`, in ``block``-row blocks, default
    this machine's) and ``scale_and_zero`` ([K/group, N, 2]) stand for: (q - 8) * scale + zero."""
    q = int4_codes(qdata, block)
    scale = scale_and_zero[..., 0].float().t().repeat_interleave(group, 1)
    zero = scale_and_zero[..., 1].float().t().repeat_interleave(group, 1)
    return (q.float() - 8.0) * scale + zero


def int4_pack(codes: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """The int4pack bytes (uint8 [N, K/2]) of ``codes`` (integers 0..15 [N, K], N a multiple of 16, K even) in the
    layout of ``block``-row blocks (32: aten's AVX2 packing, 64: its AVX512 one; default :func:`int4pack_block`),
    written from the layout's formula (:func:`int4_codes` reads it back), so either layout can be made on any
    CPU; aten's ``_convert_weight_to_int4pack_for_cpu`` makes only the one of the CPU it runs on."""
    BN = int4pack_block() if block is None else block
    N, K = codes.shape
    if BN not in INT4_BLOCKS or N % 16 or K % 2:
        raise ValueError(f"int4pack of [{N}, {K}] codes in {BN}-row blocks")
    c = codes.to(torch.uint8)
    full, tail_rows = N // BN, N % BN
    body = c[:full * BN].reshape(full, BN, K)
    body = (body[:, :BN // 2] | (body[:, BN // 2:] << 4)).permute(0, 2, 1).reshape(-1)  # [full, K, BN/2]
    tail = c[full * BN:].reshape(tail_rows // 2, 2, K)
    tail = (tail[:, 0] | (tail[:, 1] << 4)).t().reshape(-1)  # [K, tail_rows/2]
    return torch.cat([body, tail]).view(N, K // 2)


def linear_int4_ref(x: torch.Tensor, qdata: torch.Tensor, scale_and_zero: torch.Tensor, group: int,
                    bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                    block: int | None = None) -> torch.Tensor:
    """The reference, in fp32: x [..., K] against the dequantised int4 weight (:func:`int4_dequantize`, codes in
    ``block``-row blocks, default this machine's), + bias [N] + residual [..., N] -> [..., N] in x's dtype."""
    return linear_ref(x, int4_dequantize(qdata, scale_and_zero, group, block), bias, residual)


def _linear_int4_torch(x, qdata, scale_and_zero, group, bias=None, residual=None):
    # what torchao's Int4OpaqueTensor computes: aten's CPU int4 kernel, activations in the scales' dtype
    N = qdata.shape[0]
    x2 = x.reshape(-1, x.shape[-1]).to(scale_and_zero.dtype).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, qdata, group, scale_and_zero)[:, :N]
    y = y.reshape(*x.shape[:-1], N)
    if bias is not None:
        y = y + bias
    y = y.to(x.dtype)
    return y if residual is None else y + residual


def _quantized_input_refusal(x) -> str | None:
    """Why the native int4 / int8-activation products cannot take input x (None: they can): on the CPU, not
    compiling, no autograd, 1..MAX_ROWS rows."""
    if x.device.type != "cpu":
        return "not on the CPU"
    if torch.compiler.is_compiling():
        return "compiling"
    if torch.is_grad_enabled() and x.requires_grad:
        return "autograd"
    K = x.shape[-1]
    rows = x.numel() // K if K else 0
    if not 0 < rows <= native.MAX_ROWS:
        return f"{rows} rows (the native product takes 1..{native.MAX_ROWS})"
    return None


def _int4_native_supports(x, qdata, scale_and_zero, group, bias=None, residual=None) -> str | None:
    """a few contiguous fp32/bf16 rows, int4pack codes with fp32/bf16 scales, no autograd"""
    why = _quantized_input_refusal(x)
    if why is not None:
        return why
    K = x.shape[-1]
    N = qdata.shape[0]
    if x.dtype not in (torch.float32, torch.bfloat16) or scale_and_zero.dtype not in (torch.float32, torch.bfloat16):
        return f"dtypes {x.dtype} x int4 with {scale_and_zero.dtype} scales"
    if qdata.dtype != torch.uint8 or qdata.shape != (N, K // 2) or N % 16 or K % group or not 2 <= group <= 1024 \
            or group % 2 or scale_and_zero.shape != (K // group, N, 2):
        return f"int4 codes {tuple(qdata.shape)} / scales {tuple(scale_and_zero.shape)} for K={K}, group {group}"
    if not (x.is_contiguous() and qdata.is_contiguous() and scale_and_zero.is_contiguous()):
        return "not contiguous"
    why = int4_layout_refusal()
    if why is not None:
        return why
    return _epilogue_refusal(x, bias, residual) or _native_products.check_linear_int4(
        x, qdata, scale_and_zero, group, bias, residual, int4pack_block())


def int4_layout_refusal(block: int | None = None) -> str | None:
    """Why the native int4 product cannot read aten's int4pack layout of ``block``-row blocks (default this
    machine's, :func:`int4pack_block`), None when it can (32 and 64 rows: aten's AVX2 and AVX512 packings)."""
    BN = int4pack_block() if block is None else block
    if BN in INT4_BLOCKS:
        return None
    return (f"aten packs int4 in {BN}-row blocks on this CPU; the native int4 product reads 32- and 64-row blocks "
            f"(aten's AVX2 and AVX512 layouts), so aten's own kernel runs")


def _linear_int4_native(x, qdata, scale_and_zero, group, bias=None, residual=None, block=None):
    return torch.ops.hybrid.linear_int4.default(x, qdata, scale_and_zero, group, bias, residual,
                                                int4pack_block() if block is None else block)


_linear_int4_native.after_supports = lambda x, qdata, scale_and_zero, group, bias=None, residual=None: \
    _native_products.linear_int4_after_check(x, qdata, scale_and_zero, group, bias, residual, int4pack_block())


def linear_int4(x: torch.Tensor, qdata: torch.Tensor, scale_and_zero: torch.Tensor, group: int,
                bias: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T + bias [N] + residual [..., N] -> [..., N] in x's dtype, W the int4 weight torchao's CPU
    ``Int4OpaqueTensor`` holds (``hybrid.quantize.int4_blocks``): the native product for a decode step's few rows,
    aten's int4 kernel (torchao's own) otherwise."""
    _, fn = dispatch.choose("linear_int4", x.device.type)
    return fn(x, qdata, scale_and_zero, group, bias, residual)


dispatch.register("linear_int4", "torch", _linear_int4_torch)
dispatch.register("linear_int4", "native", _linear_int4_native, native.available, _int4_native_supports)


# ---- int8 activations: torchao's int8dq and 8da4w (hybrid.quantize; decode.c's "int8-activation products") ----

def quantize_rows_sym(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's per-row symmetric int8 quantisation of activations (``Int8Tensor.from_hp``: choose_qparams_affine
    SYMMETRIC with eps = fp32's eps, quantize_affine): codes int8 [..., K] and fp32 scales [..., 1]. The scale is
    computed in x's dtype (max|x| / 127.5) and kept as fp32; codes = clamp(round(x * (1 / scale)), -128, 127)."""
    amax = torch.maximum(-torch.clamp(x.amin(-1, keepdim=True), max=0), torch.clamp(x.amax(-1, keepdim=True), min=0))
    scale = torch.clamp(amax / 127.5, min=torch.finfo(torch.float32).eps).float()
    q = torch.clamp(torch.round(x * (1.0 / scale)), -128, 127).to(torch.int8)
    return q, scale


def quantize_rows_asym(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torchao's per-token asymmetric int8 quantisation of activations (IntxUnpackedToInt8Tensor's
    ``_apply_int8_act_asym_per_token_quant_dequant`` before its dequantisation): codes int8 [..., K], scales
    [..., 1] in x's dtype, zero points int8 [..., 1]; every op in x's dtype, as torchao computes them."""
    lo = torch.clamp(x.amin(-1, keepdim=True), max=0)
    hi = torch.clamp(x.amax(-1, keepdim=True), min=0)
    scale = torch.clamp((hi - lo) / 255.0, min=torch.finfo(x.dtype).smallest_normal)
    zp = torch.clamp(-128 - torch.round(lo / scale), -128, 127).to(torch.int8)
    q = torch.clamp(torch.round(x * (1.0 / scale)) + zp, -128, 127).to(torch.int8)
    return q, scale, zp


def int8_dot(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The integer dot products q [M, K] . codes [N, K]^T (both int8) as fp32 [M, N], each the exact integer
    rounded once to fp32 (as torch._int_mm's int32 converted to fp32), through fp32 GEMMs (oneDNN's; aten's int8
    GEMM without VNNI took 34 s for a 2K llama-d512 prefill, fp32 7 s): a partial sum is at most K 128 128, exact
    in fp32 up to K = 1024 in any order; past that codes = 16 hi + lo (lo 0..15, hi -8..7) makes two GEMMs
    whose sums stay below 2^24 up to K = 8192, combined in fp64."""
    K = q.shape[-1]
    qf = q.float()
    if K <= 1024:
        return qf @ codes.float().T
    if K > 8192:
        return (q.double() @ codes.double().T).float()
    c = codes.to(torch.int16)
    hi, lo = (c >> 4).float(), (c & 15).float()
    return ((qf @ hi.T).double() * 16 + (qf @ lo.T).double()).float()


def linear_int8dq_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """torchao's int8dq product, op for op: x [..., K] quantised per row (:func:`quantize_rows_sym`), the integer
    dot with the int8 codes [N, K] (exact, :func:`int8_dot`), then (dot * x_scale) in x's dtype, times the row
    scales [N] (fp32) + bias, in x's dtype; + residual [..., N]. Also the int8dq prefill on a CPU (many rows:
    the same numbers as torchao's, bit for bit, at fp32 GEMM speed)."""
    q, xs = quantize_rows_sym(x)
    N, K = codes.shape
    dot = int8_dot(q.reshape(-1, K), codes).reshape(*x.shape[:-1], N)
    y = (dot * xs).to(x.dtype) * scale.float()
    if bias is not None:
        y = y + bias
    y = y.to(x.dtype)
    return y if residual is None else y + residual


def linear_8da4w_ref(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """The 8da4w product in integers: x [..., K] quantised per token as torchao does (:func:`quantize_rows_asym`),
    each group of 32's integer dot of (codes - zero point) with the int4 values [N, K] (-8..7), then
    x_scale * sum_g scale[n, g] * dot_g in fp32 + bias, in x's dtype; + residual. torchao computes F.linear of the
    dequantised activations and weights: the same sum in another order (and, in bf16, with each dequantised value
    rounded to bf16)."""
    N, K = values.shape
    q, xs, zp = quantize_rows_asym(x)
    d = (q.float() - zp.float()).reshape(-1, K // 32, 32)
    dots = torch.einsum("bgk,ngk->bng", d, values.float().reshape(N, K // 32, 32))  # integers < 2^24: exact
    y = (dots * scale.float()).sum(-1).reshape(*x.shape[:-1], N) * xs.float()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y if residual is None else y + residual


def pack_8da4w(values: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The native 8da4w product's operands from the int4 values (int8 [N, K], -8..7, K a multiple of 32) and group
    scales [N, K/32]: (nibbles uint8 [N, K/2]: group g of row n at bytes (n K/32 + g) 16, byte j = value k=j + 8
    in the low nibble and k=j+16 (+ 8) in the high one; fp32 [N K/32 + N]: the group scales, then per row
    sum_g scale_g * sum of the group's values, summed in fp64)."""
    N, K = values.shape
    if K % 32 or values.dtype != torch.int8 or tuple(scale.shape) != (N, K // 32):
        raise ValueError(f"8da4w operands: int8 values [N, K] with K a multiple of 32 and scales [N, K/32]; got "
                         f"{values.dtype} {tuple(values.shape)} and {tuple(scale.shape)}")
    g = (values.to(torch.int16) + 8).to(torch.uint8).reshape(N, K // 32, 32)
    nibbles = (g[..., :16] | (g[..., 16:] << 4)).reshape(N, K // 2).contiguous()
    ws = scale.float()
    wsum = (ws.double() * g.to(torch.float64).sub(8).sum(-1)).sum(-1).float()
    return nibbles, torch.cat([ws.reshape(-1), wsum])


QK_I8DQ, QK_8DA4W = 0, 1  # decode.c's kinds


def _q_native_supports(x, kind, w, ws, bias=None, residual=None, values=None) -> str | None:
    """a few contiguous fp32/bf16 rows, contiguous operands, no autograd"""
    why = _quantized_input_refusal(x)
    if why is not None:
        return why
    K = x.shape[-1]
    if x.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {x.dtype}"
    N = w.shape[0]
    if kind == QK_I8DQ and not (w.dtype == torch.int8 and w.shape == (N, K) and ws.dtype == torch.float32
                                and ws.shape == (N,)):
        return f"int8dq codes {tuple(w.shape)} / scales {tuple(ws.shape)} for K={K}"
    if kind == QK_8DA4W and not (K % 32 == 0 and w.dtype == torch.uint8 and w.shape == (N, K // 2)
                                 and ws.dtype == torch.float32 and ws.shape == (N * (K // 32) + N,)):
        return f"8da4w nibbles {tuple(w.shape)} / scales {tuple(ws.shape)} for K={K}"
    if not (x.is_contiguous() and w.is_contiguous() and ws.is_contiguous()):
        return "not contiguous"
    return _epilogue_refusal(x, bias, residual) or _native_products.check_linear_q(x, kind, w, ws, bias, residual)


def _linear_q_native(x, kind, w, ws, bias=None, residual=None, values=None):
    return torch.ops.hybrid.linear_q.default(x, kind, w, ws, bias, residual)


_linear_q_native.after_supports = lambda x, kind, w, ws, bias=None, residual=None, values=None: \
    _native_products.linear_q_after_check(x, kind, w, ws, bias, residual)


def _linear_q_torch(x, kind, w, ws, bias=None, residual=None, values=None):
    if kind == QK_I8DQ:
        return linear_int8dq_ref(x, w, ws, bias, residual)
    if values is None:
        raise ValueError("the torch 8da4w product needs the unpacked int4 values (values=)")
    N, K = values.shape
    return linear_8da4w_ref(x, values, ws[:N * (K // 32)].reshape(N, K // 32), bias, residual)


def linear_q(x: torch.Tensor, kind: int, w: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, values: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T + bias [N] + residual [..., N] -> [..., N] in x's dtype, the activations quantised to int8
    per row. ``kind`` QK_I8DQ: w int8 codes [N, K], ws fp32 row scales [N] (:func:`linear_int8dq_ref`'s
    arithmetic, exactly); QK_8DA4W: w, ws from :func:`pack_8da4w` and ``values`` the int4 values the torch
    backend computes from (:func:`linear_8da4w_ref`; the native kernel equals it to fp32 summation order)."""
    _, fn = dispatch.choose("linear_q", x.device.type)
    return fn(x, kind, w, ws, bias, residual, values)


dispatch.register("linear_q", "torch", _linear_q_torch)
dispatch.register("linear_q", "native", _linear_q_native, native.available, _q_native_supports)
