"""Block allocator, KV pools and state slots, the cache manager: accounting in bytes from the layers' cache
specs, capacity, the null block, forks, property tests."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid import HybridCache, HybridLM, recipes
from hybrid.cache import NULL_BLOCK, BlockAllocator, CacheFullError, sequences_that_fit
from hybrid.cache.manager import CacheManager
from hybrid.cache.specs import CacheDtypes
from hybrid.layers.registry import cache_specs

TINY = [n for n in recipes.names() if n.endswith("-tiny")]
SMALL = [n for n in recipes.names() if n.endswith("-small")]


def test_allocator_counts_references_and_refuses_when_full():
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free == 1 and NULL_BLOCK not in a
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
    with pytest.raises(ValueError, match="null block"):
        alloc.share(NULL_BLOCK)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "share", "release"]), st.integers(0, 5), st.integers(0, 99)),
                max_size=60))
def test_allocator_never_leaks_or_double_hands_out(ops):
    """Random allocate / share / release against a model of who holds what; the null block is never handed out."""
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
        assert NULL_BLOCK not in held
        for b in range(1, 9):
            assert alloc.ref_counts[b] == held.count(b)
        assert sorted(alloc.free_ids()) == [b for b in range(1, 9) if b not in held]
    for blocks in owners:
        alloc.release(blocks)
    assert alloc.num_free == 8 and not any(alloc.ref_counts)


def test_block_tables_and_slot_mapping():
    cfg = recipes.get("llama-tiny")
    cache = HybridCache(cfg, num_blocks=6, block_size=4, max_seqs=2)
    m = CacheManager(cache)
    m.admit(7, 9)
    t = m.block_table(7)
    assert len(t) == 3 and m.num_free_blocks == 3 and NULL_BLOCK not in t
    assert m.pool_slots(7, 3, 6) == [t[0] * 4 + 3, t[1] * 4, t[1] * 4 + 1]
    assert m.can_grow(7, 24) and not m.can_grow(7, 25)
    with pytest.raises(ValueError, match="already holds"):
        m.admit(7, 1)
    m.free(7)
    assert m.num_free_blocks == 6 and m.num_free_slots == 2 and not m.holds(7)
    # [blocks + the null block, block_size, kv heads, head dim]
    assert cache.kv.pools[0][0].shape == (7, 4, 2, 16)


def test_state_slots_are_zeroed_and_reused():
    cache = HybridCache(recipes.get("jamba-tiny"), num_blocks=4, max_seqs=2)
    ssm = cache.ssm
    s0 = ssm.allocate()
    for conv, state in ssm.pools.values():
        conv[s0].fill_(1.0)
        state[s0].fill_(1.0)
    ssm.allocate()
    with pytest.raises(CacheFullError, match="all 2 state slots"):
        ssm.allocate()
    ssm.free(s0)
    with pytest.raises(ValueError, match="not in use"):
        ssm.free(s0)
    assert ssm.allocate() == s0
    assert all(not conv[s0].any() and not state[s0].any() for conv, state in ssm.pools.values())
    assert ssm.scratch_slot == 2 and next(iter(ssm.pools.values()))[0].shape[0] == 3  # + the scratch row
    # fp32 SSM state by default, configurable; conv state follows the KV dtype unless given
    half = HybridCache(recipes.get("jamba-tiny"), num_blocks=4, max_seqs=2, kv_dtype=torch.bfloat16,
                       ssm_dtype=torch.bfloat16)
    conv, state = next(iter(half.ssm.pools.values()))
    assert conv.dtype == state.dtype == torch.bfloat16
    assert next(iter(ssm.pools.values()))[1].dtype == torch.float32


def _tensor_bytes(cache: HybridCache) -> int:
    pairs = [*cache.kv.pools.values(), *cache.ssm.pools.values()]
    return sum(t.numel() * t.element_size() for pair in pairs for t in pair)


@pytest.mark.parametrize("name", TINY + SMALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_from_specs_equal_what_the_cache_allocates(name, dtype):
    """For every recipe and dtype: the specs' bytes per token / per sequence, the model's accounting, the
    report and the tensors the cache really allocates (on the meta device: no memory) all agree."""
    cfg = recipes.get(name)
    with torch.device("meta"):
        model = HybridLM(cfg).to(dtype)
    spec = model.cache_spec()
    assert spec == cache_specs(cfg, CacheDtypes(kv=dtype, conv=dtype, ssm=torch.float32))
    assert model.kv_bytes_per_token() == spec.kv_bytes_per_token
    assert model.state_bytes_per_sequence() == spec.state_bytes_per_sequence
    cache = HybridCache(cfg, num_blocks=5, block_size=16, max_seqs=3, kv_dtype=dtype, device="meta")
    blocks = 6 if cfg.count("attention") else 0  # + the null block
    assert _tensor_bytes(cache) == cache.bytes_total == (blocks * 16 * spec.kv_bytes_per_token
                                                         + 4 * spec.state_bytes_per_sequence)
    rep = cache.report()
    assert (rep.kv_bytes_per_token, rep.state_bytes_per_sequence) == (spec.kv_bytes_per_token,
                                                                      spec.state_bytes_per_sequence)
    window = cfg.attention.sliding_window if cfg.count("attention") else None
    held = 100 if window is None else min(100, window)  # a window keeps at most its own length
    assert spec.bytes_per_sequence(100, block_size=16) == (-(-held // 16) * 16 * spec.kv_bytes_per_token
                                                           + spec.state_bytes_per_sequence)


@pytest.mark.parametrize("name", TINY)
def test_report_counts_what_sequences_hold(name):
    model = HybridLM(recipes.get(name))
    cache = HybridCache.for_model(model, cache_bytes=2**20, max_seqs=3, block_size=8)
    rep = cache.report()
    assert rep.bytes_total == _tensor_bytes(cache) <= 2**20
    assert rep.bytes_in_use == 0 and rep.bytes_free == rep.bytes_total
    m = CacheManager(cache)
    m.admit(0, 20)  # 3 blocks of 8
    rep = cache.report()
    assert rep.bytes_in_use == 3 * 8 * rep.kv_bytes_per_token + rep.state_bytes_per_sequence
    assert rep.bytes_free == rep.bytes_total - rep.bytes_in_use
    assert rep.state_slots_in_use == 1 and rep.kv_blocks_in_use == (3 if cache.kv.enabled else 0)


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
    # a budget of a few dozen sequences, so whole-sequence rounding (and the null block) moves the ratio little
    fits = [sequences_that_fit(cfg, 16 * budget, 4096, kv_dtype=torch.float32) for cfg in (attn_only, hybrid_cfg)]
    assert 7.0 < fits[1] / fits[0] <= 8.0


def test_sizing_errors_give_the_numbers():
    with pytest.raises(ValueError, match=r"the state of 64 sequences \(\+1 scratch row\) takes \d+ bytes"):
        HybridCache(recipes.get("hybrid-1to7-tiny"), cache_bytes=10_000, max_seqs=64)
    with pytest.raises(ValueError, match="num_slots"):
        HybridCache(recipes.get("llama-tiny"), num_blocks=4, max_seqs=0)
    assert math.isinf(HybridCache(recipes.get("mamba1-tiny"), num_blocks=4).kv.capacity_tokens)


def test_sliding_window_trim_points_dropped_blocks_at_the_null_block():
    cache = HybridCache(recipes.get("samba-tiny"), num_blocks=10, block_size=4, max_seqs=2)  # window 16
    m = CacheManager(cache)
    m.admit(0, 30)
    m.admit(1, 4)
    m.trim(0, 30)  # the next token (position 30) sees positions 15..30: blocks 0-2 (positions 0-11) go
    t = m.block_table(0)
    assert t[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in t[3:]
    assert m.num_free_blocks == 10 - 8 - 1 + 3  # 8 blocks for 0, 1 for 1, 3 given back
    assert m.pool_slots(0, 28, 30) == [t[7] * 4, t[7] * 4 + 1]
    # the freed blocks go to the next sequence, never block 0, which no live sequence owns
    m.grow(1, 16)
    assert NULL_BLOCK not in m.block_table(1)
    m.free(0)
    m.free(1)
    assert m.num_free_blocks == 10
    assert cache.kv.blocks_held_at_most(1000, chunk=8) == 7  # ceil((15 + 8) / 4) + 1
    plain = CacheManager(HybridCache(recipes.get("llama-tiny"), num_blocks=10, block_size=4, max_seqs=1))
    plain.admit(0, 30)
    plain.trim(0, 30)
    assert NULL_BLOCK not in plain.block_table(0) and plain.kv.blocks_held_at_most(1000, chunk=8) == 250


def test_fork_shares_full_blocks_and_copies_the_partial_one_and_the_state():
    cache = HybridCache(recipes.get("hybrid-1to7-tiny"), num_blocks=8, block_size=4, max_seqs=3)
    m = CacheManager(cache)
    m.admit(0, 10)  # blocks: 4 + 4 + 2 of 4
    for conv, ssm in cache.ssm.pools.values():
        conv[m.state_slot(0)].fill_(2.0)
        ssm[m.state_slot(0)].fill_(3.0)
    k_pool = next(iter(cache.kv.pools.values()))[0]
    k_pool[m.block_table(0)[2]].fill_(5.0)
    m.fork(0, 1, 10)
    a, b = m.block_table(0), m.block_table(1)
    assert a[:2] == b[:2] and a[2] != b[2]  # full blocks shared, the partial last one copied
    assert all(cache.kv.allocator.ref_counts[x] == 2 for x in a[:2]) and cache.kv.allocator.ref_counts[b[2]] == 1
    assert torch.equal(k_pool[b[2]], k_pool[a[2]])
    assert m.state_slot(1) != m.state_slot(0)
    assert all(bool((conv[m.state_slot(1)] == 2.0).all() and (ssm[m.state_slot(1)] == 3.0).all())
               for conv, ssm in cache.ssm.pools.values())
    m.free(0)
    assert all(cache.kv.allocator.ref_counts[x] == 1 for x in b)
    m.free(1)
    assert m.num_free_blocks == 8 and m.num_free_slots == 3
    with pytest.raises(ValueError, match="fewer than"):
        m.admit(2, 4)
        m.fork(2, 3, 9)


def test_state_pool_rounding_is_its_write_then_read():
    """StatePool.rounding (what a speculative verify applies to its working copy after each position) gives
    rows exactly as a write then a read of the pool leaves them; float storage and stochastic rounding: none."""
    from hybrid.cache import StatePool

    torch.manual_seed(0)
    rows = torch.randn(3, 4, 8, 16)
    pool = StatePool((4, 8, 16), torch.int8, 5, 4 * 8)
    slots = torch.tensor([0, 2, 4])
    pool.write(slots, rows)
    assert torch.equal(pool.rounding(rows), pool.read(slots))
    assert not torch.equal(pool.rounding(rows), rows)
    assert StatePool((4, 8, 16), torch.float32, 5, 1).rounding is None
    assert StatePool((4, 8, 16), torch.int8, 5, 32, stochastic=True).rounding is None
