"""The engine and packed inference forward against the plain full forward, for every tiny recipe."""

import random

import pytest
import torch
from conftest import rel_err

import hybrid
from hybrid import Engine, HybridCache, HybridLM, SamplingParams, recipes
from hybrid.cache.manager import CacheManager
from hybrid.engine.packed_batch import SeqChunk, build_batch

TINY = [n for n in recipes.names() if n.endswith("-tiny")]


def tiny_model(name: str) -> HybridLM:
    return HybridLM(recipes.get(name)).eval()


@torch.no_grad()
def greedy_reference(model: HybridLM, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """The naive loop: rerun the full forward on the whole sequence for every new token."""
    seq, logits = list(prompt), []
    for _ in range(n):
        last = model(torch.tensor([seq]))[0, -1]
        logits.append(last)
        seq.append(int(last.argmax()))
    return seq[len(prompt):], logits


def prompts_of(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", TINY)
def test_engine_greedy_equals_naive_loop(name):
    """Three prompts batched together (one chunked across steps) give the naive loop's tokens."""
    model = tiny_model(name)
    prompts = prompts_of([7, 1, 19])
    engine = Engine(model, num_blocks=32, block_size=4, max_batch_tokens=8)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=8)) for p in prompts]
    engine.run()
    for rid, p in zip(ids, prompts, strict=True):
        assert engine.requests[rid].output == greedy_reference(model, p, 8)[0]


@pytest.mark.parametrize("name", TINY)
def test_cached_decode_logits_equal_full_forward(name):
    """Prefill through the caches, then one-token decodes: every step's logits match the full forward."""
    model = tiny_model(name)
    prompt = prompts_of([21])[0]
    tokens, ref_logits = greedy_reference(model, prompt, 6)
    cache = HybridCache.for_model(model, num_blocks=16, block_size=4, max_seqs=2)
    manager = CacheManager(cache)
    manager.admit(0, len(prompt))
    seq = list(prompt)
    with torch.no_grad():
        for step in range(6):
            start = 0 if step == 0 else len(seq) - 1
            manager.grow(0, len(seq))
            out = model.forward_packed(build_batch(manager, [SeqChunk(0, seq[start:], start)]), cache)
            assert rel_err(out[0], ref_logits[step]) < 1e-4
            seq.append(tokens[step])


def managed(model, **kw) -> CacheManager:
    return CacheManager(HybridCache.for_model(model, **kw))


def _run_packed(model, manager, chunks):
    """Run ``chunks`` through the packed forward, giving each sequence the cache it needs first."""
    for c in chunks:
        if not manager.holds(c.seq_id):
            manager.admit(c.seq_id, 0)
        manager.grow(c.seq_id, c.start + len(c.tokens))
    with torch.no_grad():
        return model.forward_packed(build_batch(manager, chunks), manager.cache, all_logits=True)


@pytest.mark.parametrize("name", TINY)
def test_packed_batch_equals_each_sequence_alone(name):
    """Prefills of different lengths packed together, then a step mixing decodes with a prefill
    chunk: every token's logits equal those of its sequence run alone through the full forward."""
    model = tiny_model(name)
    a, b, c, d = prompts_of([13, 30, 2, 9], seed=1)
    manager = managed(model, num_blocks=40, block_size=4, max_seqs=4)
    first = _run_packed(model, manager, [SeqChunk(0, a, 0), SeqChunk(1, b[:20], 0), SeqChunk(2, c, 0)])
    with torch.no_grad():
        full = {i: model(torch.tensor([s]))[0] for i, s in enumerate([a + [5], b, c + [7], d])}
    cu = [0, 13, 33, 35]
    for i, ref in ((0, full[0][:13]), (1, full[1][:20]), (2, full[2][:2])):
        assert rel_err(first[cu[i]:cu[i + 1]], ref) < 1e-4
    # decodes (0 and 2) first, then the rest of b's prompt and a fresh prompt d
    second = _run_packed(model, manager, [SeqChunk(0, [5], 13), SeqChunk(2, [7], 2), SeqChunk(1, b[20:], 20),
                                        SeqChunk(3, d, 0)])
    assert rel_err(second[0], full[0][13]) < 1e-4
    assert rel_err(second[1], full[2][2]) < 1e-4
    assert rel_err(second[2:12], full[1][20:]) < 1e-4
    assert rel_err(second[12:], full[3]) < 1e-4


