"""Prefix caching: with the cache on every output equals the cache-off run (every tiny recipe, chunked
prefill, preemption, aborts), hits land where each layer kind allows, partial blocks are copied on write,
and eviction follows its policy under each budget."""

import pytest
import torch

from hybrid import Engine, HybridLM, SamplingParams, recipes

TINY = [n for n in recipes.names() if n.endswith("-tiny")]


def sharp(model: HybridLM) -> HybridLM:
    """Sharper logits than the 0.02 init, so greedy picks are far from ties (as the engine tests do)."""
    with torch.no_grad():
        head = model.lm_head.weight if model.lm_head is not None else model.embed.weight
        head.mul_(30)
    return model.eval()


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    torch.manual_seed(0)
    return request.param, sharp(HybridLM(recipes.get(request.param)))


def rand(n, g):
    return torch.randint(0, 256, (n,), generator=g).tolist()


def workload(g):
    system = rand(37, g)
    prompts = [system + rand(5 + 3 * i, g) for i in range(4)]
    prompts += [prompts[1][:41] + rand(6, g), system[:20], prompts[0]]  # a branch inside a block, a short one, a repeat
    return prompts


def run(model, prompts, *, prefix, abort_at=None, **kw):
    e = Engine(model, block_size=8, prefix_caching=prefix, **kw)
    ids = [e.add_request(p, SamplingParams(max_new_tokens=4)) for p in prompts]
    steps = 0
    while e.has_unfinished():
        e.step()
        steps += 1
        if steps == abort_at:
            e.abort(ids[2])
        if steps in (3, 9) and e.running:  # a preemption in the mix whatever the cache size
            e.scheduler.preempt(e.running[-1])
    return e, [e.requests[i].output for i in ids]


@pytest.mark.parametrize("budget,blocks", [(16, 64), (7, 10)], ids=["chunked", "small-cache"])
def test_outputs_equal_the_cache_off_run_for_every_tiny_recipe(tiny, budget, blocks):
    name, model = tiny
    prompts = workload(torch.Generator().manual_seed(1))
    kw = dict(num_blocks=blocks, max_seqs=2, max_batch_tokens=budget)
    off, out_off = run(model, prompts, prefix=False, abort_at=6, **kw)
    on, out_on = run(model, prompts, prefix=True, abort_at=6, **kw)
    assert out_on == out_off
    assert on.stats.prefix_hit_tokens > 0, f"{name}: nothing was served from the prefix cache"
    assert on.stats.prompt_tokens_computed < off.stats.prompt_tokens_computed
    assert on.stats.prompt_tokens == off.stats.prompt_tokens == sum(map(len, prompts))
    assert on.stats.preemptions >= 2 and off.stats.preemptions >= 2


def test_scores_equal_the_cache_off_scores_for_every_tiny_recipe(tiny):
    """Logits through the cache are the cold logits to fp32 noise: the prompt log-probabilities agree."""
    _, model = tiny
    g = torch.Generator().manual_seed(2)
    ctx = rand(45, g)
    jobs = [(ctx + rand(3 + i, g), 45) for i in range(4)] + [(ctx[:30] + rand(4, g), 30)]
    cold = Engine(model, num_blocks=64, block_size=8, max_batch_tokens=16).score(jobs)
    hot_engine = Engine(model, num_blocks=64, block_size=8, max_batch_tokens=16, prefix_caching=True)
    hot = hot_engine.score(jobs[:2]) + hot_engine.score(jobs[2:])  # a burst admitted together is cold
    assert hot_engine.stats.prefix_hit_tokens > 0
    with torch.no_grad():  # and both equal the plain full forward
        full = [torch.log_softmax(model(torch.tensor([t]))[0].float(), -1) for t, _ in jobs]
    for (tokens, start), a, b, f in zip(jobs, cold, hot, full, strict=True):
        ref = f[start - 1:-1].gather(1, torch.tensor(tokens[start:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=2e-5)
        torch.testing.assert_close(torch.tensor(b.logprobs), ref, rtol=0, atol=2e-5)
        torch.testing.assert_close(b.next_logprobs, f[-1], rtol=0, atol=2e-5)
        assert a.greedy == b.greedy == (f[start - 1:-1].argmax(-1) == torch.tensor(tokens[start:])).tolist()


def hit_of(engine, prompt):
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=2))
    engine.run()
    return engine.requests[rid].prefix_hit


@pytest.mark.parametrize("name,first,second,third", [
    ("llama-tiny", 32, 37, 37),      # attention: any block boundary at once; the branch block saved
    ("mamba2-tiny", 0, 37, 37),      # Mamba: only a checkpoint; the branch point is saved by the second prompt
    ("hybrid-1to7-tiny", 0, 37, 37),  # both: a checkpoint and the KV up to it (a copied partial block)
])
def test_hit_positions_by_layer_kind(name, first, second, third):
    torch.manual_seed(0)
    model = HybridLM(recipes.get(name)).eval()
    g = torch.Generator().manual_seed(3)
    base = rand(40, g)
    e = Engine(model, num_blocks=64, block_size=8, prefix_caching=True)
    assert hit_of(e, base) == 0
    # shares 37 tokens with the first: a branch inside the fifth block
    assert hit_of(e, base[:37] + rand(9, g)) == first
    assert hit_of(e, base[:37] + rand(9, g)) == second
    assert hit_of(e, base[:37] + rand(9, g)) == third
    assert hit_of(e, base) == 39  # the same prompt again: all but its last token (the prompt-end checkpoint)
    report = e.cache.report()
    assert report.prefix_nodes > 0
    assert (report.prefix_checkpoints > 0) == (name != "llama-tiny")
    assert (report.prefix_blocks > 0) == (name != "mamba2-tiny")


