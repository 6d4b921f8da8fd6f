"""The packed inference forward: many sequences of different lengths as one flat batch.

A step's sequences are concatenated (no padding): one-token sequences first (decodes: they take
the O(1) Mamba step ops and the paged decode-attention op), then prefills and prefill chunks.
Attention layers write and read K/V through the :class:`~hybrid.cache.PagedKVCache`; Mamba layers
read and write their state rows in the :class:`~hybrid.cache.SSMStateCache`; every other
sub-layer (MLP, mixture of experts, ...) is token-wise and runs its normal forward on ``[T, d]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import HybridCache


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence for this step: ``tokens`` go at positions ``start..start+len-1``
    (``start`` tokens of the sequence are already in the cache)."""

    seq_id: int
    tokens: list[int]
    start: int


@dataclass(frozen=True)
class PackedBatch:
    """One step's flat batch. Sequence ``b``'s new tokens are ``tokens[cu_seqlens[b]:cu_seqlens[b+1]]``.

    tokens, positions, slot_mapping: [T]; cu_seqlens: [B+1] int32; seq_lens: [B] int32 (cached
    history + new tokens); block_tables: [B, max_blocks] int32; state_slots: [B] int64;
    the first ``num_decodes`` sequences have one new token each.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    state_slots: torch.Tensor
    num_decodes: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]


def build_batch(cache: HybridCache, chunks: list[SeqChunk]) -> PackedBatch:
    """Pack ``chunks`` (one-token chunks first) into a batch. Each sequence must already own a
    state slot and enough KV blocks for ``start + len(tokens)`` tokens."""
    if not chunks:
        raise ValueError("build_batch: no sequences to run")
    lengths = [len(c.tokens) for c in chunks]
    if min(lengths) < 1:
        raise ValueError("build_batch: every sequence needs at least one new token")
    num_decodes = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
    if any(n == 1 for n in lengths[num_decodes:]):
        raise ValueError("build_batch: put the one-token (decode) sequences first")
    device, kv = cache.device, cache.kv
    missing = [c.seq_id for c in chunks
               if c.seq_id not in cache.ssm.owner or (kv.enabled and c.seq_id not in kv.tables)]
    if missing:
        raise ValueError(f"build_batch: sequences {missing} hold no state slot / block table in this cache")
    tokens, positions, slots, cu = [], [], [], [0]
    for c in chunks:
        tokens.extend(c.tokens)
        positions.extend(range(c.start, c.start + len(c.tokens)))
        slots.extend(kv.slots(c.seq_id, c.start, c.start + len(c.tokens)))
        cu.append(cu[-1] + len(c.tokens))
    tables = [kv.tables[c.seq_id] if kv.enabled else [] for c in chunks]
    width = max(1, max(len(t) for t in tables))
    table = torch.zeros(len(chunks), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        # blocks a sliding window has dropped (None) are never read; any valid id stands in
        table[b, :len(t)] = torch.tensor([0 if x is None else x for x in t], dtype=torch.int32)
    state_slots = [cache.ssm.owner[c.seq_id] for c in chunks]

    def tensor(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    return PackedBatch(tokens=tensor(tokens, torch.long), positions=tensor(positions, torch.long),
                       cu_seqlens=tensor(cu, torch.int32),
                       seq_lens=tensor([c.start + len(c.tokens) for c in chunks], torch.int32),
                       block_tables=table.to(device), slot_mapping=tensor(slots, torch.long),
                       state_slots=tensor(state_slots, torch.long), num_decodes=num_decodes)


def forward_packed(model, batch: PackedBatch, cache: HybridCache, *, all_logits: bool = False) -> torch.Tensor:
    """Run ``model`` on a packed batch, updating ``cache``.

    Returns the logits of each sequence's last new token, [B, vocab] (what a sampler needs), or
    with ``all_logits`` those of every new token, [T, vocab].
    """
    x = model.embed(batch.tokens)
    for i, layer in enumerate(model.layers):
        if layer.kind == "attention":
            x = x + layer.mixer.forward_packed(layer.norm(x), batch, *cache.kv.pools[i])
        elif layer.kind in ("mamba2", "mamba1"):
            x = x + layer.mixer.forward_packed(layer.norm(x), batch, *cache.ssm.pools[i])
        else:  # token-wise sub-layers (MLP, experts, ...) run their own forward on the packed tokens
            x = layer(x[None])[0]
    if not all_logits:
        x = x[batch.cu_seqlens[1:].long() - 1]
    return model.logits(x)
