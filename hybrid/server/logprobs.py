"""Per-token log-probabilities of a token sequence (``echo`` + ``logprobs``, and generated tokens).

The engine has no scoring path yet, so this runs the model's plain full forward over the whole
sequence and takes log_softmax in fp32, the way the ``hybrid`` lm-eval model scores. It is called
only from the engine-loop thread, between engine steps (the model is not shared across threads).
When the engine gains prompt log-probabilities, :func:`score_tokens` is the one place to replace.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class TokenLogprobs:
    """For positions ``start..len(ids)-1`` of a sequence: each token's log-probability given the
    tokens before it (None for position 0, which nothing predicts) and the ``top`` most likely
    alternatives there as ``(token_id, logprob)``, best first (None for position 0)."""

    token_ids: list[int]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


@torch.inference_mode()
def score_tokens(model, ids: list[int], top: int, start: int = 0) -> TokenLogprobs:
    """Log-probabilities of ``ids[start:]`` under ``model`` (one causal forward of all of ``ids``)."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([ids], dtype=torch.long, device=device))[0]
    first = max(start, 1)  # row p-1 predicts token p
    logp = F.log_softmax(logits[first - 1: len(ids) - 1].float(), dim=-1)
    target = torch.tensor(ids[first:], dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, target[:, None])[:, 0].tolist()
    if top > 0:
        values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)
        tops = [list(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    else:
        tops = [[] for _ in chosen]
    head = 1 if start == 0 else 0  # position 0 has no prediction
    return TokenLogprobs(list(ids[start:]), [None] * head + chosen, [None] * head + tops)
