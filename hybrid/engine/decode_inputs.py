"""A decode-only step's per-row inputs in buffers the model runner keeps across steps (vLLM's persistent batch).

A decode step on a CPU is one native program call (:mod:`hybrid.decode.program`) of a few milliseconds, and
whatever Python runs around it is paid on every token. Building a
:class:`~hybrid.engine.packed_batch.PackedBatch` for it
(a dozen small tensors, two groups, host values attached, the RoPE rows and the embedding looked up by torch ops)
took 0.2-0.3 ms of a batch-1 step, run with caches the step's weights had just evicted. Here the rows' token
ids, positions, K/V slots, KV lengths, block tables and state slots are written into ``array`` buffers that torch
tensors share (``torch.frombuffer``: no tensor is made per step), and the program gathers the embedding rows and
the RoPE rows itself.

What :func:`~hybrid.engine.packed_batch.build_batch` checks is checked here too, per row
(:meth:`~hybrid.cache.manager.CacheManager.decode_row`): the sequence holds its cache, and its blocks hold its new
token.
"""

from __future__ import annotations

import array

import torch

from ..cache.manager import CacheManager
from .packed_batch import SeqChunk


def _shared(typecode: str, n: int) -> tuple[array.array, torch.Tensor]:
    """A zeroed ``array`` of n items and a tensor over the same memory."""
    buf = array.array(typecode, bytes(n * array.array(typecode).itemsize))
    dtype = torch.int32 if typecode == "i" else torch.int64
    return buf, torch.frombuffer(buf, dtype=dtype)


class DecodeInputs:
    """Kept buffers for up to ``rows`` one-token rows: tokens, positions, kv_slots, state_slots (int64),
    seq_lens (int32) and block tables (int32 [rows, width], widened as sequences grow)."""

    def __init__(self, rows: int):
        self.rows = rows
        self._tok, self.tokens = _shared("q", rows)
        self._pos, self.positions = _shared("q", rows)
        self._slot, self.kv_slots = _shared("q", rows)
        self._state, self.state_slots = _shared("q", rows)
        self._len, self.seq_lens = _shared("i", rows)
        self.width = 0
        self._widen(1)
        self.n = 0
        self.max_position = 0

    def _widen(self, width: int) -> None:
        self.width = max(16, 1 << (width - 1).bit_length())
        self._table, flat = _shared("i", self.rows * self.width)
        self.tables = flat.view(self.rows, self.width)

    def fill(self, manager: CacheManager, chunks: list[SeqChunk]) -> None:
        """Write the rows of ``chunks`` (one token each, at most ``rows``); ValueError, as ``build_batch`` raises
        it, for a sequence that holds no cache or too few KV blocks for its token."""
        n = len(chunks)
        if not 0 < n <= self.rows or any(len(c.tokens) != 1 for c in chunks):
            raise ValueError(f"DecodeInputs.fill: 1..{self.rows} one-token chunks, got lengths "
                             f"{[len(c.tokens) for c in chunks]}")
        tables = []
        for r, c in enumerate(chunks):
            kv_len, slot, blocks, state = manager.decode_row(c.seq_id, c.start)
            self._tok[r] = c.tokens[0]
            self._pos[r] = c.start
            self._len[r] = kv_len
            self._slot[r] = slot
            self._state[r] = state
            tables.append(blocks)
        width = max(1, max((len(t) for t in tables), default=1))
        if width > self.width:
            self._widen(width)
        for r, t in enumerate(tables):  # a window's trim may change any entry: rewritten every step
            self._table[r * self.width:r * self.width + len(t)] = array.array("i", t)
        self.n = n
        self.max_position = max(self._pos[:n])

    def views(self) -> tuple[torch.Tensor, ...]:
        """tokens, positions, kv_slots, seq_lens, tables, state_slots of the filled rows."""
        n = self.n
        return (self.tokens[:n], self.positions[:n], self.kv_slots[:n], self.seq_lens[:n], self.tables[:n],
                self.state_slots[:n])