@pytest.mark.parametrize("name", TINY)
def test_chunked_prefill_equals_one_prefill(name):
    """A 37-token prompt in chunks of 5, 16, 1 and 15 leaves the same states and K/V as one
    prefill, and the next decode gives the same logits."""
    model = tiny_model(name)
    prompt = prompts_of([37], seed=2)[0]
    managers = [managed(model, num_blocks=12, block_size=4, max_seqs=1) for _ in range(2)]
    _run_packed(model, managers[0], [SeqChunk(0, prompt, 0)])
    start = 0
    for n in (5, 16, 1, 15):
        _run_packed(model, managers[1], [SeqChunk(0, prompt[start:start + n], start)])
        start += n
    caches = [m.cache for m in managers]
    for i, states in caches[0].ssm.pools.items():  # each constant-state layer's tensors, as its spec names them
        for name, a, b in zip(caches[0].ssm.views[i].names, states, caches[1].ssm.pools[i], strict=True):
            assert rel_err(b, a) < (1e-5 if name == "conv" else 1e-4), name
    for i, (k, v) in caches[0].kv.pools.items():
        k2, v2 = caches[1].kv.pools[i]
        assert rel_err(k2, k) < 1e-5 and rel_err(v2, v) < 1e-5
    one, chunked = (_run_packed(model, m, [SeqChunk(0, [3], 37)]) for m in managers)
    assert rel_err(chunked, one) < 1e-5


@pytest.mark.parametrize("name", ["llama-tiny", "samba-tiny", "jamba-tiny"])
def test_paged_equals_contiguous(name):
    """Small blocks handed out in a scrambled order give the logits of one contiguous block per sequence."""
    model = tiny_model(name)
    prompts = prompts_of([23, 11], seed=3)
    contiguous = managed(model, num_blocks=2, block_size=64, max_seqs=2)
    paged = managed(model, num_blocks=20, block_size=2, max_seqs=2)
    allocator = paged.kv.allocator
    free = allocator.free_ids()
    random.Random(0).shuffle(free)
    allocator._free.clear()
    allocator._free.extend(free)
    outs = []
    for manager in (contiguous, paged):
        first = _run_packed(model, manager, [SeqChunk(0, prompts[0], 0), SeqChunk(1, prompts[1], 0)])
        second = _run_packed(model, manager, [SeqChunk(0, [1], 23), SeqChunk(1, [2], 11)])
        outs.append(torch.cat([first, second]))
    table = paged.block_table(0)
    assert table != sorted(table)  # the blocks really are out of order
    assert rel_err(outs[1], outs[0]) < 1e-5


@pytest.mark.parametrize("name", ["llama-tiny", "hybrid-1to7-tiny", "samba-tiny"])
def test_preemption_gives_the_unconstrained_outputs(name):
    """A cache too small for all sequences at once forces preemption and recompute; greedy and
    seeded sampling outputs still equal those of a run with room to spare."""
    model = tiny_model(name)
    prompts = prompts_of([9, 14, 5, 11], seed=4)
    params = [SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)]
    results = []
    for num_blocks in (64, 9):
        engine = Engine(model, num_blocks=num_blocks, block_size=4, max_seqs=4, max_batch_tokens=32)
        ids = [engine.add_request(p, params[i % 2]) for i, p in enumerate(prompts)]
        engine.run()
        results.append(([engine.requests[i].output for i in ids], engine.stats.preemptions))
        assert engine.cache.kv.allocator.num_free == num_blocks and engine.cache.ssm.num_free == 4
    (free_out, free_preempt), (tight_out, tight_preempt) = results
    assert free_preempt == 0 and tight_preempt > 0
    assert tight_out == free_out


def test_sliding_window_sequences_outgrow_the_cache():
    """samba-tiny attends to the last 16 tokens: blocks behind the window go back to the pool, so
    sequences far longer than the cache decode, with the naive loop's tokens."""
    model = tiny_model("samba-tiny")
    prompts = prompts_of([30, 9], seed=9)
    engine = Engine(model, num_blocks=12, block_size=4, max_batch_tokens=8)  # 48 tokens in all
    held = []
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=40)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
        held.append(engine.cache.kv.allocator.num_blocks - engine.cache.kv.allocator.num_free)
    assert engine.stats.preemptions == 0 and max(held) <= 12
    for rid, p in zip(ids, prompts, strict=True):
        assert engine.requests[rid].output == greedy_reference(model, p, 40)[0]
    llama = Engine(tiny_model("llama-tiny"), num_blocks=12, block_size=4, max_batch_tokens=8)
    with pytest.raises(ValueError, match="needs 69 cached tokens"):
        llama.add_request(prompts[0], SamplingParams(max_new_tokens=40))


