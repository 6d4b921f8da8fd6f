"""One inference step's flat batch: many sequences of different lengths, no padding.

A step's sequences are concatenated, one-token sequences first (decodes: they take the O(1) Mamba step
ops and the paged decode-attention op), then speculative verify chunks (a decoding sequence's last token and
its draft tokens: attention runs them as prefill chunks, the Mamba layers with the step ops, keeping the
state at every position), then prefills and prefill chunks. :func:`build_batch` makes the
metadata once per step and validates it once; the ops trust it (see :mod:`hybrid.kernels.packing`):
every length tensor carries its host copy, and the decode and prefill groups come pre-split, so no layer
slices, re-validates or reads a tensor back.

``positions`` are RoPE positions; ``seq_lens`` count the tokens in a sequence's blocks (its KV length), which
SnapKV's prompt compression makes smaller than the next position (:mod:`hybrid.cache.pruning`); ``observe`` lists
the rows whose queries the attention layers hand to SnapKV (its observation window).
"""

from __future__ import annotations

import array
from dataclasses import dataclass, replace

import torch

from ..cache.manager import CacheManager
from ..cache.pruning import ObservedRows
from ..kernels.packing import with_host_values
from ..speculative.verify_states import VerifyStates


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence for this step: ``tokens`` go at positions ``start..start+len-1``
    (``start`` tokens of the sequence are already in the cache)."""

    seq_id: int
    tokens: list[int]
    start: int


@dataclass(frozen=True)
class SeqGroup:
    """The decodes, or the prefills, of a step: what their attention and Mamba ops read.

    cu_seqlens: [n+1] int32, relative to the group's first token; seq_lens: [n] int32 (cached history +
    new tokens: the KV length the attention ops read); block_tables: [n, max_blocks] int32; state_slots: [n]
    int64. The length tensors carry their host values.
    """

    tokens: slice  # the group's rows of the packed token dimension
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class PackedBatch:
    """One step's flat batch. tokens, positions, slot_mapping: [T]; ``last_token_index`` lists the rows whose
    logits the forward returns: each sequence's last new token (what a sampler needs), and every row of a
    verify chunk; ``rope`` the (cos, sin) of every position, computed once for all attention layers (None: each
    layer computes its own).

    ``prefill`` is every sequence of more than one token (what attention runs as prefill). Of those, the
    first ``verify`` ones are speculative verify chunks, with ``verify_states`` collecting their
    per-position Mamba states; ``scan`` is the rest, what the Mamba varlen scans run (== ``prefill`` in a
    step without speculation)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    last_token_index: torch.Tensor
    decode: SeqGroup | None
    prefill: SeqGroup | None
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    verify: SeqGroup | None = None
    verify_states: VerifyStates | None = None
    rest: SeqGroup | None = None  # the prefills after the verify chunks (only set with verify chunks)
    observe: ObservedRows | None = None  # SnapKV observation-window rows (None: none this step)

    @property
    def scan(self) -> SeqGroup | None:
        """The sequences the Mamba layers' varlen scans run: the prefills that are not verify chunks."""
        return self.prefill if self.verify is None else self.rest

    @property
    def num_decodes(self) -> int:
        return self.decode.num_seqs if self.decode is not None else 0

    @property
    def num_seqs(self) -> int:
        return self.num_decodes + (self.prefill.num_seqs if self.prefill is not None else 0)

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    def with_rope(self, rope: tuple[torch.Tensor, torch.Tensor] | None) -> PackedBatch:
        return replace(self, rope=rope)


_TYPECODES = {torch.int32: "i", torch.int64: "q"}


def host_tensor(values: list[int], dtype: torch.dtype, device) -> torch.Tensor:
    """A 1-d int32/int64 tensor of ``values`` (at least one): built on the host from an ``array`` buffer
    (~3 us; ``torch.tensor`` of a list takes ~10, and a decode step's batch is a dozen of them), then moved to
    ``device``. The tensor owns the buffer."""
    t = torch.frombuffer(array.array(_TYPECODES[dtype], values), dtype=dtype)
    return t if getattr(device, "type", device) == "cpu" else t.to(device)


def _lengths(values: list[int], device) -> torch.Tensor:
    return with_host_values(host_tensor(values, torch.int32, device), tuple(values))


