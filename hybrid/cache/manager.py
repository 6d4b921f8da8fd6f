"""The cache manager: the one place that hands out, shares and takes back a sequence's KV blocks and state slot.

Nothing else touches block tables, the block allocator or the state-slot free list: the scheduler asks
it whether a sequence can be admitted or grown, the model runner asks it for each sequence's block table,
pool slots and state slot when it builds a step's metadata. Later cache features (a prefix tree, Mamba
state checkpoints, speculative rollback: :meth:`CacheManager.commit_verified`, :meth:`CacheManager.shrink`)
live here too.

A block table lists a sequence's blocks in order; an entry is :data:`~hybrid.cache.NULL_BLOCK` where a
sliding window let the block go (no future token can see it), so tables never hold holes of another kind
and the attention ops read a real, harmless block there.

Positions and KV lengths: the scheduler and the engine count a sequence's tokens by position (``n_tokens``,
``start``: RoPE positions, prompt + generated). Once SnapKV (:class:`hybrid.cache.pruning.SnapKV`) has compressed
a prompt, the sequence's blocks hold ``dropped`` fewer tokens than that; every method here takes positions
and converts (:meth:`CacheManager.kv_length`), so the step metadata gets KV lengths for attention and
positions for RoPE.
"""

from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field
from os.path import commonprefix

import torch

from .pools import NULL_BLOCK, CacheFullError, HybridCache
from .prefix import Match, Node, PrefixCache


@dataclass
class SequenceCache:
    """What one sequence holds: its state slot and its block table; with a prefix cache also its deepest
    node in the tree (where its next full block is inserted) and the positions it saves checkpoints at."""

    slot: int
    blocks: list[int] = field(default_factory=list)
    cursor: Node | None = None
    wanted: list[int] = field(default_factory=list)
    tokens: list[int] | None = None  # its tokens at admission (prefix cache: branch points with running ones)
    computed: int = 0
    # SnapKV: the prompt length where its compression is due (None: not due), the positions it dropped from
    # its blocks (KV length = position - dropped), and the prompt positions each layer kept, [Hkv, budget]
    compress_at: int | None = None
    dropped: int = 0
    kept: dict[int, torch.Tensor] | None = None


@dataclass(frozen=True)
class Admission:
    """How a new sequence starts: ``start`` tokens come from the prefix cache (0: a cold start)."""

    start: int
    match: Match | None = None
    wanted: tuple[int, ...] = ()
    tokens: list[int] | None = None
    # a running sequence will have the KV and a checkpoint at a longer prefix soon: better to wait for it
    defer: bool = False
    compress_at: int | None = None  # SnapKV compresses the prompt here (a prefill chunk stops here: in wanted)