def test_a_chat_resumes_after_each_turn():
    """Each turn resends the history; the state where the previous turn stopped serves it."""
    torch.manual_seed(0)
    model = sharp(HybridLM(recipes.get("hybrid-1to7-tiny")))
    g = torch.Generator().manual_seed(4)
    e = Engine(model, num_blocks=128, block_size=8, prefix_caching=True)
    history = rand(20, g)
    for turn in range(3):
        rid = e.add_request(history, SamplingParams(max_new_tokens=5))
        e.run()
        req = e.requests[rid]
        if turn:
            assert req.prefix_hit == len(history) - 1 - 9  # all but the previous reply's last token + the user turn
        history = history + req.output + rand(9, g)


def test_partial_blocks_are_copied_on_write():
    torch.manual_seed(0)
    model = HybridLM(recipes.get("hybrid-1to7-tiny")).eval()
    g = torch.Generator().manual_seed(5)
    e = Engine(model, num_blocks=64, block_size=8, prefix_caching=True)
    base = rand(29, g)
    hit_of(e, base)
    tree = e.cache_manager.prefix
    partial = [n for n in tree.checkpoint_nodes() if n.end == 28][0]  # prompt end: a partial block of 4 tokens
    assert len(partial.tokens) == 4
    layer = e.cache.kv.layer_indices[0]
    k_pool = e.cache.kv.pools[layer][0]
    before = k_pool[partial.block].clone()
    rid = e.add_request(base[:28] + rand(12, g), SamplingParams(max_new_tokens=3))
    e.step()
    table = e.cache_manager.block_table(rid)
    assert e.requests[rid].prefix_hit == 28
    assert table[3] != partial.block  # its own copy of the partial block ...
    assert table[:3] == [n.block for n in partial.path()[:3]]  # ... and the full blocks shared
    assert all(e.cache.kv.allocator.ref_counts[b] == 2 for b in table[:3])
    e.run()
    torch.testing.assert_close(k_pool[partial.block], before, rtol=0, atol=0)  # the tree's copy never changed


def test_checkpoint_eviction_is_lru_or_flops_per_byte():
    """Pool of two checkpoints. flop_weight=0: the least recently used goes. With FLOPs per byte, a long
    prefix outlives the shorter, more recent ones."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get("mamba2-tiny")).eval()
    one = model.state_bytes_per_sequence()
    g = torch.Generator().manual_seed(6)
    long, short1, short2 = rand(60, g), rand(6, g), rand(6, g)
    kept = {}
    for weight in (0.0, 10.0):
        e = Engine(model, num_blocks=1, block_size=8, prefix_caching=True, prefix_state_bytes=2 * one,
                   prefix_flop_weight=weight)
        for p in (long, short1, short2):
            e.add_request(p, SamplingParams(max_new_tokens=1))  # one token: only the prompt-end checkpoint
            e.run()
        tree = e.cache_manager.prefix
        assert len(tree.checkpoints.saved) == 2 and tree.evicted_checkpoints >= 1
        kept[weight] = sorted(n.end for n in tree.checkpoint_nodes())
    # the three prompts saved 59, 5 and 5 (their ends); where they stop (60, 6, 6) too, then evicted
    assert kept[0.0] == [5, 6]  # LRU: the two most recent
    assert 59 in kept[10.0] or 60 in kept[10.0]  # the long prefix survives two short newer ones


def test_kv_blocks_go_to_live_sequences_lowest_utility_first():
    """The tree's blocks give way to a live sequence, least recently used leaf first (flop_weight=0)."""
    torch.manual_seed(0)
    model = HybridLM(recipes.get("llama-tiny")).eval()
    g = torch.Generator().manual_seed(7)
    e = Engine(model, num_blocks=12, block_size=8, prefix_caching=True, prefix_flop_weight=0.0)
    old, new = rand(16, g), rand(16, g)
    for p in (old, new):  # each leaves 2 full blocks and its prompt-end partial block (15 tokens) in the tree
        e.add_request(p, SamplingParams(max_new_tokens=1))
        e.run()
    tree = e.cache_manager.prefix
    assert len(tree.blocks_held()) == 6 and e.cache_manager.num_free_blocks == 6
    assert tree.match(old, 15).position == tree.match(new, 15).position == 15
    # 7 blocks at admission (1 from the tree), then 1 for its own prompt-end copy: old's two leaves go
    e.add_request(rand(56, g), SamplingParams(max_new_tokens=1))
    e.run()
    assert tree.evicted_blocks == 2
    assert tree.match(new, 15).position == 15  # new survived whole ...
    assert tree.match(old, 15).position == 8  # ... old lost its partial block, then its second block
    report = e.cache.report()
    assert report.prefix_blocks == len(tree.blocks_held()) == report.prefix_blocks_evictable


def test_bad_prefix_settings_are_clear_errors():
    model = HybridLM(recipes.get("mamba2-tiny")).eval()
    with pytest.raises(ValueError, match="holds no Mamba state checkpoint"):
        Engine(model, num_blocks=4, prefix_caching=True, prefix_state_bytes=10)
    with pytest.raises(ValueError, match="need prefix_caching=True"):
        Engine(model, num_blocks=4, prefix_state_bytes=10)
    with pytest.raises(ValueError, match="prefix_checkpoint_interval"):
        Engine(model, num_blocks=4, prefix_caching=True, prefix_checkpoint_interval=0)
    with pytest.raises(ValueError, match="start"):
        Engine(model, num_blocks=4).score([([1, 2, 3], 0)])
    with pytest.raises(ValueError, match="start"):
        Engine(model, num_blocks=4).score([([1, 2, 3], 4)])
