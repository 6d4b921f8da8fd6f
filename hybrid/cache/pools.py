"""Inference cache storage, allocated from the layers' cache specs (:mod:`hybrid.cache.specs`) and accounted in bytes.

- :class:`PagedKVCache` for the attention layers (``*``): K/V pools of fixed-size blocks
  ``[num_blocks + 1, block_size, n_kv_heads, head_dim]`` per layer and one :class:`BlockAllocator` (free
  list + reference counts, so blocks can be shared). Block 0 is the reserved *null block*: never handed
  out, it is what a block table points at where a sliding window has dropped a block and where a padded
  batch row writes its throw-away K/V, so no live sequence's block is ever touched by either.
- :class:`SSMStateCache` for the Mamba layers (``M``, ``m``) and any other constant-state layer: per sequence
  *slot* the named state tensors of every such layer (Mamba: the conv state and the SSM state), plus one
  scratch row (index ``num_slots``) for padded batch rows.
- :class:`HybridCache` owns both, sized from a byte budget or an explicit block count.

Compressed caches (:mod:`hybrid.kernels.kv_quant`): an int8 / fp8 KV pool keeps ``scales[layer] =
(k_scale, v_scale)``, ``[num_blocks + 1, block_size, Hkv]`` (fp16, one per token slot and KV head) beside its
pages (a slot's scale is written with its codes and moves or is copied with them); an int8 state pool one
fp32 scale per head (group) of each row.

The layers see none of this: each caching layer gets one view of its part (:meth:`HybridCache.view`,
:mod:`hybrid.cache.views`) that reads and writes in the layer's compute dtype and applies the quantisation and
the pruning (an attention layer's window, StreamingLLM's sinks, SnapKV's observation); a constant-state
layer's rows go through :class:`StatePool` (``read`` / ``write`` / ``step``), so a compressed state costs each
layer no code of its own.

This module only stores and allocates; which sequence holds which blocks and slot is the business of
:class:`hybrid.cache.manager.CacheManager`, the one place that hands them out.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from ..config import HybridConfig
from ..kernels import int8_state_step, kv_quant
from ..layers.registry import cache_specs
from .pruning import QueryCapture, SnapKV, StreamingLLM
from .specs import CacheDtypes, ModelCacheSpec
from .views import AttentionCacheView, StateCacheView

NULL_BLOCK = 0


class CacheFullError(RuntimeError):
    """The cache has no room for what was asked; the caller may preempt and retry."""


class BlockAllocator:
    """Block ids ``1..num_blocks`` (0 is the null block) with a free list and per-block reference counts."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * (num_blocks + 1)
        self._free: deque[int] = deque(range(1, num_blocks + 1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks (reference count 1 each), or :class:`CacheFullError` taking none."""
        if n > len(self._free):
            raise CacheFullError(f"asked for {n} KV blocks, {len(self._free)} of {self.num_blocks} are free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, block: int) -> None:
        """One more owner of a live block (a prefix shared by two sequences)."""
        if block == NULL_BLOCK or self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free or the null block; only a live block can be shared")
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block with none left returns to the free list."""
        for b in blocks:
            if b == NULL_BLOCK or self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} released more often than it was allocated or shared")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)


class PagedKVCache:
    """K/V pools for the attention layers: ``pools[layer_index] = (k_pool, v_pool)``.

    Token ``p`` of a sequence lives at slot ``table[p // block_size] * block_size + p % block_size`` of the
    flattened pool. A model without attention layers gets no pools and unlimited token capacity.
    """

    def __init__(self, spec: ModelCacheSpec, num_blocks: int, *, block_size: int = 16,
                 device: str | torch.device = "cpu"):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        layers = spec.attention
        self.layer_indices = sorted(layers)
        self.block_size = block_size
        self.window = spec.window
        self.sinks = 0  # StreamingLLM pruning (set_pruning): the first `sinks` tokens stay beside the window
        self.pruning = None
        self.capture = None  # SnapKV: the observation-window queries the attention layers hand over
        self.pruned_blocks = 0  # blocks pruning gave back to the pool (StreamingLLM trims, SnapKV compactions)
        self.compressed_sequences = 0  # SnapKV compactions
        self.num_blocks = num_blocks if layers else 0
        physical = self.num_blocks + 1 if layers else 0  # + the null block
        self.pools = {i: tuple(torch.zeros(s.pool_shape(physical, block_size), dtype=s.dtype, device=device)
                               for _ in "kv") for i, s in layers.items()}
        # quantised layers: a scale per token slot and KV head, [physical, block_size, Hkv] for K and for V. A
        # slot's scale is written with its codes, and attention reads only written slots, so a block handed out
        # again needs no reset (what its last owner left is never read)
        self.scales = {i: tuple(torch.zeros(physical, block_size, s.n_kv_heads, dtype=s.scale_dtype, device=device)
                                for _ in "kv")
                       for i, s in layers.items() if kv_quant.is_quantized(s.dtype)}
        self.allocator = BlockAllocator(self.num_blocks)
        self.bytes_per_token = spec.kv_bytes_per_token
        self.bytes_per_block = spec.kv_bytes_per_block(block_size)
        self.physical_blocks = physical
        self.dtype = next(iter(layers.values())).dtype if layers else None
        self.views = self._views()

    @property
    def quantized(self) -> bool:
        return bool(self.scales)

    def _views(self) -> dict[int, AttentionCacheView]:
        """Each attention layer's view: its pools and scales, the window, and the pruning policy's part (the
        sinks and whether positions are re-numbered for StreamingLLM, :mod:`hybrid.cache.pruning`; the layer's
        query observer for SnapKV, :meth:`hybrid.cache.pruning.QueryCapture.layer`)."""
        streaming = self.pruning is not None and self.capture is None
        return {i: AttentionCacheView(*self.pools[i], *self.scales.get(i, (None, None)), window=self.window,
                                      sinks=self.sinks if streaming else None,
                                      renumber=streaming and bool(self.sinks) and self.pruning.renumber,
                                      observe=None if self.capture is None else self.capture.layer(i))
                for i in self.layer_indices}

    def set_pruning(self, policy) -> None:
        """A :class:`hybrid.cache.pruning.StreamingLLM` attends only to ``policy.sinks`` first tokens and the last
        ``policy.window``: blocks between go back to the pool as sequences grow. A
        :class:`hybrid.cache.pruning.SnapKV` compresses each prompt longer than its budget once it is prefilled
        (:meth:`compact`)."""
        if isinstance(policy, SnapKV):
            if self.window is not None:
                raise ValueError(f"SnapKV on a sliding-window model (window {self.window}) is not supported: a "
                                 "compressed sequence's window would count kept slots, not positions; use "
                                 "StreamingLLM or no pruning")
            self.pruning, self.capture = policy, QueryCapture()
        elif isinstance(policy, StreamingLLM):
            self.pruning = policy
            self.window = policy.window if self.window is None else min(self.window, policy.window)
            self.sinks = policy.sinks
        else:
            raise TypeError(f"kv_pruning must be a hybrid.cache.pruning.StreamingLLM or SnapKV, "
                            f"got {type(policy).__name__}")
        self.views = self._views()  # the layers' views apply the policy

    @property
    def snapkv(self) -> SnapKV | None:
        return self.pruning if self.capture is not None else None

    def keys(self, i: int, blocks: list[int], n: int) -> torch.Tensor:
        """The first ``n`` cached keys of layer ``i`` held in ``blocks`` (a block table), fp32 [n, Hkv, D]."""
        k_pool, bs = self.pools[i][0], self.block_size
        idx = torch.tensor(blocks[:-(-n // bs)], dtype=torch.long, device=k_pool.device)
        pages = k_pool[idx]
        scale = self.scales[i][0][idx] if i in self.scales else None
        return kv_quant.dequantize_pages(pages, scale, torch.float32).reshape(-1, *k_pool.shape[2:])[:n]

    def compact(self, blocks: list[int], kept: dict[int, torch.Tensor]) -> None:
        """Move each layer's kept tokens to the front of ``blocks``: ``kept[layer] [Hkv, n]`` lists per KV head
        the token indices (into ``blocks``) to keep, and slot ``j`` then holds, for every head ``h``, head
        ``h``'s ``kept[layer][h, j]``-th token. All kept tokens are read before any is written, so the move is
        in place; a quantised layer's codes move with their per-token scales, exactly (nothing is
        re-quantised)."""
        bs = self.block_size
        for i, idx in kept.items():
            device = self.pools[i][0].device
            table = torch.tensor(blocks, dtype=torch.long, device=device)
            Hkv, n = idx.shape
            src = table[idx // bs] * bs + idx % bs  # [Hkv, n] flat slots
            heads = torch.arange(Hkv, device=device)
            front = torch.arange(n, device=device)
            dst = table[front // bs] * bs + front % bs
            # codes or values [NB, BS, Hkv, D], and a quantised layer's scales [NB, BS, Hkv]
            for t in (*self.pools[i], *self.scales.get(i, ())):
                flat = _raw(t).view(-1, *t.shape[2:])
                flat.index_copy_(0, dst, flat[src.T, heads[None, :]])  # gathered (a copy) before the write

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K/V (and scales) of every layer into ``dst`` (copy on write of a partial block)."""
        for k_pool, v_pool in self.pools.values():
            k_pool[dst].copy_(k_pool[src])
            v_pool[dst].copy_(v_pool[src])
        for k_scale, v_scale in self.scales.values():
            k_scale[dst].copy_(k_scale[src])
            v_scale[dst].copy_(v_scale[src])

    @property
    def enabled(self) -> bool:
        return bool(self.layer_indices)

    @property
    def capacity_tokens(self) -> float:
        return self.num_blocks * self.block_size if self.enabled else math.inf

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size) if self.enabled else 0

    def blocks_held_at_most(self, n_tokens: int, chunk: int, prompt_len: int | None = None) -> int:
        """The most blocks a sequence growing to ``n_tokens`` in steps of at most ``chunk`` new
        tokens holds at once (all of them, unless a sliding window lets blocks behind it go, or SnapKV
        compresses its ``prompt_len``-token prompt: then the prompt's blocks or the budget's and the rest's)."""
        full = self.blocks_for(n_tokens)
        snap = self.snapkv
        if snap is not None and prompt_len is not None and snap.compresses(prompt_len):
            return min(full, max(self.blocks_for(prompt_len), self.blocks_for(snap.budget + n_tokens - prompt_len)))
        if self.window is None:
            return full
        # window - 1 visible earlier tokens + the chunk, over at most one partial block at each end (+ the sinks')
        return min(full, self.blocks_for(self.window - 1 + min(chunk, n_tokens)) + 1 + self.blocks_for(self.sinks))

    @property
    def bytes_total(self) -> int:
        """Bytes the pools really hold (the null block included)."""
        return self.physical_blocks * self.bytes_per_block

    @property
    def bytes_in_use(self) -> int:
        return (self.num_blocks - self.allocator.num_free) * self.bytes_per_block


def _raw(pool: torch.Tensor) -> torch.Tensor:
    """fp8 pages seen as bytes (CPU has no fp8 indexing kernels; moving the bits is the same)."""
    return pool.view(torch.uint8) if pool.dtype == kv_quant.FP8 else pool


class StatePool:
    """The pool of one named state tensor of one constant-state layer (Mamba: conv or SSM): rows
    ``[S + 1, *shape]`` in the storage dtype, and for int8 one fp32 scale per group of each row
    (``scale [S + 1, groups]``). The layers read and write rows through it (their cache view's store,
    :class:`hybrid.cache.views.StateCacheView`), always in fp32 or the storage float dtype:

    - ``read(slots)`` -> the rows (dequantised); ``write(slots, value)`` stores them (quantised);
    - ``step(op, *args, slots=slots, **kw)`` runs an in-place one-token kernel (``ssd_step``, ...) on the
      rows: on the pool itself for float storage (exactly the kernel call of an uncompressed cache); for
      int8, the op's own int8 step where it has one (``ssd_step`` ->
      :func:`hybrid.kernels.int8_state_step.ssd_step_int8`, ``selective_step`` -> ``selective_step_int8``, on
      the codes), else on a dequantised copy that is written back (the conv step).

    ``pool[slots]`` / ``pool[slots] = value`` are ``read`` / ``write``. ``stochastic`` rounds writes of
    int8 and bf16 rows stochastically (unbiased) instead of to nearest.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, num_rows: int, groups: int, *,
                 stochastic: bool = False, device: str | torch.device = "cpu"):
        self.data = torch.zeros(num_rows, *shape, dtype=dtype, device=device)
        self.quantized = kv_quant.is_quantized(dtype)
        self.groups = groups
        self.scale = torch.zeros(num_rows, groups, device=device) if self.quantized else None
        self.stochastic = stochastic

    @property
    def dtype(self) -> torch.dtype:
        """The dtype ``read`` returns (what a layer computes in): fp32 for int8 storage."""
        return torch.float32 if self.quantized else self.data.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        if not self.quantized:
            return self.data[slots]
        return kv_quant.dequantize_rows(self.data[slots], self.scale[slots])

    def write(self, slots: torch.Tensor, value: torch.Tensor) -> None:
        if self.quantized:
            q, s = kv_quant.quantize_rows(value, self.groups, stochastic=self.stochastic)
            self.data[slots] = q
            self.scale[slots] = s
        elif self.stochastic and self.data.dtype == torch.bfloat16:
            self.data[slots] = kv_quant.bf16_stochastic(value)
        else:
            self.data[slots] = value.to(self.data.dtype)

    __getitem__ = read
    __setitem__ = write

    @property
    def rounding(self):
        """What a write then a read does to rows (``fn(rows) -> rows``, int8 storage), or None where it leaves
        them as they are (float storage, stepped in its own dtype) or cannot be repeated (stochastic rounding).
        A speculative verify steps a working copy of the rows position by position and rounds it with this
        after each, as this pool's step rounds the rows it writes back: the same states as decoding one token at
        a time, by construction."""
        if not self.quantized or self.stochastic:
            return None
        return lambda rows: kv_quant.dequantize_rows(*kv_quant.quantize_rows(rows, self.groups)).to(rows.dtype)

    def step(self, op, *args, slots: torch.Tensor, **kw) -> torch.Tensor:
        if not self.quantized and not self.stochastic:
            return op(self.data, *args, slots=slots, **kw)
        if self.quantized and not self.stochastic and self._fused_layout():
            fused = int8_state_step.fused_int8_step(op)  # the step on the codes: no dequantised copy of the rows
            if fused is not None:
                return fused(self.data, self.scale, *args, slots=slots, **kw)
        rows = self.read(slots).float()
        y = op(rows, *args, **kw)
        self.write(slots, rows)
        return y

    def _fused_layout(self) -> bool:
        """Whether the scales have the layout the fused int8 steps take: one per last-dimension row of a Mamba-2
        state ``[H, P, N]``, or one per group of whole channels of a Mamba-1 state ``[d_inner, N]``."""
        if self.data.dim() == 4:
            return self.groups == self.data.shape[1] * self.data.shape[2]
        return self.data.dim() == 3 and self.data.shape[1] % self.groups == 0

    def zero_(self, slot: int) -> None:
        self.data[slot].zero_()
        if self.scale is not None:
            self.scale[slot].zero_()

    def copy_row(self, src: int, dst: int) -> None:
        self.data[dst].copy_(self.data[src])
        if self.scale is not None:
            self.scale[dst].copy_(self.scale[src])

    def save_row(self, slot: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A copy of row ``slot`` as stored (codes and scales): a prefix-cache checkpoint."""
        return self.data[slot].clone(), None if self.scale is None else self.scale[slot].clone()

    def load_row(self, slot: int, saved: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        self.data[slot].copy_(saved[0])
        if self.scale is not None:
            self.scale[slot].copy_(saved[1])


class SSMStateCache:
    """The states of the constant-state layers (Mamba, and any layer with a
    :class:`~hybrid.cache.specs.ConstantStateSpec`): per layer one pool per named state tensor, ``pools[layer_index] =
    (conv_pool [S+1, ...], ssm_pool [S+1, ...])`` for Mamba, for ``S = num_slots`` sequence slots and one
    scratch row (index ``S``) that padded batch rows update.

    A slot is zeroed when handed out, which is the state of an empty sequence, so a fresh prefill and a
    continued one run the same code. ``state_pools`` holds the :class:`StatePool` objects, ``pools`` their
    storage tensors, ``views`` each layer's :class:`~hybrid.cache.views.StateCacheView` over its pools (what
    the layer gets).
    """

    def __init__(self, spec: ModelCacheSpec, num_slots: int, *, stochastic: bool = False,
                 device: str | torch.device = "cpu"):
        if num_slots < 1:
            raise ValueError(f"num_slots (the most sequences in flight) must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        rows = num_slots + 1
        self.state_pools = {i: tuple(StatePool(t.shape, t.dtype, rows, t.groups, stochastic=stochastic, device=device)
                                     for t in s.states)
                            for i, s in spec.mamba.items()}
        self.pools = {i: tuple(p.data for p in pools) for i, pools in self.state_pools.items()}
        self.views = {i: StateCacheView(tuple(t.name for t in s.states), self.state_pools[i])
                      for i, s in spec.mamba.items()}
        self.bytes_per_sequence = spec.state_bytes_per_sequence
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free slot, zeroed, or :class:`CacheFullError`."""
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} state slots are in use")
        slot = self._free.popleft()
        for pools in self.state_pools.values():
            for pool in pools:
                pool.zero_(slot)
        return slot

    def copy(self, src: int, dst: int) -> None:
        for pools in self.state_pools.values():
            for pool in pools:
                pool.copy_row(src, dst)

    def set_stores(self, i: int, stores: tuple) -> None:
        """Hold layer ``i``'s state tensors in ``stores`` (objects with :class:`StatePool`'s methods, one per
        named tensor, in order) instead: a benchmark's own storage formats."""
        self.state_pools[i] = tuple(stores)
        self.views[i] = StateCacheView(self.views[i].names, self.state_pools[i])

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} is not in use")
        self._free.append(slot)

    @property
    def bytes_total(self) -> int:
        """Bytes the pools really hold (the scratch row included)."""
        return (self.num_slots + 1) * self.bytes_per_sequence

    @property
    def bytes_in_use(self) -> int:
        return (self.num_slots - len(self._free)) * self.bytes_per_sequence


@dataclass(frozen=True)
class CacheReport:
    kv_bytes_per_token: int  # K/V bytes, a quantised pool's per-token scales included
    state_bytes_per_sequence: int  # conv + SSM state, scales included
    bytes_total: int
    bytes_in_use: int
    bytes_free: int
    token_capacity: float
    max_sequences: int
    kv_blocks_total: int
    kv_blocks_in_use: int
    state_slots_in_use: int
    # the prefix cache (all 0 without one): tree nodes, KV blocks the tree references (of kv_blocks_in_use;
    # those only the tree holds can be evicted), Mamba state checkpoints and the bytes they take
    prefix_nodes: int = 0
    prefix_blocks: int = 0
    prefix_blocks_evictable: int = 0
    prefix_kv_bytes: int = 0
    prefix_checkpoints: int = 0
    prefix_checkpoint_capacity: int = 0
    prefix_state_bytes: int = 0
    kv_dtype: str = ""  # storage dtypes (int8 / fp8 / bfloat16 ...)
    conv_dtype: str = ""
    ssm_dtype: str = ""
    kv_bytes_per_block: int = 0  # one block across all attention layers, scales included
    block_size: int = 0
    kv_pruning: str = ""  # the engine's pruning policy (repr), "" for none
    kv_blocks_pruned: int = 0  # blocks pruning gave back to the pool so far (StreamingLLM trims, SnapKV)
    kv_sequences_compressed: int = 0  # prompts SnapKV compressed so far (recomputes after preemption included)

    def bytes_per_sequence(self, seq_len: int) -> int:
        """Bytes one sequence of ``seq_len`` tokens holds in this cache (whole blocks, scales, its state)."""
        blocks = -(-seq_len // self.block_size) if self.kv_blocks_total else 0
        return blocks * self.kv_bytes_per_block + self.state_bytes_per_sequence


class HybridCache:
    """Both caches of one model, sized from ``cache_bytes`` or an explicit ``num_blocks``.

    With ``cache_bytes`` the state slots of ``max_seqs`` sequences (and the scratch row) are set aside
    first and the rest becomes KV blocks (the null block included), so a model with few attention layers
    gets many more tokens. Storage dtypes: ``kv_dtype`` for K/V, ``conv_dtype`` (default ``kv_dtype``) for
    the conv state, ``ssm_dtype`` (default fp32) for the SSM state; K/V may be ``int8`` / ``fp8`` (e4m3)
    and the states ``int8`` / ``bfloat16`` (names or torch dtypes; see :func:`cache_dtypes`), so the
    state set aside shrinks and the KV pool of the same budget grows. ``stochastic_state`` rounds int8 /
    bf16 state writes stochastically.
    """

    def __init__(self, config: HybridConfig, *, num_blocks: int | None = None, cache_bytes: int | None = None,
                 max_seqs: int = 16, block_size: int = 16, kv_dtype: torch.dtype | str = torch.float32,
                 ssm_dtype: torch.dtype | str = torch.float32, conv_dtype: torch.dtype | str | None = None,
                 stochastic_state: bool = False, device: str | torch.device = "cpu"):
        if (num_blocks is None) == (cache_bytes is None):
            raise ValueError("size the cache with exactly one of num_blocks= or cache_bytes=")
        self.config, self.device = config, torch.device(device)
        self.dtypes = _storage_dtypes(kv_dtype, conv_dtype, ssm_dtype)
        self.spec = cache_specs(config, self.dtypes)
        self.ssm = SSMStateCache(self.spec, max_seqs, stochastic=stochastic_state, device=device)
        if num_blocks is None:
            kv_budget = cache_bytes - self.ssm.bytes_total
            per_block = self.spec.kv_bytes_per_block(block_size)
            has_kv = bool(self.spec.attention)
            if kv_budget < 0 or (has_kv and kv_budget < 2 * per_block):
                raise ValueError(
                    f"cache_bytes={cache_bytes} is too small: the state of {max_seqs} sequences (+1 scratch row) "
                    f"takes {self.ssm.bytes_total} bytes and the KV pool at least {2 * per_block} more (one block "
                    "and the null block); raise cache_bytes or lower max_seqs")
            num_blocks = kv_budget // per_block - 1 if has_kv else 0
        self.kv = PagedKVCache(self.spec, num_blocks, block_size=block_size, device=device)
        self.prefix = None  # the engine's PrefixCache (hybrid.cache.prefix), when prefix caching is on

    @classmethod
    def for_model(cls, model, **kw) -> HybridCache:
        """A cache on the model's device, K/V and conv state in the model's dtype (SSM state fp32) unless
        the dtypes are given."""
        p = next(model.parameters())
        if kw.get("kv_dtype") is None:
            kw["kv_dtype"] = p.dtype
        if kw.get("conv_dtype") is None and kv_quant.is_quantized(
                kv_quant.parse_dtype(kw["kv_dtype"], kv_quant.KV_DTYPES, "kv_dtype")):
            kw["conv_dtype"] = p.dtype  # int8 / fp8 K/V: the conv state stays in the model's dtype unless asked
        if kw.get("ssm_dtype") is None:
            kw["ssm_dtype"] = torch.float32
        return cls(model.config, device=p.device, **kw)

    def view(self, i: int) -> AttentionCacheView | StateCacheView:
        """Layer ``i``'s view of its cache (what its ``forward_packed`` takes): an attention layer's
        :class:`~hybrid.cache.views.AttentionCacheView`, a constant-state layer's
        :class:`~hybrid.cache.views.StateCacheView`."""
        view = self.kv.views.get(i)
        return view if view is not None else self.ssm.views[i]

    @property
    def bytes_total(self) -> int:
        return self.kv.bytes_total + self.ssm.bytes_total

    def report(self) -> CacheReport:
        used = self.kv.bytes_in_use + self.ssm.bytes_in_use
        prefix = {}
        if self.prefix is not None:
            p, blocks = self.prefix, self.prefix.blocks_held()
            prefix = dict(prefix_nodes=p.num_nodes, prefix_blocks=len(blocks),
                          prefix_blocks_evictable=sum(self.kv.allocator.ref_counts[b] == 1 for b in blocks),
                          prefix_kv_bytes=len(blocks) * self.kv.bytes_per_block,
                          prefix_checkpoints=len(p.checkpoints.saved),
                          prefix_checkpoint_capacity=p.checkpoints.capacity,
                          prefix_state_bytes=p.checkpoints.bytes_in_use)
        d = self.dtypes
        return CacheReport(**prefix, kv_dtype=kv_quant.dtype_name(d.kv), conv_dtype=kv_quant.dtype_name(d.conv),
                           ssm_dtype=kv_quant.dtype_name(d.ssm), kv_bytes_per_block=self.kv.bytes_per_block,
                           block_size=self.kv.block_size, kv_bytes_per_token=self.kv.bytes_per_token,
                           state_bytes_per_sequence=self.ssm.bytes_per_sequence, bytes_total=self.bytes_total,
                           bytes_in_use=used, bytes_free=self.bytes_total - used,
                           token_capacity=self.kv.capacity_tokens, max_sequences=self.ssm.num_slots,
                           kv_blocks_total=self.kv.num_blocks,
                           kv_blocks_in_use=self.kv.num_blocks - self.kv.allocator.num_free,
                           state_slots_in_use=self.ssm.num_slots - self.ssm.num_free,
                           kv_pruning="" if self.kv.pruning is None else repr(self.kv.pruning),
                           kv_blocks_pruned=self.kv.pruned_blocks,
                           kv_sequences_compressed=self.kv.compressed_sequences)


def _storage_dtypes(kv_dtype, conv_dtype, ssm_dtype) -> CacheDtypes:
    """Parsed storage dtypes; the conv state defaults to a float ``kv_dtype``, else (int8 / fp8 K/V) fp32."""
    kv = kv_quant.parse_dtype(kv_dtype, kv_quant.KV_DTYPES, "kv_dtype")
    conv = kv_quant.parse_dtype(conv_dtype, kv_quant.KV_DTYPES, "conv_dtype")
    if conv is None:
        conv = torch.float32 if kv_quant.is_quantized(kv) else kv
    if conv == kv_quant.FP8:
        raise ValueError("conv_dtype fp8 is not supported: the conv state takes float32, bfloat16, float16 or int8")
    return CacheDtypes(kv=kv, conv=conv, ssm=kv_quant.parse_dtype(ssm_dtype, kv_quant.STATE_DTYPES, "ssm_dtype"))


def cache_dtypes(model_dtype: torch.dtype, kv_dtype: torch.dtype | str | None = None,
                 state_dtype: torch.dtype | str | None = None) -> CacheDtypes:
    """The storage dtypes of an engine's cache from its ``kv_dtype`` / ``state_dtype`` choices (names or
    torch dtypes; None: today's defaults, K/V in the model's dtype, SSM state fp32, conv state in the
    model's dtype). ``state_dtype`` sets the SSM state and the conv state, except ``float32``, which keeps the
    conv state (raw recent inputs, exact in the model's dtype) in the model's dtype, and ``int8``, which also
    keeps it in the model's dtype: int8 conv rows were most of the int8 state's error
    (eval/state_drift_bench.py: KL 1e-4 against 1e-6 for the int8 SSM state, top-1 99.69% against 99.98% on
    a trained 1:7 hybrid) for 1% of its bytes (bf16 models: 2 bytes a value)."""
    kv = kv_quant.parse_dtype(kv_dtype, kv_quant.KV_DTYPES, "kv_dtype") or model_dtype
    state = kv_quant.parse_dtype(state_dtype, kv_quant.STATE_DTYPES, "state_dtype")
    conv = model_dtype if state in (None, torch.float32) else state
    if state == torch.int8:
        conv = model_dtype
    if state is None and kv_dtype is not None and not kv_quant.is_quantized(kv):
        conv = kv  # as HybridCache's conv_dtype default: the conv state follows a float K/V dtype
    return CacheDtypes(kv=kv, conv=conv, ssm=state or torch.float32)


def sequences_that_fit(config: HybridConfig, cache_bytes: int, seq_len: int, *, block_size: int = 16,
                       kv_dtype: torch.dtype | str = torch.bfloat16, ssm_dtype: torch.dtype | str = torch.float32,
                       conv_dtype: torch.dtype | str | None = None, chunk: int | None = None) -> int:
    """How many sequences of ``seq_len`` tokens a cache of ``cache_bytes`` holds at once (each needs its
    KV blocks and one state slot; the cache's null block and scratch row are paid for first). With ``chunk``
    (the engine's token budget per step) a sliding-window model is counted with only the blocks its
    window keeps. Dtypes as :class:`HybridCache` takes them (block and state scales counted)."""
    spec = cache_specs(config, _storage_dtypes(kv_dtype, conv_dtype, ssm_dtype))
    kv = PagedKVCache(spec, 0, block_size=block_size, device="meta")
    blocks = kv.blocks_for(seq_len) if chunk is None else kv.blocks_held_at_most(seq_len, chunk)
    per_seq = blocks * kv.bytes_per_block + spec.state_bytes_per_sequence
    fixed = (kv.bytes_per_block if kv.enabled else 0) + spec.state_bytes_per_sequence  # null block + scratch row
    return max(0, cache_bytes - fixed) // per_seq
