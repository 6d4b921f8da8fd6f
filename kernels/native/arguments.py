"""The one-line argument errors of the native ops (kernels/native/ops.py): each op's ``check_*`` function is the one
place its tensors' shapes, dtypes, devices and layouts are validated, and says what was wrong with
:func:`bad` — the op, the argument, what it got, what it needs — or returns None. The checks read only
metadata (never values), so they run on torch.compile's fake tensors as on real ones, and they are written as
plain comparisons because they run on every call of a decode step's ops (a message is built only on failure).
"""

from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.bfloat16)


def bad(op: str, arg: str, got: str, need: str) -> str:
    return f"hybrid::{op}: {arg} {got}; it needs {need}"


def shape(t: torch.Tensor) -> str:
    return f"has shape {list(t.shape)}"


def dtype(t: torch.Tensor) -> str:
    return f"is {t.dtype}"


def strides(t: torch.Tensor) -> str:
    return f"has strides {list(t.stride())} for shape {list(t.shape)}"


def off_cpu(op: str, names: str, *tensors: torch.Tensor | None) -> str | None:
    """The first tensor (named in the space-separated ``names``) that is not on the CPU, as an error."""
    for t in tensors:
        if t is not None and not t.is_cpu:  # (is_cpu: a tenth of device.type's cost, on every call of a step)
            name, t = next((n, u) for n, u in zip(names.split(), tensors, strict=True)
                           if u is not None and not u.is_cpu)
            return bad(op, name, f"is on {t.device}", "the CPU (the native ops are CPU kernels)")
    return None


def float_state(op: str, state: torch.Tensor, rows: int, slots: torch.Tensor | None, tail: tuple[int, ...]
                ) -> str | None:
    """A recurrent state: contiguous fp32/bf16 ``[rows, *tail]``, or with ``slots`` (int64 [rows]) a pool
    ``[S, *tail]`` whose rows ``slots`` are the batch's (slot values are the caller's: not read here)."""
    if state.dtype not in FLOATS:
        return bad(op, "state", dtype(state), "float32 or bfloat16")
    if not state.is_contiguous():
        return bad(op, "state", strides(state), "a contiguous tensor (it is updated in place)")
    if slots is not None:
        if slots.dtype != torch.int64 or slots.dim() != 1 or slots.shape[0] != rows or not slots.is_contiguous():
            return bad(op, "slots", f"is {slots.dtype} {list(slots.shape)} (strides {list(slots.stride())})",
                       f"contiguous int64 [{rows}] (one pool row per batch row)")
        if state.shape[1:] != tail:
            return bad(op, "state", shape(state), f"[pool rows, {', '.join(map(str, tail))}]")
    elif state.shape != (rows, *tail):
        return bad(op, "state", shape(state), f"{[rows, *tail]} (or pass slots into a pool)")
    return None


def inner_rows(op: str, name: str, t: torch.Tensor, dims: tuple[int, ...], dtypes=FLOATS) -> str | None:
    """``t`` of shape ``dims`` whose dims after the first are contiguous (rows may sit at any stride, e.g.
    slices of a projection's output), dtype among ``dtypes``."""
    size = t.shape
    if size != dims:
        return bad(op, name, shape(t), str(list(dims)))
    if t.dtype not in dtypes:
        return bad(op, name, dtype(t), " or ".join(str(d).removeprefix("torch.") for d in dtypes))
    stride = t.stride()
    expected = 1
    for d in range(len(dims) - 1, 0, -1):
        if size[d] > 1 and stride[d] != expected:
            return bad(op, name, strides(t), "each row contiguous (stride 1 in the last dim, packed dims after "
                                              "the first)")
        expected *= size[d]
    if dims and size[0] > 1 and stride[0] < expected:
        return bad(op, name, strides(t), f"rows at least {expected} elements apart")
    return None


def contiguous(op: str, name: str, t: torch.Tensor, dims: tuple[int, ...], dtypes=FLOATS) -> str | None:
    if t.shape != dims:
        return bad(op, name, shape(t), str(list(dims)))
    if t.dtype not in dtypes:
        return bad(op, name, dtype(t), " or ".join(str(d).removeprefix("torch.") for d in dtypes))
    if not t.is_contiguous():
        return bad(op, name, strides(t), "a contiguous tensor")
    return None
