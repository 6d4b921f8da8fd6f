"""Shared set-up for the Triton kernel tests: skip when Triton cannot run, and the device to use."""

import pytest
import torch
from hybrid.kernels import triton_support

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# fp32: both sides accumulate in fp32 and differ only in summation order and exp vs exp2, ~1e-7 of
# the output scale; 1e-5 leaves two orders of margin and still catches any real indexing/mask error
# (those show up at 1e-2 or more). fp16: the outputs are rounded to fp16 (unit roundoff 4.9e-4) and
# the attention kernels feed fp16 probabilities to the PV product as flash attention does: 2e-3.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}

needs_triton = pytest.mark.skipif(
    triton_support.probe() is not None or triton_support.device_reason(DEVICE) is not None,
    reason=f"Triton cannot run here: {triton_support.probe() or triton_support.device_reason(DEVICE)}",
)
