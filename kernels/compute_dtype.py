"""Which dtype the torch paths of the scans multiply in.

bf16 matmuls are fast only where the hardware has bf16 dot products (AVX512-BF16 / AMX on x86, any
CUDA GPU); on other CPUs torch emulates them, 5-100x slower than fp32 (an AVX2 EPYC here: 0.5 vs
30-45 GFLOP/s for a 1024-square matmul). There the scans upcast to fp32, which is both faster and
more exact; where bf16 is native they keep bf16 operands (fp32 accumulation inside the matmul).
The recurrent quantities (decay cumsums, states, softplus) are fp32 either way.
"""

from __future__ import annotations

import torch

_NATIVE_BF16: list[bool] = []  # asked once; a plain list, not functools.cache, which torch.compile warns about


def cpu_has_native_bf16() -> bool:
    if not _NATIVE_BF16:
        _NATIVE_BF16.append(bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    return _NATIVE_BF16[0]


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``dtype`` itself for bf16/fp16 where the device multiplies it natively, else fp32."""
    if dtype == torch.float32 or dtype == torch.float64:
        return dtype
    if device.type == "cuda":
        return dtype
    if device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_native_bf16():
        return dtype
    return torch.float32
