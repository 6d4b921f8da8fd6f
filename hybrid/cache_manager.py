"""The cache manager: the one place that hands out, shares and takes back a sequence's KV blocks and state slot.

Nothing else touches block tables, the block allocator or the state-slot free list: the scheduler asks
it whether a sequence can be admitted or grown, the model runner asks it for each sequence's block table,
pool slots and state slot when it builds a step's metadata. Later cache features (a prefix tree, Mamba
state checkpoints, speculative rollback) live here too.

A block table lists a sequence's blocks in order; an entry is :data:`~hybrid.cache.NULL_BLOCK` where a
sliding window let the block go (no future token can see it), so tables never hold holes of another kind
and the attention ops read a real, harmless block there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cache import NULL_BLOCK, CacheFullError, HybridCache


@dataclass
class SequenceCache:
    """What one sequence holds: its state slot and its block table."""

    slot: int
    blocks: list[int] = field(default_factory=list)


class CacheManager:
    def __init__(self, cache: HybridCache):
        self.cache = cache
        self.kv, self.ssm = cache.kv, cache.ssm
        self.block_size = cache.kv.block_size
        self.seqs: dict[int, SequenceCache] = {}

    # ---- queries ---------------------------------------------------------------------------------
    def holds(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    @property
    def num_free_blocks(self) -> int:
        return self.kv.allocator.num_free

    @property
    def num_free_slots(self) -> int:
        return self.ssm.num_free

    def blocks_for(self, n_tokens: int) -> int:
        return self.kv.blocks_for(n_tokens)

    def can_admit(self, n_tokens: int) -> bool:
        """Whether a new sequence with ``n_tokens`` tokens to cache fits now (a slot and its blocks)."""
        return self.ssm.num_free > 0 and self.kv.blocks_for(n_tokens) <= self.kv.allocator.num_free

    def can_grow(self, seq_id: int, n_tokens: int) -> bool:
        """Whether ``seq_id`` can grow to ``n_tokens`` cached tokens with the blocks now free."""
        return self.kv.blocks_for(n_tokens) - len(self.seqs[seq_id].blocks) <= self.kv.allocator.num_free

    def block_table(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id].blocks

    def state_slot(self, seq_id: int) -> int:
        return self.seqs[seq_id].slot

    def pool_slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat KV pool slots of token positions ``start..end-1`` of ``seq_id`` (all 0, the null block's
        first slot, for a model without attention)."""
        if not self.kv.enabled:
            return [0] * (end - start)
        table, bs = self.seqs[seq_id].blocks, self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def blocks_in_use(self) -> list[int]:
        return [b for s in self.seqs.values() for b in s.blocks if b != NULL_BLOCK]

    # ---- changes ---------------------------------------------------------------------------------
    def admit(self, seq_id: int, n_tokens: int) -> None:
        """Give a new sequence a zeroed state slot and blocks for ``n_tokens`` tokens (all or nothing)."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already holds cache")
        if not self.can_admit(n_tokens):
            raise CacheFullError(f"no room to admit a sequence of {n_tokens} tokens ({self.ssm.num_free} slots, "
                                 f"{self.kv.allocator.num_free} KV blocks free)")
        self.seqs[seq_id] = SequenceCache(self.ssm.allocate(), self.kv.allocator.allocate(self.kv.blocks_for(n_tokens)))

    def grow(self, seq_id: int, n_tokens: int) -> None:
        """Extend ``seq_id``'s block table to hold ``n_tokens`` tokens (all or nothing)."""
        table = self.seqs[seq_id].blocks
        need = self.kv.blocks_for(n_tokens) - len(table)
        if need > 0:
            table.extend(self.kv.allocator.allocate(need))

    def trim(self, seq_id: int, next_pos: int) -> None:
        """Release the blocks of ``seq_id`` that lie wholly before the window of any token at ``next_pos``
        or later, pointing their table entries at the null block (a no-op without a sliding window)."""
        window = self.kv.window
        if window is None:
            return
        table = self.seqs[seq_id].blocks
        dead = [j for j in range(min(len(table), max(0, next_pos - window + 1) // self.block_size))
                if table[j] != NULL_BLOCK]
        self.kv.allocator.release([table[j] for j in dead])
        for j in dead:
            table[j] = NULL_BLOCK

    def free(self, seq_id: int) -> None:
        """Take back everything ``seq_id`` holds."""
        seq = self.seqs.pop(seq_id)
        self.kv.allocator.release([b for b in seq.blocks if b != NULL_BLOCK])
        self.ssm.free(seq.slot)

    def fork(self, parent: int, child: int, n_tokens: int) -> None:
        """Give ``child`` the cache of ``parent``'s ``n_tokens`` computed tokens, so both continue from there
        (parallel samples of one prompt). ``n_tokens`` must be all the tokens ``parent`` has computed: its
        Mamba state is as of its last token and cannot be rewound. Full blocks are shared by reference
        count and never written again (sequences only append); a partial last block is copied (copy on
        write, done eagerly) since both would append into it; the Mamba state is copied into a fresh slot.
        All or nothing."""
        if child in self.seqs:
            raise ValueError(f"sequence {child} already holds cache")
        src = self.seqs[parent]
        n_blocks = self.kv.blocks_for(n_tokens)
        if n_blocks > len(src.blocks):
            raise ValueError(f"sequence {parent} holds {len(src.blocks)} blocks, fewer than {n_tokens} tokens need")
        partial = n_tokens % self.block_size != 0 and self.kv.enabled
        if self.ssm.num_free == 0 or partial > self.kv.allocator.num_free:
            raise CacheFullError(f"no room to fork sequence {parent} ({self.ssm.num_free} slots, "
                                 f"{self.kv.allocator.num_free} KV blocks free)")
        blocks = list(src.blocks[:n_blocks])
        for b in blocks[:n_blocks - partial]:
            if b != NULL_BLOCK:
                self.kv.allocator.share(b)
        if partial:
            (fresh,) = self.kv.allocator.allocate(1)
            for k_pool, v_pool in self.kv.pools.values():
                k_pool[fresh].copy_(k_pool[blocks[-1]])
                v_pool[fresh].copy_(v_pool[blocks[-1]])
            blocks[-1] = fresh
        slot = self.ssm.allocate()
        self.ssm.copy(src.slot, slot)
        self.seqs[child] = SequenceCache(slot, blocks)
