"""Rotary position embedding in the rotate-half (GPT-NeoX / Llama) convention, applied to the
first ``rotary_dim`` channels of each head (partial rotary) or to none (``rotary_dim == 0``)."""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float = 10000.0):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        # Computed per call (rotary_dim / 2 values) rather than held as a buffer, so a model built
        # on the meta device and loaded with assign=True has nothing left to materialise.
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        return 1.0 / (self.theta ** exponents)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., L] -> cos, sin [..., L, rotary_dim] (computed in fp32, cast to ``dtype``)."""
        freqs = positions.float()[..., None] * self.inv_freq(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., L, H, D]; cos/sin [..., L, rotary_dim] broadcast over heads."""
        if self.rotary_dim == 0:
            return x
        r = self.rotary_dim
        x_rot, x_pass = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
        x_rot = x_rot * cos[..., None, :] + rotated * sin[..., None, :]
        return torch.cat([x_rot, x_pass], dim=-1) if x_pass.shape[-1] else x_rot
