"""Mamba state at every position of a verify chunk, so a rejected draft is rolled back without rerunning.

A verify chunk is a decoding sequence's last token followed by its draft tokens (k + 1 tokens). The Mamba
layers run such chunks from a *copy* of each sequence's state tensors (conv and SSM; any constant-state layer's
named states, :class:`hybrid.cache.views.StateCacheView`) and keep the state after every position in a scratch
buffer of this step (``[k+1, n, *state]`` per tensor and layer); the slots in the cache are not touched.
Mamba-1 runs the one-token step ops position by position (:meth:`VerifyStates.run`); Mamba-2 computes all
positions at once in closed form (:meth:`VerifyStates.run_chunk`,
:mod:`hybrid.kernels.mamba2_verify`). Once the engine knows how many drafts were accepted,
:meth:`hybrid.cache.manager.CacheManager.commit_verified` writes the state at the last accepted position into each slot.

A working copy of an int8 state is rounded after every position as its pool's write-back rounds
(:attr:`hybrid.cache.StatePool.rounding`), so a verify stepped position by position leaves the states one-token
decoding leaves (Mamba-2's closed form rounds once, at commit).

Extra memory per verify step: (k + 1) x (conv + SSM state bytes of one sequence) x verified sequences,
freed when the step ends. Extra time: one state copy per position (what the step ops write anyway) and
one gather per layer at commit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..cache.views import StateCacheView


class VerifyStates:
    """This step's verify chunks as the Mamba layers see them, and the per-position states they leave.

    ``lengths``: tokens of each verify chunk (2..k+1). Built once per step (host lists -> index tensors); the
    layers only index with them, so a verify step makes no device->host read inside the layers.
    """

    def __init__(self, lengths: list[int], slots: torch.Tensor, device):
        self.lengths = list(lengths)
        self.slots = slots  # [n] int64 state slots of the verify chunks
        n, steps = len(lengths), max(lengths)
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        # row of the packed verify group read at step j by chunk i (a finished chunk repeats its last token:
        # the state it then computes is never committed)
        self.rows_JN = torch.tensor([[s + min(j, length - 1) for s, length in zip(starts, lengths, strict=True)]
                                     for j in range(steps)], dtype=torch.long, device=device)
        # where each packed verify row's output sits in the stacked [steps * n] step outputs
        self.out_rows = torch.tensor([j * n + i for i, length in enumerate(lengths) for j in range(length)],
                                     dtype=torch.long, device=device)
        # the same in the [n, L] layout of a closed-form chunk
        self.chunk_rows = torch.tensor([i * steps + j for i, length in enumerate(lengths) for j in range(length)],
                                       dtype=torch.long, device=device)
        # per layer: its cache view and, per state tensor, the states after every position [steps, n, *state]
        self.layers: list[tuple[StateCacheView, tuple[torch.Tensor, ...]]] = []

    def run(self, cache: StateCacheView, inputs: tuple[torch.Tensor, ...],
            step: Callable[..., torch.Tensor]) -> torch.Tensor:
        """Run ``step(state, *inputs_at_one_position)`` (the layer's in-place one-token update of a
        :class:`~hybrid.cache.views.StateCacheView`, returning y [n, ...]) over every position of the verify
        chunks, starting from working copies of the slots' states in ``cache``; keep the states after each
        position. ``inputs``: the layer's per-token step inputs over the packed verify rows. Returns y over
        those rows."""
        work = cache.working_copy(self.slots)  # the slots stay as they were
        hist = tuple(torch.empty(len(self.rows_JN), *s.data.shape, dtype=s.dtype, device=s.data.device)
                     for s in work.stores)
        ys = []
        for j, rows in enumerate(self.rows_JN):
            ys.append(step(work, *(t[rows] for t in inputs)))
            for h, s in zip(hist, work.stores, strict=True):
                h[j] = s.data
        self.layers.append((cache, hist))
        return torch.cat(ys)[self.out_rows]

    def run_chunk(self, cache: StateCacheView, inputs: tuple[torch.Tensor, ...],
                  chunk: Callable[..., tuple[torch.Tensor, ...]]) -> torch.Tensor:
        """Like :meth:`run`, with the layer computing all positions at once: ``chunk(*states0, *inputs_padded)``
        gets the slots' states (one tensor per named state of ``cache``, in order) and the inputs padded to
        [n, L, ...] and returns (y [n, L, ...], then per state tensor its states [L, n, ...])."""
        rows_NL = self.rows_JN.t()
        y, *hist = chunk(*cache.read(self.slots), *(t[rows_NL] for t in inputs))
        self.layers.append((cache, tuple(hist)))
        return y.flatten(0, 1)[self.chunk_rows]

    @property
    def nbytes(self) -> int:
        """Scratch bytes the per-position states of this step take (all layers)."""
        return sum(h.nbytes for _, hist in self.layers for h in hist)
