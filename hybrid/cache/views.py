"""What a caching layer's packed forward is handed: one view of its own part of the inference cache.

Layers compute, views decide. A view already knows the storage dtype, the quantisation and the KV pruning of
its layer's cache, so a layer reads and writes through it and imports none of that policy
(:mod:`hybrid.cache.pruning`, :mod:`hybrid.kernels.kv_quant`, :mod:`hybrid.kernels.int8_state_step`). The cache
builds the views (:meth:`hybrid.cache.HybridCache.view`, one per caching layer, rebuilt when a pruning policy
is set); ``Block.forward`` hands ``cache.view(layer_index)`` to ``mixer.forward_packed``.

- :class:`AttentionCacheView` (attention, ``*``): the layer's paged K/V pools (a quantised pool with its
  per-token scales), the window and StreamingLLM sinks its queries see, SnapKV's query observer.
- :class:`StateCacheView` (any constant-state layer: Mamba's conv and SSM state, a linear-attention
  mixer's state matrices): the layer's named state tensors, each read, written and stepped through a store
  that knows its format (:class:`hybrid.cache.StatePool` in the cache, :class:`StateRows` for working copies).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import kernels
from .pruning import StreamingLLM


class AttentionQueries(NamedTuple):
    """A step's queries as the attention ops take them: ``q [T, Hq, D]`` (RoPE at the tokens' positions) and,
    where StreamingLLM re-numbers positions, ``sinks`` (the same queries rotated at their position in the
    cache's numbering, which score the sink keys; None otherwise)."""

    q: torch.Tensor
    sinks: torch.Tensor | None


class AttentionCacheView:
    """One attention layer's paged K/V, as its packed forward uses it, in this order:

    1. ``queries = view.queries(q, q_unrotated, batch, rope)``: ``q`` [T, Hq, D] with RoPE applied,
       ``q_unrotated`` the same before RoPE, ``rope`` the layer's :class:`~hybrid.layers.rope.RotaryEmbedding`.
       SnapKV's observer keeps the observation-window rows of ``q``; with StreamingLLM's re-numbering the
       view rotates ``q_unrotated`` a second time, at :meth:`hybrid.cache.pruning.StreamingLLM.sink_position`.
    2. ``view.write(k, v, slot_mapping)``: the new K/V [T, Hkv, D] (RoPE applied) into their pool slots
       (quantised with their per-token scales for an int8 / fp8 pool).
    3. ``view.decode(queries, batch.decode)`` and ``view.prefill(queries, batch.prefill)``: attention of the
       group's rows over their cached history through the block tables -> [rows, Hq, D], with the window
       (the layer's sliding window, or StreamingLLM's) and the sinks applied.

    ``window``: tokens a query sees (itself included; None: all); ``sinks``: StreamingLLM's attention sinks
    (None: no StreamingLLM); ``renumber``: whether ``queries`` adds the re-numbered copy; ``observe``: SnapKV's
    ``observe(batch, q)`` (:meth:`hybrid.cache.pruning.QueryCapture.layer`), or None.
    """

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, *, window: int | None = None, sinks: int | None = None,
                 renumber: bool = False, observe=None):
        self.k_pool, self.v_pool, self.k_scale, self.v_scale = k_pool, v_pool, k_scale, v_scale
        self.window, self.sinks, self.renumber, self.observe = window, sinks, renumber, observe
        # what every attention op call takes besides the queries and the group
        self._op_kw = dict(k_scale=k_scale, v_scale=v_scale)
        if sinks is not None:
            self._op_kw["sinks"] = sinks

    def queries(self, q: torch.Tensor, q_unrotated: torch.Tensor, batch, rope) -> AttentionQueries:
        if self.observe is not None:
            self.observe(batch, q)
        sinks = None
        if self.renumber and rope.rotary_dim:
            at = StreamingLLM.sink_position(batch.positions, self.sinks, self.window)
            sinks = rope(q_unrotated, *rope.cos_sin(at, q_unrotated.dtype))
        return AttentionQueries(q, sinks)

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        kernels.write_kv(self.k_pool, self.v_pool, k, v, slot_mapping, self.k_scale, self.v_scale)

    def _kw(self, queries: AttentionQueries, group) -> dict:
        if queries.sinks is None:
            return self._op_kw
        return {**self._op_kw, "q_sinks": queries.sinks[group.tokens]}

    def decode(self, queries: AttentionQueries, group) -> torch.Tensor:
        """The one-token sequences (a :class:`~hybrid.engine.packed_batch.SeqGroup`) -> [n, Hq, D]."""
        return kernels.paged_decode_attention(queries.q[group.tokens], self.k_pool, self.v_pool, group.seq_lens,
                                              group.block_tables, window=self.window, **self._kw(queries, group))

    def prefill(self, queries: AttentionQueries, group) -> torch.Tensor:
        """The prompts and prompt chunks (a :class:`~hybrid.engine.packed_batch.SeqGroup`) -> [rows, Hq, D]."""
        return kernels.paged_prefill_attention(queries.q[group.tokens], self.k_pool, self.v_pool, group.cu_seqlens,
                                               group.seq_lens, group.block_tables, window=self.window,
                                               **self._kw(queries, group))


