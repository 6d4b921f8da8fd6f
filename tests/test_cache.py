"""Block allocator, KV pools and state slots: accounting in bytes, capacity, property tests."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid import HybridCache, HybridLM, recipes
from hybrid.cache import BlockAllocator, CacheFullError, sequences_that_fit


def test_allocator_counts_references_and_refuses_when_full():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free == 1
    with pytest.raises(CacheFullError, match="asked for 2 KV blocks, 1 of 4 are free"):
        alloc.allocate(2)
    assert alloc.num_free == 1  # a failed allocation takes nothing
    alloc.share(a[0])
    alloc.release(a)
    assert alloc.num_free == 3 and alloc.ref_counts[a[0]] == 1  # still held by the sharer
    alloc.release([a[0]])
    assert alloc.num_free == 4
    with pytest.raises(ValueError, match="released more often"):
        alloc.release([a[0]])
    with pytest.raises(ValueError, match="only a live block can be shared"):
        alloc.share(a[0])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "release"]), st.integers(0, 5), st.integers(0, 99)),
                max_size=60))
def test_allocator_never_leaks_or_double_hands_out(ops):
    """Random allocate / share / release against a model of who holds what."""
    alloc = BlockAllocator(8)
    owners: list[list[int]] = []  # each entry: the blocks one owner holds a reference to
    for op, n, pick in ops:
        if op == "alloc":
            if n <= alloc.num_free:
                owners.append(alloc.allocate(n))
            else:
                with pytest.raises(CacheFullError):
                    alloc.allocate(n)
        elif op == "share" and owners and owners[pick % len(owners)]:
            src = owners[pick % len(owners)]
            alloc.share(src[0])
            owners.append([src[0]])
        elif op == "release" and owners:
            alloc.release(owners.pop(pick % len(owners)))
        held = [b for blocks in owners for b in blocks]
        for b in range(8):
            assert alloc.ref_counts[b] == held.count(b)
        assert sorted(alloc._free) == [b for b in range(8) if b not in held]
    for blocks in owners:
        alloc.release(blocks)
    assert alloc.num_free == 8 and not any(alloc.ref_counts)


def test_kv_tables_and_slot_mapping():
    cfg = recipes.get("llama-tiny")
    cache = HybridCache(cfg, num_blocks=6, block_size=4, max_seqs=2)
    kv = cache.kv
    kv.add_sequence(7)
    kv.reserve(7, 9)
    assert len(kv.tables[7]) == 3 and kv.allocator.num_free == 3
    t = kv.tables[7]
    assert kv.slots(7, 3, 6) == [t[0] * 4 + 3, t[1] * 4, t[1] * 4 + 1]
    assert kv.can_hold(7, 24) and not kv.can_hold(7, 25)
    kv.free_sequence(7)
    assert kv.allocator.num_free == 6
    assert kv.pools[0][0].shape == (6, 4, 2, 16)  # [blocks, block_size, kv heads, head dim]


def test_state_slots_are_zeroed_and_reused():
    cache = HybridCache(recipes.get("jamba-tiny"), num_blocks=4, max_seqs=2)
    ssm = cache.ssm
    s0 = ssm.allocate(0)
    for conv, state in ssm.pools.values():
        conv[s0].fill_(1.0)
        state[s0].fill_(1.0)
    ssm.allocate(1)
    with pytest.raises(CacheFullError, match="all 2 state slots"):
        ssm.allocate(2)
    ssm.free(0)
    assert ssm.allocate(2) == s0
    assert all(not conv[s0].any() and not state[s0].any() for conv, state in ssm.pools.values())
    # fp32 SSM state by default, configurable; conv state follows the KV dtype unless given
    half = HybridCache(recipes.get("jamba-tiny"), num_blocks=4, max_seqs=2, kv_dtype=torch.bfloat16,
                       ssm_dtype=torch.bfloat16)
    conv, state = next(iter(half.ssm.pools.values()))
    assert conv.dtype == state.dtype == torch.bfloat16
    assert next(iter(ssm.pools.values()))[1].dtype == torch.float32


@pytest.mark.parametrize("name", [n for n in recipes.names() if n.endswith("-tiny")])
def test_bytes_agree_with_the_model_and_the_tensors(name):
    model = HybridLM(recipes.get(name))
    cache = HybridCache.for_model(model, cache_bytes=2**20, max_seqs=3, block_size=8)
    rep = cache.report()
    assert rep.kv_bytes_per_token == model.kv_bytes_per_token(torch.float32)
    assert rep.state_bytes_per_sequence == model.state_bytes_per_sequence(torch.float32)
    tensor_bytes = sum(t.numel() * t.element_size() for pair in cache.kv.pools.values() for t in pair)
    tensor_bytes += sum(t.numel() * t.element_size() for pair in cache.ssm.pools.values() for t in pair)
    assert rep.bytes_total == tensor_bytes <= 2**20
    assert rep.bytes_in_use == 0 and rep.bytes_free == rep.bytes_total
    cache.ssm.allocate(0)
    if cache.kv.enabled:
        cache.kv.add_sequence(0)
        cache.kv.reserve(0, 20)  # 3 blocks of 8
    rep = cache.report()
    assert rep.bytes_in_use == 3 * 8 * rep.kv_bytes_per_token + rep.state_bytes_per_sequence
    assert rep.bytes_free == rep.bytes_total - rep.bytes_in_use


def test_one_in_eight_hybrid_holds_about_8x_the_tokens():
    """Same width, same depth, same bytes: 1 attention layer in 8 instead of 8 in 8."""
    attn_only = recipes.attention_family("tiny", 1.0)
    hybrid_cfg = recipes.get("hybrid-1to7-tiny")
    assert attn_only.d_model == hybrid_cfg.d_model and attn_only.count("attention") == 8
    assert hybrid_cfg.count("attention") == 1
    budget = 16 * 2**20
    caps = [HybridCache(cfg, cache_bytes=budget, max_seqs=8).report().token_capacity
            for cfg in (attn_only, hybrid_cfg)]
    assert 7.5 < caps[1] / caps[0] <= 8.0
    fits = [sequences_that_fit(cfg, 4 * budget, 4096, kv_dtype=torch.float32) for cfg in (attn_only, hybrid_cfg)]
    assert 7.0 < fits[1] / fits[0] <= 8.0


def test_sizing_errors_give_the_numbers():
    with pytest.raises(ValueError, match=r"the state of 64 sequences takes \d+ bytes"):
        HybridCache(recipes.get("hybrid-1to7-tiny"), cache_bytes=10_000, max_seqs=64)
    with pytest.raises(ValueError, match="num_slots"):
        HybridCache(recipes.get("llama-tiny"), num_blocks=4, max_seqs=0)
    assert math.isinf(HybridCache(recipes.get("mamba1-tiny"), num_blocks=4).kv.capacity_tokens)


def test_sliding_window_trim_releases_blocks_behind_the_window():
    cache = HybridCache(recipes.get("samba-tiny"), num_blocks=10, block_size=4, max_seqs=1)  # window 16
    kv = cache.kv
    kv.add_sequence(0)
    kv.reserve(0, 30)
    kv.trim(0, 30)  # the next token (position 30) sees positions 15..30: blocks 0-2 (positions 0-11) go
    assert kv.tables[0][:3] == [None, None, None] and None not in kv.tables[0][3:]
    assert kv.allocator.num_free == 10 - 5
    assert kv.slots(0, 28, 30) == [kv.tables[0][7] * 4, kv.tables[0][7] * 4 + 1]
    kv.free_sequence(0)
    assert kv.allocator.num_free == 10
    assert kv.blocks_held_at_most(1000, chunk=8) == 7  # ceil((15 + 8) / 4) + 1
    plain = HybridCache(recipes.get("llama-tiny"), num_blocks=10, block_size=4, max_seqs=1).kv
    plain.add_sequence(0)
    plain.reserve(0, 30)
    plain.trim(0, 30)
    assert None not in plain.tables[0] and plain.blocks_held_at_most(1000, chunk=8) == 250
