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

    # ---- the decode program's lowering (docs/adding-a-mixer.md) ---------------------------------
    def lower_decode(self, b, norm, view) -> None:
        """The pre-norm, the (gated) up-projection with the activation, the down-projection with the residual;
        gate and up in one weight format (float, int8dq / 8da4w, or int4)."""
        d_model, d_ff = self.up_proj.weight.shape[1], self.up_proj.weight.shape[0]
        h, a = b.buffer(d_model), b.buffer(d_ff)
        b.norm(norm, b.X, h)
        gate, up = self.gate_proj, self.up_proj
        if gate is None:
            b.linear(up, h, a, act=self.activation)
        elif b.q(gate) is not None or b.q(up) is not None:
            gq, uq = b.q(gate), b.q(up)
            if gq is None or uq is None or gq[0] != uq[0] or not b.plain(gate.bias, up.bias):
                raise b.Unsupported("gate/up weights not both int8dq or both 8da4w")
            b.op("GATED_UP_Q", wg=gq[1], sg=gq[2], bg=gate.bias, wu=uq[1], su=uq[2], bu=up.bias, x=h, y=a,
                 qkind=gq[0], bdt=b.code(up.bias), xdt=b.dt, act=b.act(self.activation), N=d_ff, K=d_model)
        elif b.int4(gate) is not None or b.int4(up) is not None:
            g4, u4 = b.int4(gate), b.int4(up)
            if g4 is None or u4 is None or (g4[1].dtype, g4[2]) != (u4[1].dtype, u4[2]) \
                    or not b.plain(gate.bias, up.bias):
                raise b.Unsupported("gate/up weights not both int4 of one group")
            b.op("GATED_UP_INT4", qg=g4[0], szg=g4[1], bg=gate.bias, qu=u4[0], szu=u4[1], bu=up.bias, x=h, y=a,
                 sdt=b.code(g4[1]), G=g4[2], bdt=b.code(up.bias), xdt=b.dt, act=b.act(self.activation), N=d_ff,
                 K=d_model, bn=b.int4_block())
        else:
            (wg, sg), (wu, su) = b.weight(gate), b.weight(up)
            if wg.dtype != wu.dtype or not b.plain(gate.bias, up.bias):
                raise b.Unsupported("gate/up weights of different dtypes")
            b.op("GATED_UP", wg=wg, sg=sg, bg=gate.bias, wu=wu, su=su, bu=up.bias, x=h, y=a, wdt=b.code(wu),
                 bdt=b.code(up.bias), xdt=b.dt, act=b.act(self.activation), N=d_ff, K=d_model)
        b.linear(self.down_proj, a, b.X, residual=b.X)
