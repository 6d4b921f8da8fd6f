"""The prefix cache: a radix tree over token blocks whose nodes hold shared KV blocks and Mamba state
checkpoints, so a prompt that starts like an earlier one skips the prefill of the part they share.

**Tree.** Node ``n`` covers token positions ``n.start .. n.end - 1``, at most one KV block of
``block_size`` tokens, aligned to block boundaries. A *full* node (``block_size`` tokens) holds one
reference to the KV block that stores those tokens and may have children; a *partial* node (fewer
tokens, always a leaf) holds its own private copy of a partly filled block. Nothing in the tree is ever
written: sequences only append, so a full block a sequence has filled is shared as it is (one more
reference); a partial block is copied into the tree (copy on write), or handed over when its sequence
ends, and a sequence resuming from it copies it again before appending.

**Checkpoints.** The conv + SSM state of every Mamba layer after the node's last token, kept in
:class:`StateCheckpoints` under its own byte budget (``prefix_state_bytes``), apart from the live state
slots. A Mamba state after token ``t`` exists only where it was saved, so the cache chooses where to save
(*admission*, see :meth:`PrefixCache.wanted_positions`): the branch point where a new prompt leaves an
existing path (found when the prompt is looked up, before its prefill: Marconi's speculative insertion),
the end of the prompt, every ``checkpoint_interval`` tokens, and where a sequence stops (finished,
aborted or preempted). The scheduler ends a prefill chunk exactly at each wanted position and the cache
copies the slot's state after that step's forward, so every checkpoint is exact.

**Hits.** A request resumes from the longest prefix for which every layer has what it needs: the KV
blocks of all its tokens (attention layers) and a checkpoint at exactly that position (Mamba layers). A
pure attention model resumes at any block boundary (or a saved partial block), a pure Mamba model at any
checkpoint, a hybrid where both hold.

**Eviction.** The KV pool is shared with live sequences: a sequence that needs blocks takes them from the
tree first (leaves whose block nobody else references), before anyone is preempted. Checkpoints are
evicted when their pool is full. Both pick the candidate with the lowest utility (after Marconi)
``recency + flop_weight * flops_saved_per_byte``, each term normalised to [0, 1] over the candidates:
recency is the order of last use, flops saved is the prefill compute between the node and the nearest
resumable point above it (what a hit would recompute without it), bytes are what the node holds. A long
shared prefix saves many FLOPs per byte and so outlives many short ones; ``flop_weight=0`` is plain LRU.
Nothing a running sequence references is evicted: its shared blocks have a reference count above one,
and a checkpoint is copied into the resuming sequence's slot, never used in place.

**Sliding window.** Blocks are shared exactly as without a window; the tree keeps a block alive after the
window of the sequence that filled it has passed it, so a later prompt can still resume beyond it. A
resuming sequence takes references only to the blocks inside its window (the ones behind it point at the
null block at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .pools import NULL_BLOCK, PagedKVCache, SSMStateCache


class Node:
    __slots__ = ("parent", "tokens", "start", "block", "children", "partials", "checkpoint", "last_use", "dead")

    def __init__(self, parent: Node | None, tokens: tuple[int, ...], start: int, block: int):
        self.parent, self.tokens, self.start, self.block = parent, tokens, start, block
        self.children: dict[tuple[int, ...], Node] = {}  # full children by their tokens
        self.partials: dict[tuple[int, ...], Node] = {}  # partial-block leaves by their tokens
        self.checkpoint: int | None = None  # id in StateCheckpoints: the Mamba states after ``end`` tokens
        self.last_use = 0
        self.dead = False  # evicted: sequences holding it as their insertion cursor stop inserting

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def is_leaf(self) -> bool:
        return not self.children and not self.partials

    def path(self) -> list[Node]:
        """Root-first nodes from the root's child down to this node."""
        nodes, n = [], self
        while n.parent is not None:
            nodes.append(n)
            n = n.parent
        return nodes[::-1]


