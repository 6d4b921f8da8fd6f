"""Perplexity on held-out text, and how often a student's top-1 next token is the teacher's.

The held-out tokens are cut into non-overlapping windows of ``seq_len``; every position but a window's first
is scored (the first has no context inside its window). Perplexity is exp of the mean next-token negative
log-likelihood over all scored positions; top-1 agreement is the share of them where the model's argmax equals
the teacher's (the teacher's argmaxes are computed once, :func:`top1`, and reused for every member).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``tokens`` [N] -> [N // seq_len, seq_len] int64 (the tail shorter than a window is dropped)."""
    n = tokens.numel() // seq_len
    if n < 1:
        raise ValueError(f"{tokens.numel()} held-out tokens make no window of {seq_len}; give more tokens or a "
                         f"shorter seq_len")
    return tokens[:n * seq_len].view(n, seq_len).long()


@torch.no_grad()
def top1(model, tokens: torch.Tensor, *, seq_len: int = 1024, batch_size: int = 4) -> torch.Tensor:
    """The model's argmax at every scored position: [windows, seq_len - 1]."""
    x = windows(tokens, seq_len)
    return torch.cat([model(x[i:i + batch_size])[:, :-1].argmax(-1) for i in range(0, len(x), batch_size)])


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, *, seq_len: int = 1024, batch_size: int = 4,
               teacher_top1: torch.Tensor | None = None) -> dict:
    """``ppl`` (and ``nll``, nats per token) of ``model`` on ``tokens``; with ``teacher_top1`` (from :func:`top1`
    on the same tokens and seq_len) also ``top1_agreement``."""
    x = windows(tokens, seq_len)
    if teacher_top1 is not None and teacher_top1.shape != (len(x), seq_len - 1):
        raise ValueError(f"teacher_top1 has shape {tuple(teacher_top1.shape)}, these tokens need "
                         f"{(len(x), seq_len - 1)}: compute it with top1() on the same tokens and seq_len")
    device = next(model.parameters()).device
    nll, agree, n = 0.0, 0, 0
    for i in range(0, len(x), batch_size):
        xb = x[i:i + batch_size].to(device)
        logits = model(xb)[:, :-1].float()
        nll += float(F.cross_entropy(logits.flatten(0, 1), xb[:, 1:].flatten(), reduction="sum"))
        if teacher_top1 is not None:
            agree += int((logits.argmax(-1).cpu() == teacher_top1[i:i + batch_size]).sum())
        n += xb[:, 1:].numel()
    out = {"nll": nll / n, "ppl": math.exp(nll / n), "scored_tokens": n, "seq_len": seq_len}
    if teacher_top1 is not None:
        out["top1_agreement"] = agree / n
    return out
