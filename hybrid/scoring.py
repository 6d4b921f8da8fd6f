"""Prompt scoring: log P(token | the tokens before it) for a request's prompt positions (lm-eval's
loglikelihood, :meth:`hybrid.engine.Engine.score`). A scoring request runs through the scheduler like any
prompt; this module says which positions of a step's chunk score a token and records their log-probabilities
from the step's logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ScoreResult:
    """Log-probabilities of ``tokens[start:]``, each given the tokens before it, and whether each token was
    the most likely one (greedy)."""

    logprobs: list[float]
    greedy: list[bool]
    next_logprobs: torch.Tensor | None = None  # [vocab] float32: log P(next token | all of tokens)

    @property
    def total(self) -> float:
        return sum(self.logprobs)

    @property
    def is_greedy(self) -> bool:
        return all(self.greedy)


def scored_positions(req, n: int) -> range:
    """Positions of ``req``'s next ``n``-token chunk whose logits score a target token (none for most
    requests)."""
    if req.logprobs_from is None:
        return range(0)
    lo = max(req.num_computed, req.logprobs_from - 1 + len(req.prompt_logprobs))
    hi = min(req.num_computed + n, len(req.prompt) - 1)
    return range(lo, max(lo, hi))


def record_logprobs(plan, scoring, all_logits: torch.Tensor) -> None:
    """Append each request's scored positions' log-probabilities and greedy flags (``scoring``: one
    :func:`scored_positions` range per ``(request, tokens)`` of ``plan``) from the step's every-token logits."""
    offset = 0
    for (req, n), positions in zip(plan, scoring, strict=True):
        if len(positions):
            rows = torch.arange(positions.start, positions.stop) - req.num_computed + offset
            logp = torch.log_softmax(all_logits[rows.to(all_logits.device)].float(), dim=-1)
            target = torch.tensor(req.prompt[positions.start + 1:positions.stop + 1], device=logp.device)
            req.prompt_logprobs.extend(logp.gather(1, target[:, None])[:, 0].tolist())
            req.prompt_greedy.extend((logp.argmax(-1) == target).tolist())
        offset += n