class StateCheckpoints:
    """Saved conv + SSM states of every Mamba layer, at most ``budget_bytes`` of them (each costs the state
    of one sequence). Stored as separate tensors so a large budget costs nothing until it is used."""

    def __init__(self, ssm: SSMStateCache, budget_bytes: int):
        self.ssm = ssm
        self.bytes_per_checkpoint = ssm.bytes_per_sequence
        self.capacity = budget_bytes // self.bytes_per_checkpoint if self.bytes_per_checkpoint else 0
        self.budget_bytes = budget_bytes
        self.saved: dict[int, list[tuple]] = {}
        self._next = 0

    @property
    def num_free(self) -> int:
        return self.capacity - len(self.saved)

    @property
    def bytes_in_use(self) -> int:
        return len(self.saved) * self.bytes_per_checkpoint

    def save(self, slot: int) -> int:
        if self.num_free <= 0:
            raise RuntimeError("state checkpoint pool is full; evict first")
        cid, self._next = self._next, self._next + 1
        # rows as stored (an int8 state's codes with its scales), so a checkpoint costs what a slot costs
        self.saved[cid] = [tuple(p.save_row(slot) for p in pools) for pools in self.ssm.state_pools.values()]
        return cid

    def load(self, cid: int, slot: int) -> None:
        for pools, saved in zip(self.ssm.state_pools.values(), self.saved[cid], strict=True):
            for pool, row in zip(pools, saved, strict=True):
                pool.load_row(slot, row)

    def release(self, cid: int) -> None:
        del self.saved[cid]


@dataclass
class Match:
    """What the tree holds for a token sequence: ``node`` is the deepest resumable node (the root for a
    miss) and ``position`` its end; ``matched`` is how many leading tokens the tree knows, and ``branch``
    whether an existing path goes on past them with a different token (a branch point)."""

    node: Node
    position: int
    matched: int
    branch: bool
    shared_blocks: list[int] = field(default_factory=list)  # full blocks of the hit, in order


def prefill_flops_fn(model):
    """``F(p)``: FLOPs to prefill the first ``p`` tokens (from ``model.flops_per_token``): a per-token
    part and an attention part that grows with the visible context (sliding window respected)."""
    f1, f2 = model.flops_per_token(1), model.flops_per_token(2)
    attn = 2 * (f2 - f1)  # FLOPs per token of visible context (mean context is 1 at p=1, 1.5 at p=2)
    per_token = f1 - attn
    window = model.config.attention.sliding_window

    def flops(p: int) -> float:
        w = window or p
        ctx = p * (p + 1) / 2 if p <= w else w * (w + 1) / 2 + (p - w) * w
        return per_token * p + attn * ctx

    return flops


