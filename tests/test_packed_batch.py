"""build_batch's metadata: the values the ops read (tables padded with the null block, every length tensor's
attached host values equal to its contents), built from host buffers rather than ``torch.tensor`` lists."""

import torch
from hybrid.kernels.packing import attached_values, host_values

from hybrid import recipes
from hybrid.cache import HybridCache
from hybrid.cache.manager import CacheManager
from hybrid.engine.packed_batch import SeqChunk, build_batch, host_tensor
from hybrid.model import HybridLM


def _manager(name: str) -> CacheManager:
    torch.manual_seed(0)
    model = HybridLM(recipes.get(name)).eval()
    return CacheManager(HybridCache.for_model(model, num_blocks=32, block_size=4, max_seqs=4))


def test_decode_and_prefill_metadata_values():
    m = _manager("hybrid-1to7-tiny")
    for sid, (have, new) in enumerate([(9, 1), (2, 1), (0, 6)]):
        m.admit(sid, 0)
        m.grow(sid, have + new)
    chunks = [SeqChunk(0, [5], 9), SeqChunk(1, [7], 2), SeqChunk(2, [1, 2, 3, 4, 5, 6], 0)]
    b = build_batch(m, chunks)
    assert b.tokens.tolist() == [5, 7, 1, 2, 3, 4, 5, 6] and b.tokens.dtype == torch.int64
    assert b.positions.tolist() == [9, 2, 0, 1, 2, 3, 4, 5]
    assert attached_values(b.positions) == tuple(b.positions.tolist())
    assert b.last_token_index.tolist() == [0, 1, 7]
    want_slots = [s for c in chunks for s in m.pool_slots(c.seq_id, c.start, c.start + len(c.tokens))]
    assert b.slot_mapping.tolist() == want_slots
    d, p = b.decode, b.prefill
    assert d.num_seqs == 2 and p.num_seqs == 1
    assert d.seq_lens.dtype == torch.int32 and d.seq_lens.tolist() == [10, 3]
    assert d.cu_seqlens.tolist() == [0, 1, 2] and p.cu_seqlens.tolist() == [0, 6]
    for t in (d.seq_lens, d.cu_seqlens, d.state_slots, p.seq_lens, p.cu_seqlens, p.state_slots):
        assert host_values(t) == tuple(t.tolist())
    # each row: the sequence's blocks, then the null block 0 up to the widest row
    tables = [m.block_table(0), m.block_table(1)]
    width = max(map(len, tables))
    assert d.block_tables.shape == (2, width) and d.block_tables.dtype == torch.int32
    assert d.block_tables.is_contiguous()
    assert d.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert d.state_slots.tolist() == [m.state_slot(0), m.state_slot(1)]


def test_host_tensor_owns_its_buffer():
    t = host_tensor([3, -1, 2**40], torch.int64, "cpu")
    junk = [host_tensor([7] * 64, torch.int64, "cpu") for _ in range(100)]  # reuse of a freed buffer would show
    assert t.tolist() == [3, -1, 2**40] and len(junk) == 100
    u = host_tensor([1, 2], torch.int32, torch.device("cpu"))
    assert u.dtype == torch.int32 and u.tolist() == [1, 2]