class CacheManager:
    def __init__(self, cache: HybridCache, prefix: PrefixCache | None = None):
        self.cache = cache
        self.kv, self.ssm = cache.kv, cache.ssm
        self.block_size = cache.kv.block_size
        self.seqs: dict[int, SequenceCache] = {}
        self.prefix = prefix
        cache.prefix = prefix  # so HybridCache.report() shows the tree

    def check_fits(self, prompt_len: int, new_cached: int, chunk: int) -> None:
        """Refuse up front, with the numbers, a request the whole cache could never hold. ``new_cached``:
        generated tokens that enter the cache (``max_new_tokens - 1``: the last sampled one never does);
        ``chunk``: the most tokens one step computes (the engine's token budget)."""
        need = prompt_len + new_cached
        kv = self.kv
        held = kv.blocks_held_at_most(need, chunk, prompt_len)
        if kv.enabled and held > kv.num_blocks:
            raise ValueError(
                f"request needs {need} cached tokens ({prompt_len} prompt + {new_cached + 1} new - 1), "
                f"{held} KV blocks at once, but the whole KV cache holds {kv.capacity_tokens} tokens "
                f"({kv.num_blocks} blocks of {kv.block_size}); shorten the prompt, lower max_new_tokens "
                "or give the engine a bigger cache")

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

    def _room(self, n_blocks: int, protect=frozenset()) -> bool:
        """Whether ``n_blocks`` blocks are free, after evicting prefix-tree blocks nobody runs on if needed."""
        if n_blocks <= self.kv.allocator.num_free:
            return True
        return self.prefix is not None and self.prefix.evict_blocks(n_blocks - self.kv.allocator.num_free, protect)

    def can_admit(self, n_tokens: int) -> bool:
        """Whether a new sequence with ``n_tokens`` tokens to cache fits now (a slot and its blocks); the
        prefix tree gives up blocks for it."""
        return self.ssm.num_free > 0 and self._room(self.kv.blocks_for(n_tokens))

    def can_grow(self, seq_id: int, n_tokens: int) -> bool:
        """Whether ``seq_id`` can grow to ``n_tokens`` cached tokens with the blocks now free (the prefix
        tree gives up blocks first)."""
        return self._room(self.kv.blocks_for(self.kv_length(seq_id, n_tokens)) - len(self.seqs[seq_id].blocks))

    def kv_length(self, seq_id: int, n_tokens: int) -> int:
        """Tokens in ``seq_id``'s blocks when its next position is ``n_tokens`` (less after SnapKV compressed it)."""
        return n_tokens - self.seqs[seq_id].dropped

    def observed(self, seq_id: int, start: int, end: int) -> range:
        """The positions of ``start..end-1`` that are observation-window queries of a SnapKV compression still
        due for ``seq_id`` (the attention layers capture those rows)."""
        at = self.seqs[seq_id].compress_at
        if at is None:
            return range(0)
        lo, hi = max(start, at - self.kv.snapkv.window), min(end, at)
        return range(lo, max(lo, hi))

    def block_table(self, seq_id: int) -> list[int]:
        return self.seqs[seq_id].blocks

    def state_slot(self, seq_id: int) -> int:
        return self.seqs[seq_id].slot

    def pool_slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Flat KV pool slots of token positions ``start..end-1`` of ``seq_id`` (all 0, the null block's
        first slot, for a model without attention)."""
        if not self.kv.enabled:
            return [0] * (end - start)
        seq, bs = self.seqs[seq_id], self.block_size
        table = seq.blocks
        return [table[p // bs] * bs + p % bs for p in range(start - seq.dropped, end - seq.dropped)]

    def decode_row(self, seq_id: int, position: int) -> tuple[int, int, list[int], int]:
        """What a decode step's row for ``seq_id``'s token at ``position`` reads: its KV length after the token,
        the token's K/V pool slot (0 without attention), its block table (empty without attention; the live list,
        not a copy) and its state slot. ValueError when the sequence holds no cache here or its blocks do not
        reach the token (the scheduler grows them first)."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"build_batch: sequences {[seq_id]} hold no cache in this manager")
        kv_len = position + 1 - seq.dropped
        if not self.kv.enabled:
            return kv_len, 0, [], seq.slot
        bs, blocks = self.block_size, seq.blocks
        if len(blocks) * bs < kv_len:
            raise ValueError(f"build_batch: sequences {[seq_id]} hold too few KV blocks for their new tokens")
        q = kv_len - 1
        return kv_len, blocks[q // bs] * bs + q % bs, blocks, seq.slot

    def blocks_in_use(self) -> list[int]:
        return [b for s in self.seqs.values() for b in s.blocks if b != NULL_BLOCK]

    # ---- changes ---------------------------------------------------------------------------------
    def plan(self, tokens: list[int], prompt_len: int, limit: int) -> Admission:
        """Where a new sequence of ``tokens`` starts: the prefix tree's longest resumable prefix of at
        most ``limit`` tokens, and the positions its prefill saves checkpoints at (a cold start without a
        prefix cache)."""
        if self.prefix is None:
            snap = self.kv.snapkv
            if snap is not None and self.kv.enabled and snap.compresses(prompt_len):  # attention layers to prune
                return Admission(0, wanted=(prompt_len,), compress_at=prompt_len)
            return Admission(0)
        match = self.prefix.match(tokens, limit)
        # Speculative insertion (Marconi) covers running sequences too: one that shares more than the tree
        # knows yet defines the branch point, and if it has not computed that far it saves a checkpoint there
        # as well, so the next prompt of this kind hits even while both still run.
        for seq in self.seqs.values():
            if seq.tokens is None:
                continue
            c = len(commonprefix([seq.tokens, tokens]))
            if c > match.matched and c < len(seq.tokens):
                match.matched, match.branch = c, True
        defer = False
        target = min(match.matched, limit)
        for seq in self.seqs.values():
            if seq.tokens is not None and seq.computed < target < len(seq.tokens) \
                    and seq.tokens[:target] == tokens[:target]:
                if target not in seq.wanted:
                    insort(seq.wanted, target)
                defer = defer or target > match.position
        return Admission(match.position, match,
                         tuple(self.prefix.wanted_positions(match, len(tokens), prompt_len, limit)), list(tokens),
                         defer)

    def admit(self, seq_id: int, n_tokens: int, admission: Admission | None = None) -> None:
        """Give a new sequence a state slot and blocks for ``n_tokens`` tokens (all or nothing). Without an
        admission (or a cold one) the slot is zeroed; a hit's full blocks are shared, its partial last block
        copied, its checkpoint copied into the slot. Raises :class:`CacheFullError` when it does not fit."""
        if not self.try_admit(seq_id, n_tokens, admission):
            raise CacheFullError(f"no room to admit a sequence of {n_tokens} tokens ({self.ssm.num_free} slots, "
                                 f"{self.kv.allocator.num_free} KV blocks free)")

    def try_admit(self, seq_id: int, n_tokens: int, admission: Admission | None = None) -> bool:
        """:meth:`admit`, returning False (and taking nothing) when it does not fit."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already holds cache")
        adm = admission or Admission(0)
        if n_tokens < adm.start:
            raise ValueError(f"a sequence resuming at {adm.start} tokens must hold at least that many, got {n_tokens}")
        if self.ssm.num_free == 0:
            return False
        match = adm.match
        shared = list(match.shared_blocks) if match is not None and self.kv.enabled else []
        for b in shared:  # references first, so making room below cannot evict them
            self.kv.allocator.share(b)
        protect = {match.node} if match is not None else set()  # the hit's partial block and checkpoint
        if not self._room(self.kv.blocks_for(n_tokens) - len(shared), protect):
            self.kv.allocator.release(shared)
            return False
        blocks = shared + self.kv.allocator.allocate(self.kv.blocks_for(n_tokens) - len(shared))
        slot = self.ssm.allocate()
        seq = SequenceCache(slot, blocks, wanted=list(adm.wanted), tokens=adm.tokens, computed=adm.start,
                            compress_at=adm.compress_at)
        if match is not None:
            node = match.node
            if self.kv.enabled and len(node.tokens) % self.block_size:  # partial block: copy, then append
                self.kv.copy_block(node.block, blocks[len(shared)])
            if node.checkpoint is not None:
                self.prefix.checkpoints.load(node.checkpoint, slot)
            seq.cursor = node if len(node.tokens) == self.block_size or node is self.prefix.root else node.parent
            self.prefix.touch(node)
        self.seqs[seq_id] = seq
        if adm.start:
            self.trim(seq_id, adm.start)
        return True

    def next_checkpoint(self, seq_id: int, position: int) -> int | None:
        """The first position after ``position`` where ``seq_id`` saves a checkpoint (a chunk ends there)."""
        return next((p for p in self.seqs[seq_id].wanted if p > position), None)

    def computed(self, seq_id: int, tokens: list[int], n_computed: int) -> None:
        """After a forward: ``seq_id`` now has ``n_computed`` tokens of ``tokens`` cached. Its newly
        full blocks join the prefix tree, and where it asked for a checkpoint at ``n_computed`` one is
        saved (a no-op without a prefix cache)."""
        if self.prefix is None:
            return
        seq = self.seqs[seq_id]
        seq.computed = n_computed
        self._insert(seq, tokens, n_computed)
        if seq.wanted and seq.wanted[0] <= n_computed:
            if seq.wanted[0] == n_computed and seq.cursor is not None:
                self.prefix.save(seq.cursor, tokens, seq.blocks, n_computed, seq.slot, hand_over=False)
            seq.wanted = [p for p in seq.wanted if p > n_computed]

    def _insert(self, seq: SequenceCache, tokens: list[int], n_computed: int) -> None:
        if seq.cursor is not None and seq.cursor.dead:
            seq.cursor = None
        if seq.cursor is not None:
            seq.cursor = self.prefix.insert_full(seq.cursor, tokens, seq.blocks, n_computed)

    def grow(self, seq_id: int, n_tokens: int) -> None:
        """Extend ``seq_id``'s block table to hold ``n_tokens`` tokens (all or nothing)."""
        table = self.seqs[seq_id].blocks
        need = self.kv.blocks_for(self.kv_length(seq_id, n_tokens)) - len(table)
        if need > 0:
            table.extend(self.kv.allocator.allocate(need))

    def trim(self, seq_id: int, next_pos: int) -> None:
        """Release the blocks of ``seq_id`` that lie wholly before the window of any token at ``next_pos``
        or later, pointing their table entries at the null block (a no-op without a sliding window). With
        SnapKV: compress the prompt once ``next_pos`` reaches its end (:meth:`compress`)."""
        seq = self.seqs[seq_id]
        if seq.compress_at is not None and next_pos >= seq.compress_at:
            self.compress(seq_id, next_pos)
        window = self.kv.window
        if window is None:
            return
        table = seq.blocks
        sink_blocks = self.kv.blocks_for(self.kv.sinks)  # StreamingLLM: the sinks' blocks stay (0 otherwise)
        dead = [j for j in range(sink_blocks, min(len(table), max(0, next_pos - window + 1) // self.block_size))
                if table[j] != NULL_BLOCK]
        self.kv.allocator.release([table[j] for j in dead])
        self.kv.pruned_blocks += len(dead) if self.kv.pruning is not None else 0
        for j in dead:
            table[j] = NULL_BLOCK

    def compress(self, seq_id: int, next_pos: int) -> None:
        """SnapKV: ``seq_id``'s prompt (``compress_at`` tokens) is prefilled; per attention layer and KV head
        keep the positions its observation window (the queries the layers captured) picks, move them to the
        front of its blocks (:meth:`hybrid.cache.PagedKVCache.compact`) and give the blocks after them back."""
        seq, snap = self.seqs[seq_id], self.kv.snapkv
        L = seq.compress_at
        if next_pos != L:
            raise RuntimeError(f"sequence {seq_id}: a prefill chunk ran past the prompt end {L} (to {next_pos}) "
                               "before SnapKV compressed it; the scheduler must stop a chunk there")
        queries = self.kv.capture.take(seq_id)
        kept = {}
        for i in self.kv.layer_indices:
            q = queries.get(i)
            if q is None or q.shape[0] != snap.window:
                raise RuntimeError(f"sequence {seq_id}: layer {i} captured {0 if q is None else q.shape[0]} of the "
                                   f"{snap.window} observation-window queries SnapKV needs")
            kept[i] = snap.select(q, self.kv.keys(i, seq.blocks, L))
        self.kv.compact(seq.blocks, kept)
        keep = self.kv.blocks_for(snap.budget)
        freed = seq.blocks[keep:]
        self.kv.allocator.release(freed)
        del seq.blocks[keep:]
        seq.compress_at, seq.dropped, seq.kept = None, L - snap.budget, kept
        seq.wanted = [p for p in seq.wanted if p > L]
        self.kv.pruned_blocks += len(freed)
        self.kv.compressed_sequences += 1

    # ---- speculative decoding: rollback ----------------------------------------------------------
    def commit_verified(self, states, positions: list[int]) -> None:
        """After a verify step: write into each verify chunk's state slot its Mamba state (every state tensor of
        every layer: conv and SSM) after chunk position ``positions[i]`` (0: only the chunk's first token, the
        last accepted one, kept), from the per-position states the layers left in ``states`` (a
        :class:`~hybrid.speculative.verify_states.VerifyStates`). Rejected positions are simply not copied."""
        if not states.layers:
            return
        device = states.slots.device
        which = torch.tensor(positions, dtype=torch.long, device=device)
        rows = torch.arange(len(positions), device=device)
        for view, hist in states.layers:
            for store, h in zip(view.stores, hist, strict=True):
                store.write(states.slots, h[which, rows])

    def shrink(self, seq_id: int, n_tokens: int) -> None:
        """Give back the KV blocks of ``seq_id`` past its first ``n_tokens`` tokens (rejected draft tokens'
        K/V): the sequence length is cut there and a later token overwrites what is left in its last block."""
        table = self.seqs[seq_id].blocks
        keep = self.kv.blocks_for(self.kv_length(seq_id, n_tokens))
        if len(table) > keep:
            self.kv.allocator.release([b for b in table[keep:] if b != NULL_BLOCK])
            del table[keep:]

    def save_states(self, seq_ids: list[int]) -> list[tuple[torch.Tensor, ...]]:
        """Copies of the Mamba states (per layer its state tensors: conv, SSM) of ``seq_ids``' slots, to roll
        back to later."""
        slots = [self.seqs[s].slot for s in seq_ids]
        # through the cache views: rows come back dequantised and go back re-quantised with their scales
        return [view.read(slots) for view in self.ssm.views.values()]

    def load_states(self, seq_ids: list[int], saved: list[list[tuple[torch.Tensor, ...]]],
                    which: list[int]) -> None:
        """Roll ``seq_ids[i]``'s Mamba states back to ``saved[which[i]]`` (a :meth:`save_states` list taken
        with the same ``seq_ids``)."""
        for i, (seq_id, w) in enumerate(zip(seq_ids, which, strict=True)):
            slot = [self.seqs[seq_id].slot]
            for view, layer_saved in zip(self.ssm.views.values(), saved[w], strict=True):
                view.write(slot, tuple(s[i:i + 1] for s in layer_saved))

    def free(self, seq_id: int, tokens: list[int] | None = None, n_computed: int = 0) -> None:
        """Take back everything ``seq_id`` holds. With a prefix cache and the sequence's ``tokens`` (of
        which ``n_computed`` are cached), what it computed stays in the tree first: its full blocks, and
        a checkpoint where it stopped (its partial last block is handed over, not copied)."""
        seq = self.seqs[seq_id]
        if self.prefix is not None and tokens is not None and n_computed > 0:
            self._insert(seq, tokens, n_computed)
            if seq.cursor is not None:
                self.prefix.save(seq.cursor, tokens, seq.blocks, n_computed, seq.slot, hand_over=True)
                self.prefix.prune_path(seq.cursor)
        del self.seqs[seq_id]
        self.kv.allocator.release([b for b in seq.blocks if b != NULL_BLOCK])
        self.ssm.free(seq.slot)
        if self.kv.capture is not None:
            self.kv.capture.drop(seq_id)  # a preempted prompt's window is captured again when it recomputes

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
        if src.compress_at is not None:
            raise ValueError(f"sequence {parent} cannot be forked before SnapKV has compressed its prompt")
        n_kv = self.kv_length(parent, n_tokens)
        n_blocks = self.kv.blocks_for(n_kv)
        if n_blocks > len(src.blocks):
            raise ValueError(f"sequence {parent} holds {len(src.blocks)} blocks, fewer than {n_tokens} tokens need")
        partial = n_kv % self.block_size != 0 and self.kv.enabled
        if self.ssm.num_free == 0 or partial > self.kv.allocator.num_free:
            raise CacheFullError(f"no room to fork sequence {parent} ({self.ssm.num_free} slots, "
                                 f"{self.kv.allocator.num_free} KV blocks free)")
        blocks = list(src.blocks[:n_blocks])
        for b in blocks[:n_blocks - partial]:
            if b != NULL_BLOCK:
                self.kv.allocator.share(b)
        if partial:
            (fresh,) = self.kv.allocator.allocate(1)
            self.kv.copy_block(blocks[-1], fresh)
            blocks[-1] = fresh
        slot = self.ssm.allocate()
        self.ssm.copy(src.slot, slot)
        self.seqs[child] = SequenceCache(slot, blocks, dropped=src.dropped, kept=src.kept)
