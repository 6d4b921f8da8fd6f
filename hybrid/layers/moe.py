"""Mixture-of-experts MLP sub-layer (``E``): a linear router picks ``top_k`` experts per token and the
token's output is the probability-weighted sum of those experts' MLP outputs (Jamba / Mixtral), plus, with
``shared_d_ff``, a shared expert every token runs through, scaled by ``sigmoid(shared_expert_gate(x))`` when
``shared_gate`` (Qwen2-MoE / Qwen3-Next).

Expert weights are stacked per matrix (``gate_proj`` [E, F, D], ``up_proj`` [E, F, D], ``down_proj``
[E, D, F]) so one tensor holds every expert. Each expert runs only on the tokens routed to it: the
(token, slot) pairs are sorted by expert once, and each expert processes its contiguous run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..config import HybridConfig, MLPConfig, MoEConfig
from .linear import Linear
from .mlp import MLP, activation_fn


class MoE(nn.Module):
    kind = "moe"

    @classmethod
    def from_config(cls, cfg: HybridConfig) -> MoE:
        return cls(cfg.d_model, cfg.moe)

    @staticmethod
    def cache_spec(cfg: HybridConfig, dtypes) -> None:
        return None  # token-wise: nothing to cache

    @staticmethod
    def flops_per_token(cfg: HybridConfig, seq_len: int) -> float:
        """The ``top_k`` experts a token runs through (the router is an nn.Linear, counted with the weights)."""
        moe = cfg.moe
        return 2.0 * moe.top_k * (3 if moe.gated else 2) * cfg.d_model * moe.d_ff

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.act = activation_fn(cfg.activation)
        E, Fd = cfg.n_experts, cfg.d_ff
        self.router = Linear(d_model, E, bias=False)
        self.gate_proj = nn.Parameter(torch.empty(E, Fd, d_model)) if cfg.gated else None
        self.up_proj = nn.Parameter(torch.empty(E, Fd, d_model))
        self.down_proj = nn.Parameter(torch.empty(E, d_model, Fd))
        self.shared_expert = MLP(d_model, MLPConfig(d_ff=cfg.shared_d_ff, activation=cfg.activation,
                                                    gated=cfg.gated)) if cfg.shared_d_ff else None
        self.shared_expert_gate = Linear(d_model, 1, bias=False) if cfg.shared_gate else None

    def reset_special_parameters(self, std: float) -> None:
        # the stacked expert matrices are Parameters, not nn.Linear: the model's normal draw misses them
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            if p is not None:
                nn.init.normal_(p, std=std)

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, k] in x's dtype, expert ids [T, k]); softmax over all experts in fp32."""
        probs = F.softmax(self.router(x_TD).float(), dim=-1)
        weights, experts = torch.topk(probs, self.cfg.top_k, dim=-1)
        if self.cfg.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x_TD.dtype), experts

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e``'s MLP on x [n, D] -> [n, D]."""
        h = kernels.linear(x, self.up_proj[e])
        h = self.act(kernels.linear(x, self.gate_proj[e])) * h if self.gate_proj is not None else self.act(h)
        return kernels.linear(h, self.down_proj[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D] (any leading shape: [B, L, D] in the model, [T, D] in packed inference)."""
        x_TD = x.reshape(-1, x.shape[-1])
        k = self.cfg.top_k
        with torch.profiler.record_function("moe.routing"):
            weights, experts = self.route(x_TD)
            # Sort the T*k (token, slot) assignments by expert so each expert sees one contiguous run.
            flat_experts = experts.reshape(-1)
            order = torch.argsort(flat_experts, stable=True)
            counts = torch.bincount(flat_experts, minlength=self.cfg.n_experts).tolist()
            token_of = order // k
        # one gather puts every expert's tokens in one contiguous run, each expert writes its run of the
        # output, and one weighted scatter-add sums each token's k expert outputs
        with torch.profiler.record_function("moe.dispatch"):
            x_sorted = x_TD.index_select(0, token_of)
        with torch.profiler.record_function("moe.experts"):
            y_sorted = torch.empty_like(x_sorted)
            start = 0
            for e, n in enumerate(counts):
                if n:
                    y_sorted[start:start + n] = self.expert(e, x_sorted[start:start + n])
                    start += n
        with torch.profiler.record_function("moe.combine"):
            y_sorted = y_sorted * weights.reshape(-1)[order, None]
            out = torch.zeros_like(x_TD).index_add_(0, token_of, y_sorted)
        return self.add_shared(x_TD, out).view_as(x)

    def add_shared(self, x_TD: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The routed sum [T, D] plus the (gated) shared expert's output, if there is one."""
        if self.shared_expert is None:
            return routed
        shared = self.shared_expert(x_TD)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared
        return routed + shared


def moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Naive per-token loop over the routed experts (the definition ``MoE.forward`` must match)."""
    x_TD = x.reshape(-1, x.shape[-1])
    weights, experts = moe.route(x_TD)
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros_like(x_TD[t])
        for j in range(moe.cfg.top_k):
            acc = acc + moe.expert(int(experts[t, j]), x_TD[t:t + 1])[0] * weights[t, j]
        rows.append(acc)
    return moe.add_shared(x_TD, torch.stack(rows)).view_as(x)
