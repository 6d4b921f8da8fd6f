"""Per-request sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeds.

Every request draws from its own ``torch.Generator``, one uniform number per token, so the same
seed gives the same output whatever else shares the batch (and after a preemption).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` is greedy. ``top_k = 0``, ``top_p = 1``, ``min_p = 0`` and
    ``repetition_penalty = 1`` switch those filters off. Generation stops after
    ``max_new_tokens``, at any of ``stop_token_ids`` (not included in the output; the engine adds
    the tokenizer's EOS unless ``ignore_eos``) or once the text contains a ``stop`` string (needs
    a tokenizer; the text is cut before it). ``seed=None`` draws a seed from torch's global RNG.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        checks = [
            (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
             f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}"),
            (self.temperature >= 0.0, f"temperature must be >= 0 (0 is greedy), got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 is off), got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be > 0 (1 is off), got {self.repetition_penalty}"),
            (all(isinstance(s, str) and s for s in self.stop), f"stop strings must be non-empty, got {self.stop!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty on tokens already in the context: divide positive logits, multiply negative ones."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    ids = seen.unique()
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [V] (already penalised) -> the sampling distribution [V] (fp64) after temperature,
    top-k, top-p and min-p."""
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)
    if params.top_k and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the strictly more likely tokens
        keep_sorted = before < params.top_p * sorted_p.sum()
        keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return probs / probs.sum()


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw with one uniform number from ``generator``."""
    u = torch.rand((), generator=generator, dtype=torch.float64)
    cdf = torch.cumsum(probs, dim=-1)
    idx = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return min(idx, probs.shape[-1] - 1)


def sample_tokens(logits: torch.Tensor, params: list[SamplingParams], contexts: list[torch.Tensor],
                  generators: list[torch.Generator]) -> list[int]:
    """One next token per row. logits [B, V]; ``contexts[b]`` holds row b's prompt and output ids
    (for the repetition penalty); ``generators[b]`` its RNG (CPU)."""
    logits = logits.float().cpu()
    argmax = logits.argmax(dim=-1).tolist()  # the plain greedy rows, in one call
    out = []
    for b, p in enumerate(params):
        if p.greedy and p.repetition_penalty == 1.0:
            out.append(argmax[b])
            continue
        row = apply_repetition_penalty(logits[b], contexts[b], p.repetition_penalty)
        if p.greedy:
            out.append(int(torch.argmax(row)))
        else:
            out.append(draw(filtered_probs(row, p), generators[b]))
    return out
