"""Rotary position embedding in the rotate-half (GPT-NeoX / Llama) convention, applied to the
first ``rotary_dim`` channels of each head (partial rotary) or to none (``rotary_dim == 0``).
Optional frequency scaling: ``linear`` (position interpolation) and Llama-3's ``llama3``."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels.packing import attached_values


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, theta: float = 10000.0, scaling: dict | None = None):
        super().__init__()
        self.rotary_dim, self.theta, self.scaling = rotary_dim, theta, scaling

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        # Computed on first use per device (rotary_dim / 2 values) rather than held as a buffer, so a model
        # built on the meta device and loaded with assign=True has nothing left to materialise; kept, since a
        # decode step would otherwise spend ~0.1 ms recomputing it.
        key = (str(device), self.rotary_dim, self.theta, repr(self.scaling))
        cached = self.__dict__.setdefault("_inv_freq", {})
        if key not in cached:
            cached[key] = self._inv_freq_uncached(device)
        return cached[key]

    def _inv_freq_uncached(self, device: torch.device) -> torch.Tensor:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        inv_freq = 1.0 / (self.theta ** exponents)
        return inv_freq if self.scaling is None else scale_inv_freq(inv_freq, self.scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [..., L] -> cos, sin [..., L, rotary_dim] (computed in fp32, cast to ``dtype``)."""
        if positions.dim() == 1 and positions.numel() <= 64 and positions.device.type == "cpu" \
                and not torch.compiler.is_compiling():
            return self._decode_cos_sin(positions, dtype)
        return self._cos_sin(positions, dtype)

    def _decode_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # A decode step's few rows, looked up in a table of every position so far (grown by doubling): the
        # six small ops of _cos_sin took ~130 us of a 5 ms step. The table rows are _cos_sin's own values.
        host = attached_values(positions)  # a packed batch's positions carry their host values
        need = (max(host) if host else int(positions.max())) + 1 if positions.numel() else 1
        cos, sin = self.table(need, dtype, positions.device)
        return cos.index_select(0, positions), sin.index_select(0, positions)  # (cheaper than cos[positions])

    def table(self, rows: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [R, rotary_dim] of positions 0..R-1 with R >= ``rows`` (R a power of two, at least 1024): the
        table decode steps look their positions up in (the native decode program reads its rows directly). Kept
        per dtype and grown by doubling, so it is rebuilt at most log2(longest position) times."""
        tables = self.__dict__.setdefault("_tables", {})
        cos, sin = tables.get((dtype, str(device)), (None, None))
        if cos is None or cos.shape[0] < rows:
            size = max(1024, 1 << (rows - 1).bit_length())
            with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode alike
                cos, sin = tables[(dtype, str(device))] = self._cos_sin(torch.arange(size, device=device), dtype)
        return cos, sin

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
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


def scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Apply a validated ``AttentionConfig.rope_scaling`` to the RoPE inverse frequencies."""
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed down by ``factor``, short ones kept, the band between
    # interpolated smoothly (Llama 3.1's published recipe).
    lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / hi) & ~(wavelen > old_ctx / lo)
    return torch.where(medium, smoothed, scaled)
