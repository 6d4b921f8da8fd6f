"""The MLP sub-layer (``-``): gated (SwiGLU, GeGLU) or plain (NemotronH's squared ReLU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import HybridConfig, MLPConfig
from .linear import Linear


def activation_fn(name: str):
    return {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "relu": F.relu,
        "relu2": lambda t: F.relu(t).square(),
    }[name]


class MLP(nn.Module):
    kind = "mlp"

    @classmethod
    def from_config(cls, cfg: HybridConfig) -> MLP:
        return cls(cfg.d_model, cfg.mlp)

    @staticmethod
    def cache_spec(cfg: HybridConfig, dtypes) -> None:
        return None  # token-wise: nothing to cache

    @staticmethod
    def flops_per_token(cfg: HybridConfig, seq_len: int) -> float:
        return 0.0  # its matmuls are counted with the model's weights

    def __init__(self, d_model: int, cfg: MLPConfig):
        super().__init__()
        self.activation = cfg.activation
        self.act = activation_fn(cfg.activation)
        self.gate_proj = Linear(d_model, cfg.d_ff, bias=cfg.bias) if cfg.gated else None
        self.up_proj = Linear(d_model, cfg.d_ff, bias=cfg.bias)
        self.down_proj = Linear(cfg.d_ff, d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x)
        h = self.act(self.gate_proj(x)) * h if self.gate_proj is not None else self.act(h)
        return self.down_proj(h)
