"""Inference cache storage, allocated from the layers' cache specs (:mod:`hybrid.specs`) and accounted in bytes.

- :class:`PagedKVCache` for the attention layers (``*``): K/V pools of fixed-size blocks
  ``[num_blocks + 1, block_size, n_kv_heads, head_dim]`` per layer and one :class:`BlockAllocator` (free
  list + reference counts, so blocks can be shared). Block 0 is the reserved *null block*: never handed
  out, it is what a block table points at where a sliding window has dropped a block and where a padded
  batch row writes its throw-away K/V, so no live sequence's block is ever touched by either.
- :class:`SSMStateCache` for the Mamba layers (``M``, ``m``): per sequence *slot* the conv state and the SSM
  state of every Mamba layer, plus one scratch row (index ``num_slots``) for padded batch rows.
- :class:`HybridCache` owns both, sized from a byte budget or an explicit block count.

This module only stores and allocates; which sequence holds which blocks and slot is the business of
:class:`hybrid.cache_manager.CacheManager`, the one place that hands them out.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from .config import HybridConfig
from .specs import CacheDtypes, ModelCacheSpec, cache_specs

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
        self.num_blocks = num_blocks if layers else 0
        physical = self.num_blocks + 1 if layers else 0  # + the null block
        self.pools = {i: tuple(torch.zeros(s.pool_shape(physical, block_size), dtype=s.dtype, device=device)
                               for _ in "kv") for i, s in layers.items()}
        self.allocator = BlockAllocator(self.num_blocks)
        self.bytes_per_token = spec.kv_bytes_per_token
        self.bytes_per_block = self.bytes_per_token * block_size
        self.physical_blocks = physical

    @property
    def enabled(self) -> bool:
        return bool(self.layer_indices)

    @property
    def capacity_tokens(self) -> float:
        return self.num_blocks * self.block_size if self.enabled else math.inf

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size) if self.enabled else 0

    def blocks_held_at_most(self, n_tokens: int, chunk: int) -> int:
        """The most blocks a sequence growing to ``n_tokens`` in steps of at most ``chunk`` new
        tokens holds at once (all of them, unless a sliding window lets blocks behind it go)."""
        full = self.blocks_for(n_tokens)
        if self.window is None:
            return full
        # window - 1 visible earlier tokens + the chunk, over at most one partial block at each end
        return min(full, self.blocks_for(self.window - 1 + min(chunk, n_tokens)) + 1)

    @property
    def bytes_total(self) -> int:
        """Bytes the pools really hold (the null block included)."""
        return self.physical_blocks * self.bytes_per_block

    @property
    def bytes_in_use(self) -> int:
        return (self.num_blocks - self.allocator.num_free) * self.bytes_per_block


class SSMStateCache:
    """Conv and SSM states of the Mamba layers: ``pools[layer_index] = (conv_pool [S+1, ...], ssm_pool [S+1, ...])``
    for ``S = num_slots`` sequence slots and one scratch row (index ``S``) that padded batch rows update.

    A slot is zeroed when handed out, which is the state of an empty sequence, so a fresh prefill and a
    continued one run the same code.
    """

    def __init__(self, spec: ModelCacheSpec, num_slots: int, *, device: str | torch.device = "cpu"):
        if num_slots < 1:
            raise ValueError(f"num_slots (the most sequences in flight) must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.pools = {i: (torch.zeros(num_slots + 1, *s.conv_shape, dtype=s.conv_dtype, device=device),
                          torch.zeros(num_slots + 1, *s.ssm_shape, dtype=s.ssm_dtype, device=device))
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
        for conv, ssm in self.pools.values():
            conv[slot].zero_()
            ssm[slot].zero_()
        return slot

    def copy(self, src: int, dst: int) -> None:
        for conv, ssm in self.pools.values():
            conv[dst].copy_(conv[src])
            ssm[dst].copy_(ssm[src])

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
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
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


class HybridCache:
    """Both caches of one model, sized from ``cache_bytes`` or an explicit ``num_blocks``.

    With ``cache_bytes`` the state slots of ``max_seqs`` sequences (and the scratch row) are set aside
    first and the rest becomes KV blocks (the null block included), so a model with few attention layers
    gets many more tokens. Storage dtypes: ``kv_dtype`` for K/V, ``conv_dtype`` (default ``kv_dtype``) for
    the conv state, ``ssm_dtype`` (default fp32) for the SSM state.
    """

    def __init__(self, config: HybridConfig, *, num_blocks: int | None = None, cache_bytes: int | None = None,
                 max_seqs: int = 16, block_size: int = 16, kv_dtype: torch.dtype = torch.float32,
                 ssm_dtype: torch.dtype = torch.float32, conv_dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu"):
        if (num_blocks is None) == (cache_bytes is None):
            raise ValueError("size the cache with exactly one of num_blocks= or cache_bytes=")
        self.config, self.device = config, torch.device(device)
        self.spec = cache_specs(config, CacheDtypes(kv=kv_dtype, conv=conv_dtype or kv_dtype, ssm=ssm_dtype))
        self.ssm = SSMStateCache(self.spec, max_seqs, device=device)
        if num_blocks is None:
            kv_budget = cache_bytes - self.ssm.bytes_total
            per_block = self.spec.kv_bytes_per_token * block_size
            has_kv = bool(self.spec.attention)
            if kv_budget < 0 or (has_kv and kv_budget < 2 * per_block):
                raise ValueError(
                    f"cache_bytes={cache_bytes} is too small: the state of {max_seqs} sequences (+1 scratch row) "
                    f"takes {self.ssm.bytes_total} bytes and the KV pool at least {2 * per_block} more (one block "
                    "and the null block); raise cache_bytes or lower max_seqs")
            num_blocks = kv_budget // per_block - 1 if has_kv else 0
        self.kv = PagedKVCache(self.spec, num_blocks, block_size=block_size, device=device)
        self.layer_pools = {**self.kv.pools, **self.ssm.pools}  # layer index -> that layer's pools
        self.prefix = None  # the engine's PrefixCache (hybrid.prefix_cache), when prefix caching is on

    @classmethod
    def for_model(cls, model, **kw) -> HybridCache:
        """A cache on the model's device, K/V and conv state in the model's dtype (SSM state fp32)."""
        p = next(model.parameters())
        kw.setdefault("kv_dtype", p.dtype)
        return cls(model.config, device=p.device, **kw)

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
        return CacheReport(**prefix, kv_bytes_per_token=self.kv.bytes_per_token,
                           state_bytes_per_sequence=self.ssm.bytes_per_sequence, bytes_total=self.bytes_total,
                           bytes_in_use=used, bytes_free=self.bytes_total - used,
                           token_capacity=self.kv.capacity_tokens, max_sequences=self.ssm.num_slots,
                           kv_blocks_total=self.kv.num_blocks,
                           kv_blocks_in_use=self.kv.num_blocks - self.kv.allocator.num_free,
                           state_slots_in_use=self.ssm.num_slots - self.ssm.num_free)


def sequences_that_fit(config: HybridConfig, cache_bytes: int, seq_len: int, *, block_size: int = 16,
                       kv_dtype: torch.dtype = torch.bfloat16, ssm_dtype: torch.dtype = torch.float32,
                       conv_dtype: torch.dtype | None = None, chunk: int | None = None) -> int:
    """How many sequences of ``seq_len`` tokens a cache of ``cache_bytes`` holds at once (each needs its
    KV blocks and one state slot; the cache's null block and scratch row are paid for first). With ``chunk``
    (the engine's token budget per step) a sliding-window model is counted with only the blocks its
    window keeps."""
    spec = cache_specs(config, CacheDtypes(kv=kv_dtype, conv=conv_dtype or kv_dtype, ssm=ssm_dtype))
    kv = PagedKVCache(spec, 0, block_size=block_size, device="meta")
    blocks = kv.blocks_for(seq_len) if chunk is None else kv.blocks_held_at_most(seq_len, chunk)
    per_seq = blocks * kv.bytes_per_block + spec.state_bytes_per_sequence
    fixed = (kv.bytes_per_block if kv.enabled else 0) + spec.state_bytes_per_sequence  # null block + scratch row
    return max(0, cache_bytes - fixed) // per_seq
