"""``Linear``: ``nn.Linear`` (same parameters, same state-dict names, what torchao's ``quantize_`` finds) whose
forward goes through :func:`hybrid.kernels.linear`, so a decode step's few rows take the native matrix-vector
product at the memory bandwidth; ``residual`` adds the sub-layer's input in the same pass. A torchao int8
weight-only weight (:func:`hybrid.quantize`) is handed over as its codes and row scales, a torchao CPU int4 one
as its int4pack codes and group scales/zeros (:func:`hybrid.kernels.projection.linear_int4`), a torchao int8dq or
8da4w one (int8 activations) as its codes and scales (:func:`hybrid.kernels.projection.linear_q`). Many rows
(prefill) keep torchao's own product, but for int8dq on a CPU: its integer matmul through fp32 GEMMs
(:func:`hybrid.kernels.projection.int8_dot`, the same numbers; aten's int8 GEMM without VNNI is 5x slower
than fp32)."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight
        if type(w) is not nn.Parameter and type(w) is not torch.Tensor and x.numel() > 16 * x.shape[-1] \
                and x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad):
            from ..quantize import q_operands

            q = q_operands(w)
            if q is not None and q[0] == kernels.projection.QK_I8DQ:  # torchao's numbers, fp32 GEMM speed
                return kernels.projection.linear_q(x, *q[:3], self.bias, residual)
        if type(w) is not nn.Parameter and type(w) is not torch.Tensor and x.numel() <= 16 * x.shape[-1]:
            from ..quantize import int4_blocks, int8_rows, q_operands

            rows = int8_rows(w)
            if rows is not None:
                codes, scale = rows
                return kernels.linear(x, codes, self.bias, residual, scale=scale)
            blocks = int4_blocks(w)
            if blocks is not None:
                return kernels.projection.linear_int4(x, *blocks, self.bias, residual)
            q = q_operands(w)
            if q is not None:
                kind, codes, ws, values = q
                return kernels.projection.linear_q(x, kind, codes, ws, self.bias, residual, values)
        return kernels.linear(x, w, self.bias, residual)
