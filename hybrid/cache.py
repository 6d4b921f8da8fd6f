"""Inference caches, typed per layer kind and accounted in bytes.

- :class:`PagedKVCache` for the attention layers (``*``): K/V pools of fixed-size blocks
  ``[num_blocks, block_size, n_kv_heads, head_dim]`` per layer, one :class:`BlockAllocator`
  (free list + reference counts, so a prefix cache can later share blocks) and a block table
  per sequence. Memory grows with every token a sequence holds.
- :class:`SSMStateCache` for the Mamba layers (``M``, ``m``): per sequence *slot* the conv
  state and the SSM state of every Mamba layer. Memory is constant per sequence.
- :class:`HybridCache` owns both, sized from a byte budget or an explicit block count.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from .config import HybridConfig


class CacheFullError(RuntimeError):
    """The cache has no room for what was asked; the caller may preempt and retry."""


class BlockAllocator:
    """Fixed pool of block ids with a free list and per-block reference counts."""

    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

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
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free; only a live block can be shared")
        self.ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block with none left returns to the free list."""
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} released more often than it was allocated or shared")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)


class PagedKVCache:
    """K/V pools for the attention layers, blocks handed out per sequence.

    ``pools[layer_index] = (k_pool, v_pool)`` keyed by the model's layer index. Token ``p`` of
    a sequence lives at slot ``table[p // block_size] * block_size + p % block_size``.
    A model without attention layers gets no pools and unlimited token capacity. With sliding-window
    attention, :meth:`trim` hands back the blocks no future token can see (their table entries
    become ``None``), so a sequence holds about ``window`` tokens however long it grows.
    """

    def __init__(self, config: HybridConfig, num_blocks: int, *, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        a = config.attention
        self.layer_indices = [i for i, k in enumerate(config.layer_kinds) if k == "attention"]
        self.block_size, self.dtype = block_size, dtype
        self.window = a.sliding_window if self.layer_indices else None
        self.num_blocks = num_blocks if self.layer_indices else 0
        shape = (self.num_blocks, block_size, a.n_kv_heads, a.head_dim)
        self.pools = {i: tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
                      for i in self.layer_indices}
        self.allocator = BlockAllocator(self.num_blocks)
        self.tables: dict[int, list[int | None]] = {}
        self.bytes_per_token = len(self.layer_indices) * 2 * a.n_kv_heads * a.head_dim * dtype.itemsize
        self.bytes_per_block = self.bytes_per_token * block_size

    @property
    def enabled(self) -> bool:
        return bool(self.layer_indices)

    @property
    def capacity_tokens(self) -> float:
        return self.num_blocks * self.block_size if self.enabled else math.inf

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size) if self.enabled else 0

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        self.tables[seq_id] = []

    def can_hold(self, seq_id: int, n_tokens: int) -> bool:
        """Whether ``seq_id`` can grow to ``n_tokens`` tokens with the blocks now free."""
        return self.blocks_for(n_tokens) - len(self.tables[seq_id]) <= self.allocator.num_free

    def reserve(self, seq_id: int, n_tokens: int) -> None:
        """Grow ``seq_id``'s block table to hold ``n_tokens`` tokens (all or nothing)."""
        table = self.tables[seq_id]
        need = self.blocks_for(n_tokens) - len(table)
        if need > 0:
            table.extend(self.allocator.allocate(need))

    def blocks_held_at_most(self, n_tokens: int, chunk: int) -> int:
        """The most blocks a sequence growing to ``n_tokens`` in steps of at most ``chunk`` new
        tokens holds at once (all of them, unless a sliding window lets :meth:`trim` drop some)."""
        full = self.blocks_for(n_tokens)
        if self.window is None:
            return full
        # window - 1 visible earlier tokens + the chunk, over at most one partial block at each end
        return min(full, self.blocks_for(self.window - 1 + min(chunk, n_tokens)) + 1)

    def trim(self, seq_id: int, next_pos: int) -> None:
        """Release the blocks of ``seq_id`` that lie wholly before the window of any token at
        ``next_pos`` or later (a no-op without a sliding window)."""
        if self.window is None:
            return
        table = self.tables[seq_id]
        dead = [j for j in range(min(len(table), max(0, next_pos - self.window + 1) // self.block_size))
                if table[j] is not None]
        self.allocator.release([table[j] for j in dead])
        for j in dead:
            table[j] = None

    def free_sequence(self, seq_id: int) -> None:
        self.allocator.release([b for b in self.tables.pop(seq_id) if b is not None])

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Pool slots of token positions ``start..end-1`` of ``seq_id``."""
        if not self.enabled:
            return [0] * (end - start)
        table, bs = self.tables[seq_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    @property
    def bytes_total(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def bytes_in_use(self) -> int:
        return (self.num_blocks - self.allocator.num_free) * self.bytes_per_block


def mamba_state_shapes(config: HybridConfig) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per Mamba layer index: (conv state shape, SSM state shape) of one sequence."""
    m2, m1 = config.mamba2, config.mamba1
    shapes = {}
    for i, kind in enumerate(config.layer_kinds):
        if kind == "mamba2":
            shapes[i] = ((m2.conv_dim, m2.d_conv - 1), (m2.n_heads, m2.head_dim, m2.d_state))
        elif kind == "mamba1":
            shapes[i] = ((m1.d_inner, m1.d_conv - 1), (m1.d_inner, m1.d_state))
    return shapes


class SSMStateCache:
    """Conv and SSM states of the Mamba layers in ``num_slots`` sequence slots.

    ``pools[layer_index] = (conv_pool [S, C, K-1], ssm_pool [S, ...])``. The SSM state is fp32
    by default (it accumulates over the whole sequence); the conv state holds raw inputs and
    defaults to the model's dtype. A slot is zeroed when handed out, which is the state of an
    empty sequence, so a fresh prefill and a continued one run the same code.
    """

    def __init__(self, config: HybridConfig, num_slots: int, *, ssm_dtype: torch.dtype = torch.float32,
                 conv_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_slots < 1:
            raise ValueError(f"num_slots (the most sequences in flight) must be >= 1, got {num_slots}")
        shapes = mamba_state_shapes(config)
        self.num_slots = num_slots
        self.pools = {i: (torch.zeros(num_slots, *cs, dtype=conv_dtype, device=device),
                          torch.zeros(num_slots, *ss, dtype=ssm_dtype, device=device))
                      for i, (cs, ss) in shapes.items()}
        self.bytes_per_sequence = sum(math.prod(cs) * conv_dtype.itemsize + math.prod(ss) * ssm_dtype.itemsize
                                      for cs, ss in shapes.values())
        self._free: deque[int] = deque(range(num_slots))
        self.owner: dict[int, int] = {}  # seq_id -> slot

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, seq_id: int) -> int:
        if seq_id in self.owner:
            raise ValueError(f"sequence {seq_id} already holds state slot {self.owner[seq_id]}")
        if not self._free:
            raise CacheFullError(f"all {self.num_slots} state slots are in use")
        slot = self._free.popleft()
        for conv, ssm in self.pools.values():
            conv[slot].zero_()
            ssm[slot].zero_()
        self.owner[seq_id] = slot
        return slot

    def free(self, seq_id: int) -> None:
        self._free.append(self.owner.pop(seq_id))

    @property
    def bytes_total(self) -> int:
        return self.num_slots * self.bytes_per_sequence

    @property
    def bytes_in_use(self) -> int:
        return len(self.owner) * self.bytes_per_sequence


@dataclass(frozen=True)
class CacheReport:
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    bytes_total: int
    bytes_in_use: int
    bytes_free: int
    token_capacity: float
    max_sequences: int


class HybridCache:
    """Both caches of one model, sized from ``cache_bytes`` or an explicit ``num_blocks``.

    With ``cache_bytes`` the state slots of ``max_seqs`` sequences are set aside first and the
    rest becomes KV blocks, so a model with few attention layers gets many more tokens.
    """

    def __init__(self, config: HybridConfig, *, num_blocks: int | None = None, cache_bytes: int | None = None,
                 max_seqs: int = 16, block_size: int = 16, kv_dtype: torch.dtype = torch.float32,
                 ssm_dtype: torch.dtype = torch.float32, conv_dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu"):
        if (num_blocks is None) == (cache_bytes is None):
            raise ValueError("size the cache with exactly one of num_blocks= or cache_bytes=")
        conv_dtype = conv_dtype or kv_dtype
        self.config, self.device = config, torch.device(device)
        self.ssm = SSMStateCache(config, max_seqs, ssm_dtype=ssm_dtype, conv_dtype=conv_dtype, device=device)
        if num_blocks is None:
            probe = PagedKVCache(config, 0, block_size=block_size, dtype=kv_dtype, device="meta")
            kv_budget = cache_bytes - self.ssm.bytes_total
            if kv_budget < 0 or (probe.enabled and kv_budget < probe.bytes_per_block):
                raise ValueError(
                    f"cache_bytes={cache_bytes} is too small: the state of {max_seqs} sequences takes "
                    f"{self.ssm.bytes_total} bytes and one KV block {probe.bytes_per_block} more; "
                    "raise cache_bytes or lower max_seqs")
            num_blocks = kv_budget // probe.bytes_per_block if probe.enabled else 0
        self.kv = PagedKVCache(config, num_blocks, block_size=block_size, dtype=kv_dtype, device=device)

    @classmethod
    def for_model(cls, model, **kw) -> HybridCache:
        """A cache on the model's device, K/V and conv state in the model's dtype (SSM state fp32)."""
        p = next(model.parameters())
        kw.setdefault("kv_dtype", p.dtype)
        return cls(model.config, device=p.device, **kw)

    def report(self) -> CacheReport:
        total = self.kv.bytes_total + self.ssm.bytes_total
        used = self.kv.bytes_in_use + self.ssm.bytes_in_use
        return CacheReport(kv_bytes_per_token=self.kv.bytes_per_token,
                           state_bytes_per_sequence=self.ssm.bytes_per_sequence, bytes_total=total,
                           bytes_in_use=used, bytes_free=total - used, token_capacity=self.kv.capacity_tokens,
                           max_sequences=self.ssm.num_slots)


def sequences_that_fit(config: HybridConfig, cache_bytes: int, seq_len: int, *, block_size: int = 16,
                       kv_dtype: torch.dtype = torch.bfloat16, ssm_dtype: torch.dtype = torch.float32,
                       conv_dtype: torch.dtype | None = None, chunk: int | None = None) -> int:
    """How many sequences of ``seq_len`` tokens a cache of ``cache_bytes`` holds at once
    (each needs its KV blocks and one state slot). With ``chunk`` (the engine's token budget per
    step) a sliding-window model is counted with only the blocks its window keeps."""
    kv = PagedKVCache(config, 0, block_size=block_size, dtype=kv_dtype, device="meta")
    ssm = SSMStateCache(config, 1, ssm_dtype=ssm_dtype, conv_dtype=conv_dtype or kv_dtype, device="meta")
    blocks = kv.blocks_for(seq_len) if chunk is None else kv.blocks_held_at_most(seq_len, chunk)
    per_seq = blocks * kv.bytes_per_block + ssm.bytes_per_sequence
    return cache_bytes // per_seq
