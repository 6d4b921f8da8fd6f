"""The scheduler under a long prompt (issue 44): every step stays within the token budget, decodes go first,
a request that arrives while a long prompt is waiting or being prefilled is scheduled in the very next step,
``priority`` orders the queue (lower first, ties FCFS) and picks the preemption victim, and the length limits
refuse what they should with a message naming them. Outputs stay those of each request run alone."""

import pytest
import torch

from hybrid import Engine, HybridLM, SamplingParams, recipes


def tiny_engine(num_blocks=2048, max_batch_tokens=64, **kw) -> Engine:
    torch.manual_seed(0)
    model = HybridLM(recipes.get("hybrid-1to7-tiny")).eval()
    return Engine(model, num_blocks=num_blocks, block_size=16, max_seqs=8, max_batch_tokens=max_batch_tokens, **kw)


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def planned(engine) -> dict[int, int]:
    """The next step's plan as {request id: tokens}, running that step."""
    seen = {}
    real = engine.scheduler.schedule

    def spy():
        plan = real()
        seen.update({r.request_id: n for r, n in plan})
        return plan
    engine.scheduler.schedule = spy
    try:
        engine.step()
    finally:
        del engine.scheduler.schedule
    return seen


def test_a_request_arriving_during_a_long_prefill_runs_in_the_next_step_and_the_budget_holds():
    engine = tiny_engine(max_batch_tokens=64)
    long_id = engine.add_request(prompt(3000), GREEDY)
    first = planned(engine)
    assert first == {long_id: 64}  # a chunk, not the prompt
    short_ids = []
    steps = 0
    while not engine.requests[long_id].finished:
        if steps % 5 == 0 and len(short_ids) < 8:  # short requests keep arriving while the prompt is prefilled
            short_ids.append(engine.add_request(prompt(20, seed=len(short_ids) + 1), GREEDY))
            arrived = short_ids[-1]
        else:
            arrived = None
        decoding = [r.request_id for r in engine.running if r.num_pending == 1]
        plan = planned(engine)
        steps += 1
        assert sum(plan.values()) <= 64, plan
        if arrived is not None:  # admitted with its whole prompt in the step right after its arrival
            assert plan.get(arrived) == 20, (steps, plan)
        assert all(plan.get(i) == 1 for i in decoding), (decoding, plan)  # every decode, every step
    assert len(short_ids) == 8
    # the shorts did not wait for the long prompt: every one finished before it
    long_done = engine.requests[long_id]
    assert all(engine.requests[i].finished for i in short_ids)
    assert long_done.finish_reason == "length"
    engine.run()
    # interleaving changed no output: each equals the same request run alone on a fresh engine
    for rid, p in [(long_id, prompt(3000))] + [(i, prompt(20, seed=k + 1)) for k, i in enumerate(short_ids)]:
        alone = tiny_engine(max_batch_tokens=64)
        aid = alone.add_request(p, GREEDY)
        assert alone.run()[aid].output == engine.requests[rid].output


def test_old_fcfs_would_starve_the_short_request_but_the_long_prefill_yields():
    """The long prompt in progress (more than long_prefill_tokens left) takes only what the short leaves."""
    engine = tiny_engine(max_batch_tokens=64)
    long_id = engine.add_request(prompt(2000), GREEDY)
    planned(engine)
    short = engine.add_request(prompt(40, seed=3), GREEDY)
    plan = planned(engine)
    assert plan == {short: 40, long_id: 24}
    plan = planned(engine)  # the short one decodes, the long one gets the rest
    assert plan == {short: 1, long_id: 63}


def test_the_last_chunk_of_a_long_prompt_is_a_short_prefill():
    engine = tiny_engine(max_batch_tokens=64, long_prefill_tokens=16)
    a = engine.add_request(prompt(100), GREEDY)
    assert planned(engine) == {a: 64}
    assert planned(engine) == {a: 36}
    b = engine.add_request(prompt(30, seed=1), GREEDY)
    c = engine.add_request(prompt(10, seed=2), GREEDY)
    plan = planned(engine)
    assert plan == {a: 1, b: 30, c: 10}


