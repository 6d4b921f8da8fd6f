"""Property tests: random add / step / abort / preempt sequences never leak or double-book
a KV block or a state slot, free everything at the end, and give every request that was not
aborted the output it gets alone in a roomy cache."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid import AttentionConfig, Engine, HybridConfig, HybridLM, Mamba1Config, Mamba2Config, SamplingParams
from hybrid.cache import NULL_BLOCK

CFG = HybridConfig(vocab_size=64, d_model=32, pattern="M*-m",
                   attention=AttentionConfig(n_heads=2, n_kv_heads=1),
                   mamba2=Mamba2Config(head_dim=16, d_state=8, chunk_size=8), mamba1=Mamba1Config(d_state=4))
NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS = 6, 4, 3


@pytest.fixture(scope="module", params=[None, 5], ids=["full", "window5"])
def model(request):
    torch.manual_seed(0)
    cfg = dataclasses.replace(CFG, attention=dataclasses.replace(CFG.attention, sliding_window=request.param))
    m = HybridLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the 0.02 init: greedy picks are far from ties
        m.lm_head.weight.mul_(30)
    return m


def check_invariants(engine: Engine) -> None:
    m = engine.cache_manager
    alloc = m.kv.allocator
    live = {r.request_id for r in engine.running}
    assert set(m.seqs) == live
    blocks = m.blocks_in_use()  # the null block (left the window) is nobody's
    assert NULL_BLOCK not in blocks and len(blocks) == len(set(blocks)), "a block belongs to two live sequences"
    assert all(alloc.ref_counts[b] == 1 for b in blocks)
    assert sorted(alloc.free_ids()) == sorted(set(range(1, NUM_BLOCKS + 1)) - set(blocks)), "a block leaked"
    slots = [m.state_slot(r) for r in live]
    assert len(slots) == len(set(slots)) and m.num_free_slots + len(slots) == MAX_SEQS
    for r in engine.running:
        table = m.block_table(r.request_id)
        assert len(table) * BLOCK_SIZE >= r.num_computed
        held = len([b for b in table if b != NULL_BLOCK])
        assert held <= m.kv.blocks_held_at_most(len(r.tokens), engine.max_batch_tokens)
        assert not r.finished
    for r in engine.waiting:
        assert r.num_computed == 0 and r.request_id not in live
    for r in engine.requests.values():
        assert len(r.output) <= r.params.max_new_tokens


def workload_ops(max_prompt: int, max_new: int, max_size: int):
    """Random engine workloads: ("add", prompt length, new tokens), ("step", how many, 0), ("abort", which
    request, 0), ("preempt", 0, 0)."""
    return st.lists(st.one_of(
        st.tuples(st.just("add"), st.integers(1, max_prompt), st.integers(1, max_new)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 99), st.just(0)),
        st.tuples(st.just("preempt"), st.just(0), st.just(0)),
    ), max_size=max_size)


def run_workload(engine: Engine, ops, *, vocab: int, temperature: float, check) -> None:
    """Apply ``workload_ops`` to ``engine`` (prompts of ids below ``vocab``, seeded by the ops), calling
    ``check(engine)`` after every op and after the engine has run to the end."""
    g = torch.Generator().manual_seed(len(ops))
    for op, a, b in ops:
        if op == "add":
            prompt = torch.randint(0, vocab, (a,), generator=g).tolist()
            engine.add_request(prompt, SamplingParams(max_new_tokens=b, temperature=temperature, seed=a))
        elif op == "step":
            for _ in range(a):
                engine.step()
        elif op == "abort" and engine.requests:
            engine.abort(sorted(engine.requests)[a % len(engine.requests)])
        elif op == "preempt" and engine.running:
            engine.scheduler.preempt(engine.running[-1])
        check(engine)
    engine.run()
    check(engine)


OPS = workload_ops(12, 8, 25)


@settings(max_examples=25, deadline=None)
@given(ops=OPS, budget=st.integers(1, 16), temperature=st.sampled_from([0.0, 1.0]))
def test_random_workloads_keep_the_cache_consistent(model, ops, budget, temperature):
    engine = Engine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_seqs=MAX_SEQS, max_batch_tokens=budget)
    run_workload(engine, ops, vocab=64, temperature=temperature, check=check_invariants)
    assert engine.cache_manager.num_free_blocks == NUM_BLOCKS and engine.cache_manager.num_free_slots == MAX_SEQS
    alone = Engine(model, num_blocks=64, block_size=BLOCK_SIZE, max_seqs=1)
    for r in engine.requests.values():
        assert r.finish_reason in ("length", "abort")
        if r.finish_reason == "length":
            assert len(r.output) == r.params.max_new_tokens
            rid = alone.add_request(r.prompt, r.params)
            alone.run()
            assert alone.requests[rid].output == r.output