def make_group(tokens: slice, lengths: list[int], seq_lens: list[int], tables: list[list[int]],
               slots: list[int], device) -> SeqGroup:
    """A :class:`SeqGroup` from host lists (``lengths``: new tokens per sequence)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    width = max(1, max(len(t) for t in tables))
    flat = []
    for t in tables:  # padded with 0: the null block, never a live one
        flat += t
        flat += [0] * (width - len(t))
    table = host_tensor(flat, torch.int32, device).view(len(tables), width)
    state_slots = with_host_values(host_tensor(slots, torch.int64, device), tuple(slots))
    return SeqGroup(tokens, _lengths(cu, device), _lengths(seq_lens, device), table, state_slots)


def build_batch(manager: CacheManager, chunks: list[SeqChunk], num_verify: int = 0) -> PackedBatch:
    """Pack ``chunks`` (one-token chunks first, then ``num_verify`` speculative verify chunks of 2+ tokens,
    then prefills) into a validated batch. Each sequence must already hold a state slot and enough KV blocks
    for ``start + len(tokens)`` tokens (the scheduler saw to that)."""
    if not chunks:
        raise ValueError("build_batch: no sequences to run")
    lengths = [len(c.tokens) for c in chunks]
    if min(lengths) < 1:
        raise ValueError("build_batch: every sequence needs at least one new token")
    nd = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
    if any(n == 1 for n in lengths[nd:]):
        raise ValueError("build_batch: put the one-token (decode) sequences first")
    if num_verify and (nd + num_verify > len(lengths)):
        raise ValueError(f"build_batch: {num_verify} verify chunks asked for, only {len(lengths) - nd} chunks of "
                         "2+ tokens follow the decodes")
    missing = [c.seq_id for c in chunks if not manager.holds(c.seq_id)]
    if missing:
        raise ValueError(f"build_batch: sequences {missing} hold no cache in this manager")
    seq_lens = [manager.kv_length(c.seq_id, c.start + len(c.tokens)) for c in chunks]
    short = [c.seq_id for c, n in zip(chunks, seq_lens, strict=True) if manager.kv.enabled
             and len(manager.block_table(c.seq_id)) * manager.block_size < n]
    if short:
        raise ValueError(f"build_batch: sequences {short} hold too few KV blocks for their new tokens")
    device = manager.cache.device
    tokens, positions, slots = [], [], []
    for c in chunks:
        tokens.extend(c.tokens)
        positions.extend(range(c.start, c.start + len(c.tokens)))
        slots.extend(manager.pool_slots(c.seq_id, c.start, c.start + len(c.tokens)))
    tables = [manager.block_table(c.seq_id) if manager.kv.enabled else [] for c in chunks]
    state_slots = [manager.state_slot(c.seq_id) for c in chunks]
    groups = []
    for lo, hi, t0 in ((0, nd, 0), (nd, len(chunks), nd)):
        if hi > lo:
            rows = slice(t0, t0 + sum(lengths[lo:hi]))
            groups.append(make_group(rows, lengths[lo:hi], seq_lens[lo:hi], tables[lo:hi], state_slots[lo:hi], device))
        else:
            groups.append(None)
    last, total = [], 0
    for b, n in enumerate(lengths):
        if nd <= b < nd + num_verify:  # a verify chunk: the logits after every one of its tokens are checked
            last.extend(range(total, total + n))
        else:
            last.append(total + n - 1)
        total += n
    verify = verify_states = rest = None
    if num_verify:
        t0, t1 = nd, nd + sum(lengths[nd:nd + num_verify])
        hi = nd + num_verify
        verify = make_group(slice(t0, t1), lengths[nd:hi], seq_lens[nd:hi], tables[nd:hi], state_slots[nd:hi], device)
        verify_states = VerifyStates(lengths[nd:hi], verify.state_slots, device)
        if hi < len(chunks):
            rest = make_group(slice(t1, total), lengths[hi:], seq_lens[hi:], tables[hi:], state_slots[hi:], device)
    return PackedBatch(tokens=host_tensor(tokens, torch.int64, device),
                       positions=with_host_values(host_tensor(positions, torch.int64, device), tuple(positions)),
                       slot_mapping=host_tensor(slots, torch.int64, device),
                       last_token_index=host_tensor(last, torch.int64, device),
                       decode=groups[0], prefill=groups[1], verify=verify, verify_states=verify_states, rest=rest,
                       observe=observed_rows(manager, chunks))


def observed_rows(manager: CacheManager, chunks: list[SeqChunk]) -> ObservedRows | None:
    """The rows of ``chunks`` (packed in this order) that are SnapKV observation-window queries (None: none)."""
    if manager.kv.capture is None:
        return None
    rows, seq_ids, counts, row0 = [], [], [], 0
    for c in chunks:
        span = manager.observed(c.seq_id, c.start, c.start + len(c.tokens))
        if len(span):
            rows.extend(range(row0 + span.start - c.start, row0 + span.stop - c.start))
            seq_ids.append(c.seq_id)
            counts.append(len(span))
        row0 += len(c.tokens)
    if not rows:
        return None
    return ObservedRows(torch.tensor(rows, dtype=torch.long, device=manager.cache.device), tuple(seq_ids),
                        tuple(counts))
