"""``Linear``: ``nn.Linear`` (same parameters, same state-dict names, what torchao's ``quantize_`` finds) whose
forward goes through :func:`hybrid.kernels.linear`, so a decode step's few rows take the native matrix-vector
product at the memory bandwidth; ``residual`` adds the sub-layer's input in the same pass."""

from __future__ import annotations

import torch
from torch import nn

from .. import kernels


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias, residual)
