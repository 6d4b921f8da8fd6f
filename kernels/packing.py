"""Small helpers shared by the torch paths of the packed (varlen) and slot-indexed ops.

Packed ops need sequence boundaries on the host (to slice per sequence) while the tensors live on the
device; reading them back in every layer is a device->host sync per op. The engine's model runner
builds each step's metadata once, validates it once, and attaches the host values to the tensors with
:func:`with_host_values`; ops then read :func:`host_values` without a copy and skip re-validation
(``HYBRID_DEBUG_CHECKS=1`` re-validates anyway). A tensor without attached values (a direct call of a
public op) is validated and read back as before.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch

_HOST = "_hybrid_host_values"
DEBUG_CHECKS = os.environ.get("HYBRID_DEBUG_CHECKS", "") not in ("", "0")


def with_host_values(t: torch.Tensor, values: tuple[int, ...]) -> torch.Tensor:
    """Attach ``values`` (== ``t.tolist()``, already validated by the caller) to ``t``; returns ``t``."""
    setattr(t, _HOST, tuple(values))
    return t


def host_values(t: torch.Tensor) -> tuple[int, ...]:
    """The values of a small 1-d int tensor on the host: attached ones if any, else read back (a sync)."""
    values = getattr(t, _HOST, None)
    return values if values is not None else tuple(t.tolist())


def attached_values(t: torch.Tensor) -> tuple[int, ...] | None:
    """The host values attached to ``t`` by :func:`with_host_values`, or None (never reads the tensor)."""
    return getattr(t, _HOST, None)


def is_trusted(t: torch.Tensor) -> bool:
    return getattr(t, _HOST, None) is not None and not DEBUG_CHECKS


def check_cu_seqlens(cu_seqlens: torch.Tensor, total: int, op: str) -> None:
    if is_trusted(cu_seqlens):  # validated once per step by whoever attached the host values
        return
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: cu_seqlens must be [B+1] with B >= 1, got shape {tuple(cu_seqlens.shape)}")
    cu = host_values(cu_seqlens)
    if cu[0] != 0 or cu[-1] != total or any(b <= a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"{op}: cu_seqlens must rise strictly from 0 to the {total} packed tokens, got {list(cu)}")


def sequences(cu_seqlens: torch.Tensor) -> Iterator[tuple[int, slice]]:
    """(index, token slice) of each packed sequence."""
    cu = host_values(cu_seqlens)
    for b in range(len(cu) - 1):
        yield b, slice(cu[b], cu[b + 1])


def slot_rows(state: torch.Tensor, slots: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """The rows ``slots`` of a state pool to update in place, and whether they must be scattered back.

    When the slots' host values say they are one increasing run (always at batch 1, often beyond) the
    rows are a view of the pool: updated where they live, no gather and no scatter (a decode step is
    bound by moving the state). Otherwise (or under torch.compile, which fuses the copies) a gathered copy.
    """
    if slots is None:
        return state, False
    run = getattr(slots, _HOST, None)
    if run and not torch.compiler.is_compiling() and all(b == a + 1 for a, b in zip(run, run[1:], strict=False)):
        return state.narrow(0, run[0], len(run)), False
    return state[slots], True


def step_on_slots(step: Callable, state: torch.Tensor, slots: torch.Tensor | None, *args, **kw) -> torch.Tensor:
    """Run an in-place one-token ``step`` on rows ``slots`` of a state pool (or on ``state`` itself)."""
    rows, scatter = slot_rows(state, slots)
    y = step(rows, *args, **kw)
    if scatter:
        state.index_copy_(0, slots, rows)
    return y