def test_continuous_batching_mixes_prefill_and_decode_and_frees_at_once():
    model = tiny_model("hybrid-1to7-tiny")
    engine = Engine(model, num_blocks=32, block_size=4, max_seqs=4, max_batch_tokens=12)
    seen = []
    real = model.forward_packed

    def spy(batch, cache, **kw):
        seen.append((batch.num_tokens, batch.num_decodes, batch.num_seqs))
        return real(batch, cache, **kw)

    model.forward_packed = spy
    a = engine.add_request(prompts_of([6])[0], SamplingParams(max_new_tokens=4))
    engine.step()
    engine.step()  # a is decoding now
    b = engine.add_request(prompts_of([20], seed=5)[0], SamplingParams(max_new_tokens=4))
    engine.step()
    assert seen[-1] == (12, 1, 2)  # a's decode + the first 11 tokens of b's prompt, within the budget
    outs = engine.step()  # a's last token: it finishes and frees its blocks and slot in this step
    assert [o.finished for o in outs if o.request_id == a] == [True]
    assert not engine.cache_manager.holds(a) and engine.cache_manager.holds(b)
    with pytest.raises(ValueError, match="has not finished"):
        engine.forget(b)
    assert len(engine.forget(a).output) == 4 and a not in engine.requests
    engine.run()
    assert max(n for n, _, _ in seen) <= 12
    assert engine.cache.kv.allocator.num_free == 32 and engine.cache.ssm.num_free == 4


def test_streamed_tokens_add_up_to_the_outputs():
    engine = Engine(tiny_model("nemotronh-tiny"), num_blocks=32, block_size=4, max_batch_tokens=12)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=5)) for p in prompts_of([6, 20])]
    streamed = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            streamed[o.request_id].extend(o.new_token_ids)
    assert all(streamed[i] == engine.requests[i].output and len(streamed[i]) == 5 for i in ids)


def test_mamba_only_model_needs_no_kv_blocks():
    model = tiny_model("mamba2-tiny")
    cache = HybridCache.for_model(model, cache_bytes=2**20, max_seqs=2)
    assert cache.kv.num_blocks == 0 and cache.kv.capacity_tokens == float("inf")
    engine = Engine(model, cache=cache)
    rid = engine.add_request(prompts_of([300])[0], SamplingParams(max_new_tokens=3))
    engine.run()
    assert len(engine.requests[rid].output) == 3


def test_request_errors():
    model = tiny_model("llama-tiny")
    engine = Engine(model, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request([])
    with pytest.raises(ValueError, match="token id 256 is out of range for vocab_size 256"):
        engine.add_request([1, 256])
    with pytest.raises(ValueError, match="token id -1"):
        engine.add_request([-1])
    with pytest.raises(ValueError, match=r"needs 20 cached tokens .* 5 KV blocks at once, .* \(4 blocks of 4\)"):
        engine.add_request(list(range(20)), SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match=r"needs 17 cached tokens \(10 prompt \+ 8 new - 1\)"):
        engine.add_request(list(range(10)), SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="need a tokenizer"):
        engine.add_request([1], SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match="exactly one of num_blocks= or cache_bytes="):
        HybridCache(model.config)
    assert not engine.has_unfinished()


def test_engine_greedy_equals_transformers_generate():
    """16 greedy tokens through the engine equal transformers' generate on the same Llama weights."""
    pytest.importorskip("transformers")
    from benchmarks.decode import hf_pair

    hf, ours = hf_pair(recipes.get("llama-tiny"), torch.float32)  # logits sharpened: argmax far from ties
    prompts = prompts_of([12, 5], seed=8)
    ours_out = hybrid.generate(ours, prompts, max_new_tokens=16)
    for p, out in zip(prompts, ours_out, strict=True):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)
        assert out == ref[0, len(p):].tolist()


def test_generate_api_ids_and_strings():
    model = tiny_model("jamba-tiny")
    prompts = prompts_of([4, 9], seed=6)
    out = hybrid.generate(model, prompts, max_new_tokens=6)
    assert out == [greedy_reference(model, p, 6)[0] for p in prompts]
    tok = hybrid.load_tokenizer(None)
    texts = hybrid.generate(model, ["héllo", "a"], max_new_tokens=6, tokenizer=tok, temperature=0.9, seed=3)
    again = hybrid.generate(model, ["a"], max_new_tokens=6, tokenizer=tok, temperature=0.9, seed=3)
    assert all(isinstance(t, str) for t in texts) and texts[1] == again[0]
    with pytest.raises(ValueError, match="need a tokenizer"):
        hybrid.generate(model, ["hi"], max_new_tokens=2)
    with pytest.raises(ValueError, match="out of range"):
        hybrid.generate(model, [[300]], max_new_tokens=2)
