"""Property tests for the prefix cache: random workloads of prompts with shared prefixes, random aborts
and preemptions in a small cache never leak a block or a checkpoint, never write a block the tree holds,
never evict what a running sequence uses, and give every request the output of the cache-off run."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_properties import model  # noqa: F401  (the fixture: the same tiny M*-m model, full and window 5)

from hybrid import Engine, SamplingParams
from hybrid.cache import NULL_BLOCK

NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS = 12, 4, 3


def tree_blocks(engine):
    tree = engine.cache_manager.prefix
    return {id(n): (n, n.block, [p[0][n.block, :len(n.tokens)].clone() for p in engine.cache.kv.pools.values()])
            for n in tree._nodes() if n.block != NULL_BLOCK}


def check_invariants(engine, before=None) -> None:
    m, tree = engine.cache_manager, engine.cache_manager.prefix
    alloc = m.kv.allocator
    assert set(m.seqs) == {r.request_id for r in engine.running}
    owners = {}
    for s in m.seqs.values():
        for b in s.blocks:
            if b != NULL_BLOCK:
                owners[b] = owners.get(b, 0) + 1
    held = tree.blocks_held()
    assert len(held) == len(set(held)), "the tree holds a block twice"
    for b in held:
        owners[b] = owners.get(b, 0) + 1
    for b in range(1, NUM_BLOCKS + 1):  # every reference is a table entry or a tree node: nothing leaks
        assert alloc.ref_counts[b] == owners.get(b, 0), f"block {b}: {alloc.ref_counts[b]} refs"
    assert sorted(alloc.free_ids()) == sorted(set(range(1, NUM_BLOCKS + 1)) - set(owners))
    for r in engine.running:  # every block a sequence writes next is its own: shared blocks are never written
        table = m.block_table(r.request_id)
        for b in table[r.num_computed // BLOCK_SIZE:]:
            assert alloc.ref_counts[b] == 1, "a sequence would write a shared block"
    ckpts = [n.checkpoint for n in tree.checkpoint_nodes()]
    assert sorted(ckpts) == sorted(tree.checkpoints.saved), "a checkpoint leaked or is held twice"
    assert len(ckpts) <= tree.checkpoints.capacity
    for n in tree._nodes():
        assert not n.dead and len(n.tokens) <= BLOCK_SIZE
    if before is not None:  # nothing the tree held was written, nor freed while a sequence used it
        for n, block, kv in before.values():
            if not n.dead:
                assert n.block == block
                for pool, old in zip(engine.cache.kv.pools.values(), kv, strict=True):
                    assert torch.equal(pool[0][block, :len(n.tokens)], old), "a block in the prefix tree was written"
    for r in engine.running:
        table = m.block_table(r.request_id)
        assert len(table) * BLOCK_SIZE >= r.num_computed


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 14), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 99), st.just(0), st.just(0)),
    st.tuples(st.just("preempt"), st.just(0), st.just(0), st.just(0)),
), max_size=20)


@settings(max_examples=30, deadline=None)
@given(ops=OPS, budget=st.integers(2, 12), state_slots=st.integers(1, 4), interval=st.sampled_from([None, 3]))
def test_random_shared_prefix_workloads(model, ops, budget, state_slots, interval):  # noqa: F811
    one = model.state_bytes_per_sequence()
    engine = Engine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_seqs=MAX_SEQS, max_batch_tokens=budget,
                    prefix_caching=True, prefix_state_bytes=state_slots * one, prefix_checkpoint_interval=interval)
    g = torch.Generator().manual_seed(len(ops))
    bases = [torch.randint(0, 64, (14,), generator=g).tolist() for _ in range(2)]
    for op, a, b, c in ops:
        if op == "add":  # a shared prefix of random length from one of two bases, then its own tokens
            prompt = bases[a % 2][:b] + torch.randint(0, 64, (a + 1,), generator=g).tolist()
            engine.add_request(prompt, SamplingParams(max_new_tokens=c))
        elif op == "step":
            for _ in range(a):
                before = tree_blocks(engine)
                engine.step()
                check_invariants(engine, before)
        elif op == "abort" and engine.requests:
            engine.abort(sorted(engine.requests)[a % len(engine.requests)])
        elif op == "preempt" and engine.running:
            engine.scheduler.preempt(engine.running[-1])
        check_invariants(engine)
    while engine.has_unfinished():
        before = tree_blocks(engine)
        engine.step()
        check_invariants(engine, before)
    tree = engine.cache_manager.prefix
    assert engine.cache_manager.num_free_slots == MAX_SEQS
    assert engine.cache_manager.num_free_blocks + len(tree.blocks_held()) == NUM_BLOCKS
    tree.clear()  # everything the tree held comes back
    assert engine.cache_manager.num_free_blocks == NUM_BLOCKS and not tree.checkpoints.saved
    cold = Engine(model, num_blocks=64, block_size=BLOCK_SIZE, max_seqs=1)
    for r in engine.requests.values():
        if r.finish_reason == "length":
            rid = cold.add_request(r.prompt, r.params)
            cold.run()
            assert cold.requests[rid].output == r.output