class PrefixCache:
    """The tree, the checkpoint pool and the eviction policy (see the module docstring). Used only through
    :class:`hybrid.cache.manager.CacheManager`."""

    def __init__(self, kv: PagedKVCache, ssm: SSMStateCache, *, state_bytes: int, checkpoint_interval: int | None,
                 flop_weight: float, prefill_flops):
        if state_bytes < 0:
            raise ValueError(f"prefix_state_bytes must be >= 0, got {state_bytes}")
        if checkpoint_interval is not None and checkpoint_interval < 1:
            raise ValueError(f"prefix_checkpoint_interval must be >= 1 token or None, got {checkpoint_interval}")
        if flop_weight < 0:
            raise ValueError(f"prefix_flop_weight must be >= 0, got {flop_weight}")
        self.kv, self.ssm = kv, ssm
        self.block_size = kv.block_size
        self.has_kv = kv.enabled
        self.has_state = bool(ssm.pools)
        self.checkpoints = StateCheckpoints(ssm, state_bytes)
        if self.has_state and self.checkpoints.capacity < 1:
            raise ValueError(f"prefix_state_bytes={state_bytes} holds no Mamba state checkpoint (one takes "
                             f"{self.checkpoints.bytes_per_checkpoint} bytes), so no prompt could ever hit; "
                             "raise it or turn prefix caching off")
        self.interval = checkpoint_interval
        self.flop_weight = flop_weight
        self.flops = prefill_flops
        self.root = Node(None, (), 0, NULL_BLOCK)
        self._tick = 0
        self.num_nodes = 0
        self.evicted_blocks = 0
        self.evicted_checkpoints = 0

    # ---- queries ---------------------------------------------------------------------------------
    def _resumable(self, node: Node) -> bool:
        if node is self.root:
            return True
        if self.has_state and node.checkpoint is None:
            return False
        return not self.has_kv or node.block != NULL_BLOCK

    def touch(self, node: Node) -> None:
        self._tick += 1
        while node is not None:
            node.last_use = self._tick
            node = node.parent

    def match(self, tokens: list[int], limit: int) -> Match:
        """Longest resumable prefix of ``tokens`` no longer than ``limit`` tokens, and the branch point."""
        bs = self.block_size
        node, pos, best = self.root, 0, self.root
        while True:
            for key, child in node.partials.items():
                if child.end <= limit and child.end > best.end and tuple(tokens[pos:child.end]) == key \
                        and self._resumable(child):
                    best = child
            key = tuple(tokens[pos:pos + bs])
            child = node.children.get(key) if len(key) == bs else None
            if child is None:
                break
            node, pos = child, pos + bs
            if pos <= limit and self._resumable(node):
                best = node
        rest = tokens[pos:pos + bs]
        keys = list(node.children) + list(node.partials)
        common = max((_common_prefix(k, rest) for k in keys), default=0)
        matched = pos + common
        # a branch point where some path goes on past ``matched`` with another token
        branch = any(_common_prefix(k, rest) == common < len(k) for k in keys)
        shared = [n.block for n in best.path() if len(n.tokens) == bs]
        return Match(best, best.end, matched, branch, shared)

    def wanted_positions(self, match: Match, n_tokens: int, prompt_len: int, limit: int) -> list[int]:
        """Admission: the positions past the hit where this sequence's prefill saves a checkpoint (the
        branch point, the end of the prompt, every ``interval`` tokens); ends there are exact chunk ends.
        ``limit`` caps what a hit of this request may use; the branch point is saved no later than it (a
        scoring request sharing a context with the next one saves the position before its continuation),
        and the prompt end one token early, so the same prompt sent again resumes at its last token."""
        start = match.position
        want = set()
        if match.branch:  # no later than this request's own limit: a scored continuation needs the token before it
            want.add(min(match.matched, limit))
        if prompt_len - 1 > start:
            want.add(prompt_len - 1)
        if self.interval:
            want.update(range((start // self.interval + 1) * self.interval, n_tokens, self.interval))
        return sorted(p for p in want if start < p < n_tokens and (self.has_state or p % self.block_size))

    # ---- inserting -------------------------------------------------------------------------------
    def insert_full(self, cursor: Node, tokens: list[int], blocks: list[int], n_computed: int) -> Node | None:
        """Add the full blocks of ``tokens[:n_computed]`` below ``cursor`` (the deepest node of this
        sequence already in the tree); the tree takes a reference to each block it did not hold. Returns
        the new cursor, or None where the path cannot be followed (its node was evicted, or a window let
        the block go before it was inserted)."""
        bs = self.block_size
        while cursor.end + bs <= n_computed:
            key = tuple(tokens[cursor.end:cursor.end + bs])
            child = cursor.children.get(key)
            if child is None:
                block = blocks[cursor.end // bs] if self.has_kv else NULL_BLOCK
                if self.has_kv:
                    if block == NULL_BLOCK:
                        return None
                    self.kv.allocator.share(block)
                child = Node(cursor, key, cursor.end, block)
                cursor.children[key] = child
                self.num_nodes += 1
            cursor = child
        return cursor

    def save(self, cursor: Node, tokens: list[int], blocks: list[int], position: int, slot: int, *,
             hand_over: bool) -> None:
        """Save what resuming at ``position`` needs: a partial block past ``cursor`` (copied, or taken over
        from the ending sequence with ``hand_over``) and the Mamba states of ``slot``. ``cursor`` ends at
        the last block boundary at or before ``position``. Does nothing when there is no room."""
        if cursor.dead or cursor.end != position // self.block_size * self.block_size:
            return
        key = tuple(tokens[cursor.end:position])
        node = cursor if not key else cursor.partials.get(key)
        if node is self.root:
            return
        if self.has_state and (node is None or node.checkpoint is None) and self.checkpoints.num_free == 0:
            self._evict_checkpoint(protect=set(cursor.path()) | ({node} if node else set()))
            if self.checkpoints.num_free == 0 or cursor.dead:
                return
        if node is None:  # a new partial-block leaf
            block = NULL_BLOCK
            if self.has_kv:
                src = blocks[position // self.block_size]
                if hand_over:  # the sequence ends here: the tree takes its block over, no copy
                    self.kv.allocator.share(src)
                    block = src
                else:  # the sequence goes on writing into its block: the tree keeps a copy
                    if self.kv.allocator.num_free == 0 and not self.evict_blocks(1, set(cursor.path())):
                        return
                    if cursor.dead:
                        return
                    (block,) = self.kv.allocator.allocate(1)
                    self.kv.copy_block(src, block)  # with its scales, for an int8 / fp8 pool
            node = Node(cursor, key, cursor.end, block)
            cursor.partials[key] = node
            self.num_nodes += 1
        if self.has_state and node.checkpoint is None:
            node.checkpoint = self.checkpoints.save(slot)
        self.touch(node)

    # ---- eviction --------------------------------------------------------------------------------
    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n is not self.root:
                yield n
            stack.extend(n.children.values())
            stack.extend(n.partials.values())

    def _resume_point_above(self, node: Node) -> int:
        n = node.parent
        while n is not None and not self._resumable(n):
            n = n.parent
        return n.end if n is not None else 0

    def _flops_saved(self, node: Node) -> float:
        """Prefill FLOPs a hit at ``node`` saves over the nearest resumable point above it (0 when
        nothing can resume at ``node``)."""
        if not self._resumable(node):
            return 0.0
        return self.flops(node.end) - self.flops(self._resume_point_above(node))

    def _node_bytes(self, node: Node) -> int:
        b = self.kv.bytes_per_block if self.has_kv and node.block != NULL_BLOCK else 0
        return b + (self.checkpoints.bytes_per_checkpoint if node.checkpoint is not None else 0)

    def _lowest_utility(self, candidates: list[Node]) -> Node:
        """Marconi's utility: recency + flop_weight * FLOPs saved per byte, each normalised over the
        candidates; the lowest goes."""
        uses = [n.last_use for n in candidates]
        lo, hi = min(uses), max(uses)
        eff = [self._flops_saved(n) / max(1, self._node_bytes(n)) for n in candidates]
        top = max(eff) or 1.0

        def utility(i: int) -> float:
            recency = (uses[i] - lo) / (hi - lo) if hi > lo else 1.0
            return recency + self.flop_weight * eff[i] / top

        return candidates[min(range(len(candidates)), key=lambda i: (utility(i), uses[i]))]

    def evictable_leaves(self, protect=frozenset()) -> list[Node]:
        """Leaves whose KV block only the tree references (nothing running uses them)."""
        return [n for n in self._nodes() if n.is_leaf and n not in protect and n.block != NULL_BLOCK
                and self.kv.allocator.ref_counts[n.block] == 1]

    def evict_blocks(self, n_blocks: int, protect=frozenset()) -> bool:
        """Free ``n_blocks`` more KV blocks by evicting leaves (lowest utility first); True if done."""
        target = self.kv.allocator.num_free + n_blocks
        while self.kv.allocator.num_free < target:
            leaves = self.evictable_leaves(protect)
            if not leaves:
                return False
            victim = self._lowest_utility(leaves)
            self._remove(victim)
            self.evicted_blocks += 1
        return True

    def _evict_checkpoint(self, protect=frozenset()) -> None:
        with_ckpt = [n for n in self._nodes() if n.checkpoint is not None and n not in protect]
        if not with_ckpt:
            return
        victim = self._lowest_utility(with_ckpt)
        self.checkpoints.release(victim.checkpoint)
        victim.checkpoint = None
        self.evicted_checkpoints += 1
        if len(victim.tokens) < self.block_size:  # a partial node is there only for its checkpoint
            self._remove(victim)
        self._prune(victim)

    def _remove(self, node: Node) -> None:
        assert node.is_leaf and node is not self.root
        parent = node.parent
        table = parent.children if len(node.tokens) == self.block_size else parent.partials
        del table[node.tokens]
        if node.block != NULL_BLOCK:
            self.kv.allocator.release([node.block])
        if node.checkpoint is not None:
            self.checkpoints.release(node.checkpoint)
            node.checkpoint = None
        node.dead = True
        self.num_nodes -= 1

    def _prune(self, node: Node) -> None:
        """Drop leaves that hold nothing (a model without attention: token-only nodes past the last
        checkpoint), walking up."""
        while node is not self.root and not node.dead and node.is_leaf and node.block == NULL_BLOCK \
                and node.checkpoint is None:
            parent = node.parent
            self._remove(node)
            node = parent

    def prune_path(self, node: Node | None) -> None:
        if node is not None:
            self._prune(node)

    def clear(self) -> None:
        """Drop everything the tree holds (blocks a running sequence shares stay with it)."""
        for n in sorted(self._nodes(), key=lambda n: -n.start):  # children start after their parents
            self._remove(n)

    # ---- accounting ------------------------------------------------------------------------------
    def blocks_held(self) -> list[int]:
        return [n.block for n in self._nodes() if n.block != NULL_BLOCK]

    def checkpoint_nodes(self) -> list[Node]:
        return [n for n in self._nodes() if n.checkpoint is not None]


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
