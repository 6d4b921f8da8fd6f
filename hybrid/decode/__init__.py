"""Decode backends: how a decode-only step (every row one new token) runs, chosen in one place.

:mod:`.backend` defines the interface (``supports(model, cache, shape) -> None or why not``), and the backends
are, in the order the model runner asks them: :mod:`.compiled` (``torch.compile``, with ``compile=True``),
:mod:`.native_program` (the native decode program whole, or one sub-layer at a time), :mod:`.eager` (the torch
layers; takes every step). Each layer kind lowers its own sub-layer into the program (``lower_decode``, beside the
layer; :mod:`.builder` is what it is handed). The model and the layers import none of this.
"""

from __future__ import annotations

from .backend import DecodeBackend, DecodeShape, choose, describe, verdicts

__all__ = ["DecodeBackend", "DecodeShape", "choose", "describe", "verdicts"]