def test_priority_orders_admission_lower_first_ties_fcfs():
    engine = tiny_engine(max_batch_tokens=32)
    ids = [engine.add_request(prompt(20, seed=k), GREEDY, priority=p) for k, p in enumerate([5, 0, 5, -1, 0])]
    assert [r.request_id for r in engine.waiting] == [ids[3], ids[1], ids[4], ids[0], ids[2]]
    plan = planned(engine)
    assert plan == {ids[3]: 20, ids[1]: 12}


def test_priority_picks_the_preemption_victim():
    # 6 blocks of 16 tokens: three 30-token prompts hold 2 blocks each; growing one needs a victim
    engine = tiny_engine(num_blocks=6, max_batch_tokens=256)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    urgent = engine.add_request(prompt(30, seed=1), params, priority=0)
    lazy = engine.add_request(prompt(30, seed=2), params, priority=9)
    newest = engine.add_request(prompt(30, seed=3), params, priority=0)
    planned(engine)
    while engine.scheduler.preemptions == 0:
        engine.step()
    assert engine.requests[lazy] in engine.waiting  # not the newest: the one with the largest priority value
    assert engine.requests[urgent] in engine.running and engine.requests[newest] in engine.running
    out = engine.run()
    alone = tiny_engine(num_blocks=64, max_batch_tokens=256)
    aid = alone.add_request(prompt(30, seed=2), params)
    assert out[lazy].output == alone.run()[aid].output


def test_length_limits_default_from_the_cache_and_refuse_with_their_names():
    engine = tiny_engine(num_blocks=64)
    assert engine.max_model_len == 64 * 16 + 1 and engine.max_prompt_tokens == 64 * 16
    limited = tiny_engine(max_model_len=300, max_prompt_tokens=200)
    with pytest.raises(ValueError, match="max_prompt_tokens=200"):
        limited.add_request(prompt(201), GREEDY)
    with pytest.raises(ValueError, match="max_model_len=300"):
        limited.add_request(prompt(200), SamplingParams(max_new_tokens=101))
    limited.add_request(prompt(200), SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        tiny_engine(num_blocks=64, max_model_len=5000)
    with pytest.raises(ValueError, match="leaves no room to generate"):
        tiny_engine(max_model_len=300, max_prompt_tokens=300)


def test_a_long_prefill_short_of_blocks_shrinks_its_chunk_instead_of_preempting_a_new_arrival():
    # 37 blocks of 16 tokens: the long prompt (570 tokens, 36 blocks in the end) holds 32 after 512 computed, the
    # short one takes 2, which leaves room for 48 more of the long prompt's 58
    engine = tiny_engine(num_blocks=37, max_batch_tokens=128, long_prefill_tokens=32)
    long_id = engine.add_request(prompt(570), SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True))
    for _ in range(4):
        planned(engine)
    assert engine.requests[long_id].num_computed == 512
    short = engine.add_request(prompt(20, seed=5), GREEDY)
    plan = planned(engine)
    assert plan[short] == 20 and engine.scheduler.preemptions == 0
    assert 0 < plan[long_id] <= 48  # what the free blocks hold, not the 58 tokens it has left
    while engine.requests[long_id].num_pending > 32:  # still long: it waits for room, never preempts
        planned(engine)
        assert engine.scheduler.preemptions == 0
    engine.run()  # (its last chunk is a short prefill, which may preempt the newest: the short one, to recompute)
    for rid, p, params in [(long_id, prompt(570), SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)),
                           (short, prompt(20, seed=5), GREEDY)]:
        alone = tiny_engine(num_blocks=64, max_batch_tokens=128)
        aid = alone.add_request(p, params)
        assert alone.run()[aid].output == engine.requests[rid].output