class StateRows:
    """A state tensor held as plain rows, with no storage format of its own (a working copy: speculative
    verify steps the copies, not the cache). The same methods as :class:`hybrid.cache.StatePool`."""

    def __init__(self, data: torch.Tensor, rounding=None):
        self.data = data
        self.rounding = rounding  # (the source store's: rows -> rows as its write then read leaves them; None)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def read(self, slots) -> torch.Tensor:
        return self.data[slots]

    def write(self, slots, value: torch.Tensor) -> None:
        self.data[slots] = value

    def step(self, op, *args, slots: torch.Tensor | None = None, **kw) -> torch.Tensor:
        y = op(self.data, *args, slots=slots, **kw)
        if self.rounding is not None:  # what the source's step would have stored and read back
            self.data.copy_(self.rounding(self.data))
        return y


class StateCacheView:
    """One constant-state layer's per-sequence state: a tuple of named state tensors (``names``, in the order
    its spec lists them, :attr:`hybrid.cache.specs.ConstantStateSpec.states`: Mamba's ``("conv", "ssm")``; a
    linear-attention mixer would name its own, e.g. ``("conv", "recurrent")``), rows indexed by state slot.

    ``view[name]`` is that tensor's store, which reads and writes rows in the layer's compute dtype and
    knows the storage format (float, bf16, int8 with scales; stochastic rounding):

    - ``store.read(slots)`` -> the rows ``[n, *shape]`` (dequantised: fp32 for int8 storage);
    - ``store.write(slots, x)`` stores rows (quantised);
    - ``store.step(fn, *args, slots=slots, **kw)`` runs a one-token op that updates its state argument in
      place, ``fn(state, *args, slots=slots, **kw) -> y`` (``kernels.ssd_step``, ``causal_conv1d_step``...):
      on the storage itself for float rows, through the op's int8 kernel where it has one, else on a
      dequantised copy that is written back. A new op needs nothing here; an int8 kernel of its own is a line
      in :data:`hybrid.kernels.int8_state_step.FUSED_INT8_STEPS`;
    - ``store.dtype``: the dtype ``read`` returns.

    For all tensors at once: ``read(slots)`` -> a tuple of rows in ``names`` order, ``write(slots, states)``;
    ``working_copy(slots)`` -> a view over copies of those rows (:class:`StateRows`, slots ``0..n-1``) that
    steps them without touching the cache.
    """

    def __init__(self, names: tuple[str, ...], stores: tuple):
        if len(names) != len(stores):
            raise ValueError(f"StateCacheView: {len(names)} names {names} for {len(stores)} state stores")
        self.names, self.stores = tuple(names), tuple(stores)
        self._by_name = dict(zip(self.names, self.stores, strict=True))

    def __getitem__(self, name: str):
        return self._by_name[name]

    def read(self, slots) -> tuple[torch.Tensor, ...]:
        return tuple(s.read(slots) for s in self.stores)

    def write(self, slots, states: tuple[torch.Tensor, ...]) -> None:
        for store, value in zip(self.stores, states, strict=True):
            store.write(slots, value)

    def working_copy(self, slots) -> StateCacheView:
        # each copy rounds as its store writes back (a speculative verify steps it: hybrid.cache.StatePool.rounding)
        copies = tuple(StateRows(s.read(slots), getattr(s, "rounding", None)) for s in self.stores)
        return StateCacheView(self.names, copies)

