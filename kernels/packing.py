"""Small helpers shared by the torch paths of the packed (varlen) and slot-indexed ops."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, op: str) -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: cu_seqlens must be [B+1] with B >= 1, got shape {tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != total or any(b <= a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"{op}: cu_seqlens must rise strictly from 0 to the {total} packed tokens, got {cu}")


def sequences(cu_seqlens: torch.Tensor) -> Iterator[tuple[int, slice]]:
    """(index, token slice) of each packed sequence."""
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        yield b, slice(cu[b], cu[b + 1])


def step_on_slots(step: Callable, state: torch.Tensor, slots: torch.Tensor | None, *args, **kw) -> torch.Tensor:
    """Run an in-place one-token ``step`` on rows ``slots`` of a state pool (or on ``state`` itself)."""
    if slots is None:
        return step(state, *args, **kw)
    rows = state[slots]
    y = step(rows, *args, **kw)
    state[slots] = rows
    return y
