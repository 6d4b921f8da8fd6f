"""SnapKV prompt compression in the paged cache (issue 15 item 3b): the selection against a plain reference
written from the paper's definition, decode against an explicitly masked full forward, and the engine
invariants (budget >= prompt, packed = alone, chunked = whole, preemption, int8 pages, freed blocks)."""

import math

import pytest
import torch

from hybrid import Engine, HybridLM, SamplingParams, recipes
from hybrid.cache import NULL_BLOCK
from hybrid.cache.pruning import SnapKV, StreamingLLM, parse_policy
from hybrid.speculative.config import SpeculativeConfig

BS = 4


def _model(name: str) -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(recipes.get(name)).eval()


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in lengths]


def _engine(model, policy, **kw):
    kw.setdefault("num_blocks", 96)
    kw.setdefault("max_batch_tokens", 16)
    return Engine(model, block_size=BS, kv_pruning=policy, **kw)


def snapkv_reference(q: torch.Tensor, k: torch.Tensor, policy: SnapKV) -> list[list[int]]:
    """SnapKV from the paper's definition, one KV head, one window query, one position at a time: q [L, Hq, D]
    and k [L, Hkv, D] of the whole prompt -> per KV head the kept positions, ascending. A window query at
    position i attends (softmax) to keys 0..i; its weights on the positions before the window are summed over the
    window's queries and the group's query heads, pooled over ``kernel`` neighbours (max, or the mean of
    ``kernel`` values with zeros past the ends), and the best ``budget - window`` (earlier first on ties) join
    the window."""
    L, Hq, D = q.shape
    Hkv, W = k.shape[1], policy.window
    group = Hq // Hkv
    kept = []
    for h in range(Hkv):
        votes = [0.0] * (L - W)
        for hq in range(h * group, (h + 1) * group):
            for i in range(L - W, L):
                weights = torch.softmax(torch.stack([q[i, hq] @ k[j, h] for j in range(i + 1)]) / math.sqrt(D), 0)
                for j in range(L - W):
                    votes[j] += float(weights[j])
        half = policy.kernel // 2
        pooled = []
        for j in range(L - W):
            near = votes[max(0, j - half):j + half + 1]
            pooled.append(max(near) if policy.pooling == "max" else sum(near) / policy.kernel)
        best = sorted(range(L - W), key=lambda j: (-pooled[j], j))[:policy.budget - W]
        kept.append(sorted(best) + list(range(L - W, L)))
    return kept


def _capture_qk(model, tokens):
    """Post-RoPE q, k of every attention layer in a full forward over ``tokens``."""
    seen = {}
    for i, block in enumerate(model.layers):
        if block.kind != "attention":
            continue
        mixer = block.mixer

        def qkv(x, positions, rope=None, _orig=mixer.qkv, _i=i):
            out = _orig(x, positions, rope)
            seen[_i] = (out[0][0], out[1][0])
            return out
        mixer.qkv = qkv
    with torch.inference_mode():
        model(torch.tensor([tokens]))
    for block in model.layers:
        block.mixer.__dict__.pop("qkv", None)
    return seen


def _step_until_decoding(engine, rid):
    while not engine.requests[rid].output:
        engine.step()


@pytest.mark.parametrize("name,pooling,chunk", [("llama-tiny", "max", 16), ("jamba-tiny", "avg", 5)])
def test_selection_equals_the_reference(name, pooling, chunk):
    model = _model(name)
    policy = SnapKV(budget=14, window=6, kernel=3, pooling=pooling)
    (prompt,) = _prompts([37], seed=1)
    engine = _engine(model, policy, max_batch_tokens=chunk)  # chunk 5 < window: the window spans two chunks
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=4))
    _step_until_decoding(engine, rid)
    kept = engine.cache_manager.seqs[rid].kept
    qk = _capture_qk(model, prompt)
    assert sorted(kept) == sorted(qk)
    for i, (q, k) in qk.items():
        assert kept[i].tolist() == snapkv_reference(q, k, policy), f"layer {i}"


def _masked_reference_logits(model, tokens, prompt_len, kept):
    """Logits [len(tokens), V] of a full forward where, in every attention layer, a query at position p >= prompt_len
    sees per KV head only that head's kept prompt positions and positions prompt_len..p (prompt queries: causal)."""
    originals = {}
    for i, block in enumerate(model.layers):
        if block.kind != "attention":
            continue
        mixer = block.mixer

        def forward(x, _m=mixer, _kept=kept[i]):
            B, T, _ = x.shape
            q, k, v = _m.qkv(x, torch.arange(T))
            Hq, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
            allowed = torch.ones(Hkv, T, T, dtype=torch.bool).tril()
            for h in range(Hkv):
                seen = torch.zeros(T, dtype=torch.bool)
                seen[_kept[h]] = True
                seen[prompt_len:] = True
                allowed[h, prompt_len:] &= seen[None, :]
            mask = allowed.repeat_interleave(Hq // Hkv, 0)  # [Hq, T, T]
            kr, vr = k.repeat_interleave(Hq // Hkv, 2), v.repeat_interleave(Hq // Hkv, 2)
            s = torch.einsum("bqhd,bkhd->bhqk", q, kr) / math.sqrt(D)
            p = torch.softmax(s.masked_fill(~mask[None], float("-inf")), -1)
            out = torch.einsum("bhqk,bkhd->bqhd", p, vr)
            return _m.o_proj(out.reshape(B, T, -1))
        originals[i] = mixer
        mixer.forward = forward
    try:
        with torch.inference_mode():
            return model(torch.tensor([tokens]))[0]
    finally:
        for mixer in originals.values():
            del mixer.forward


def _record_logits(engine):
    rows = []
    execute = engine.runner.execute

    def wrapped(chunks, **kw):
        out, compiled = execute(chunks, **kw)
        rows.append(out.clone())
        return out, compiled
    engine.runner.execute = wrapped
    return rows


@pytest.mark.parametrize("name", ["llama-tiny", "jamba-tiny"])
def test_decode_logits_equal_a_masked_reference(name):
    model = _model(name)
    policy = SnapKV(budget=12, window=4, kernel=5)
    (prompt,) = _prompts([33], seed=2)
    engine = _engine(model, policy, max_batch_tokens=64)
    rows = _record_logits(engine)
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=9))
    _step_until_decoding(engine, rid)
    kept = {i: t.tolist() for i, t in engine.cache_manager.seqs[rid].kept.items()}
    engine.run()
    out = engine.requests[rid].output
    ref = _masked_reference_logits(model, prompt + out[:-1], len(prompt), kept)
    got = torch.cat(rows)  # one row per step: after the prompt, then after each decoded token
    assert got.shape[0] == len(out)
    torch.testing.assert_close(got, ref[len(prompt) - 1:], atol=1e-4, rtol=1e-4)
    # pruning really changed what decode sees: the unpruned forward's logits differ
    with torch.inference_mode():
        full = model(torch.tensor([prompt + out[:-1]]))[0]
    assert (full[len(prompt):] - ref[len(prompt):]).abs().max() > 1e-3


def _outputs(engine, prompts, max_new_tokens=8):
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=max_new_tokens)) for p in prompts]
    engine.run()
    return [engine.requests[i].output for i in ids]


def test_budget_at_least_the_prompt_changes_nothing():
    model = _model("jamba-tiny")
    prompts = _prompts([21, 9, 30])
    plain = _outputs(_engine(model, None), prompts)
    engine = _engine(model, SnapKV(budget=30, window=8))
    assert _outputs(engine, prompts) == plain
    r = engine.cache.report()
    assert r.kv_sequences_compressed == 0 and r.kv_blocks_pruned == 0
    mamba = _model("mamba2-tiny")  # no attention layer: nothing to compress
    assert _outputs(_engine(mamba, SnapKV(budget=8, window=4)), prompts) == _outputs(_engine(mamba, None), prompts)


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
def test_packed_equals_alone_and_chunked_equals_whole(kv_dtype):
    """Several sequences of different lengths (two above the budget, two below) in one engine give what each
    gives alone, in one prefill or in chunks shorter than the window; under int8 / fp8 pages too."""
    model = _model("jamba-tiny")
    policy = SnapKV(budget=13, window=5, kernel=3)
    prompts = _prompts([40, 7, 26, 12], seed=3)
    packed = _engine(model, policy, kv_dtype=kv_dtype, max_batch_tokens=24)
    together = _outputs(packed, prompts)
    assert packed.cache.report().kv_sequences_compressed == 2
    alone = [_outputs(_engine(model, policy, kv_dtype=kv_dtype, max_batch_tokens=64), [p])[0] for p in prompts]
    chunked = _outputs(_engine(model, policy, kv_dtype=kv_dtype, max_batch_tokens=3), prompts)
    assert together == alone == chunked


def test_preemption_recomputes_and_compresses_again():
    model = _model("hybrid-1to7-tiny")
    policy = SnapKV(budget=10, window=4, kernel=3)
    prompts = _prompts([30, 25, 33, 6], seed=5)
    roomy = _engine(model, policy, num_blocks=80, max_seqs=4)
    free_out = _outputs(roomy, prompts, max_new_tokens=24)
    tight = _engine(model, policy, num_blocks=16, max_seqs=4)
    tight_out = _outputs(tight, prompts, max_new_tokens=24)
    assert roomy.stats.preemptions == 0 and tight.stats.preemptions > 0
    # a compressed sequence was preempted while decoding: it recomputed its prompt, was compressed again and
    # ran its generated tokens as a prefill chunk over the compressed cache
    assert tight.cache.report().kv_sequences_compressed > roomy.cache.report().kv_sequences_compressed == 3
    assert tight_out == free_out
    assert tight.cache.kv.allocator.num_free == 16


def test_freed_blocks_are_back_and_kept_tokens_live():
    model = _model("llama-tiny")
    policy = SnapKV(budget=9, window=3, kernel=3)
    prompts = _prompts([45, 22, 8], seed=6)
    engine = _engine(model, policy, num_blocks=40, max_batch_tokens=12)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=10))
    m, alloc = engine.cache_manager, engine.cache.kv.allocator
    compressed_at = {}
    while engine.has_unfinished():
        engine.step()
        held = []
        for req in engine.running:
            seq = m.seqs[req.request_id]
            n_kv = m.kv_length(req.request_id, req.num_computed)
            assert len(seq.blocks) == m.blocks_for(n_kv) and NULL_BLOCK not in seq.blocks
            if seq.kept is not None:
                compressed_at.setdefault(req.request_id, len(req.prompt))
                assert seq.dropped == len(req.prompt) - policy.budget
                # every kept token is in slots 0..budget-1: blocks the sequence holds, none of them free
                for b in seq.blocks[:m.blocks_for(policy.budget)]:
                    assert alloc.ref_counts[b] == 1 and b not in alloc.free_ids()
            held.extend(seq.blocks)
        assert len(held) == len(set(held)) and alloc.num_free + len(held) == alloc.num_blocks
    assert sorted(compressed_at.values()) == [22, 45]
    r = engine.cache.report()
    # 45 tokens: 12 blocks -> 3, 22 tokens: 6 blocks -> 3
    assert r.kv_blocks_pruned == (12 - 3) + (6 - 3) and r.kv_sequences_compressed == 2
    assert alloc.num_free == 40


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantised_pages_move_exactly_with_their_scales(kv_dtype):
    """Compaction moves codes with their per-token scales: slot j of the kept blocks holds, for every head h,
    head h's kept token's codes and scale bit for bit (nothing is re-quantised)."""
    model = _model("llama-tiny")
    policy = SnapKV(budget=11, window=3, kernel=3)
    (prompt,) = _prompts([29], seed=7)
    engine = _engine(model, policy, kv_dtype=kv_dtype)
    kv = engine.cache.kv
    before = {}
    compact = kv.compact

    def flat(t, blocks, n):  # the first n token slots of a sequence's blocks, raw bits
        return _raw_bits(t[torch.tensor(blocks)]).flatten(0, 1)[:n]

    def spy(blocks, kept):
        before.update({i: [flat(t, blocks, len(prompt)).clone() for t in (*kv.pools[i], *kv.scales[i])]
                       for i in kept})
        compact(blocks, kept)
    kv.compact = spy
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=3))
    _step_until_decoding(engine, rid)
    seq = engine.cache_manager.seqs[rid]
    for i, idx in seq.kept.items():
        for t, old in zip((*kv.pools[i], *kv.scales[i]), before[i], strict=True):
            after = flat(t, seq.blocks, policy.budget)  # [budget, Hkv(, D)]
            expect = torch.stack([old[idx[h], h] for h in range(idx.shape[0])], 1)
            assert torch.equal(after, expect)
        assert before[i][2].float().abs().sum() > 0  # real scales were written and moved


def _raw_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_speculative_decoding_with_snapkv_equals_plain():
    model = _model("jamba-tiny")
    policy = SnapKV(budget=12, window=4)
    prompts = [p * 3 for p in _prompts([9, 14], seed=8)]  # repeats: n-gram drafts get accepted
    plain = _outputs(_engine(model, policy), prompts, max_new_tokens=12)
    spec = _engine(model, policy, speculative=SpeculativeConfig(method="ngram", num_tokens=3))
    assert _outputs(spec, prompts, max_new_tokens=12) == plain
    assert spec.stats.draft_tokens_proposed > 0 and spec.cache.kv.allocator.num_free == 96


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match="budget > window"):
        SnapKV(budget=8, window=8)
    with pytest.raises(ValueError, match="window >= 1"):
        SnapKV(budget=8, window=0)
    with pytest.raises(ValueError, match="odd kernel"):
        SnapKV(budget=16, window=4, kernel=4)
    with pytest.raises(ValueError, match="pooling must be one of"):
        SnapKV(budget=16, window=4, pooling="mean")
    model = _model("llama-tiny")
    with pytest.raises(ValueError, match="kv_pruning with prefix_caching is not supported .SnapKV"):
        Engine(model, num_blocks=8, kv_pruning=SnapKV(budget=16, window=4), prefix_caching=True)
    with pytest.raises(ValueError, match="SnapKV on a sliding-window model"):
        Engine(_model("samba-tiny"), num_blocks=8, kv_pruning=SnapKV(budget=16, window=4))
    with pytest.raises(TypeError, match="kv_pruning=5: must be a StreamingLLM or SnapKV"):
        Engine(model, num_blocks=8, kv_pruning=5)
    with pytest.raises(ValueError, match="kv_pruning='snapkv': snapkv: .*budget"):  # the --kv-pruning text, checked
        Engine(model, num_blocks=8, kv_pruning="snapkv")
    assert Engine(model, num_blocks=8, kv_pruning="snapkv:budget=16,window=4").cache.kv.snapkv == SnapKV(budget=16,
                                                                                                       window=4)
    assert parse_policy("snapkv:budget=64,window=8,pooling=avg") == SnapKV(budget=64, window=8, pooling="avg")
    assert parse_policy("streaming:sinks=2,window=30") == StreamingLLM(sinks=2, window=30)
    for bad, match in [("h2o:budget=4", "unknown KV pruning policy"), ("snapkv:size=4", "fields are budget"),
                       ("snapkv:budget=x", "budget must be an integer"), ("snapkv:window=4", "budget")]:
        with pytest.raises(ValueError, match=match):
            parse_policy(bad)


def test_a_request_is_sized_by_its_compressed_peak():
    """A prompt the cache holds, with more new tokens than it could hold uncompressed, is admitted: after the
    prompt only the budget and the new tokens stay."""
    model = _model("llama-tiny")
    engine = _engine(model, SnapKV(budget=8, window=4), num_blocks=10, max_batch_tokens=64)
    (prompt,) = _prompts([36], seed=9)  # 9 blocks; 36 + 20 tokens would need 14
    out = _outputs(engine, [prompt], max_new_tokens=21)
    assert len(out[0]) == 21
    with pytest.raises(ValueError, match="KV blocks at once"):
        _engine(model, None, num_blocks=10, max_batch_tokens=64).add_request(prompt, SamplingParams(max_new_tokens=21))


def test_compiled_decode_reads_kv_lengths():
    """The compiled decode step takes the compressed sequences' KV lengths and slots, and a one-token last prompt
    chunk inside the observation window (17 = 8 + 8 + 1, alone in its step) runs eagerly, so its query is
    captured."""
    model = _model("llama-tiny")
    policy = SnapKV(budget=10, window=4)
    prompts = _prompts([17, 25, 6], seed=10)
    eager = [_outputs(_engine(model, policy, max_batch_tokens=8), [p]) for p in prompts]
    engine = _engine(model, policy, max_batch_tokens=8, max_seqs=2, compile=True, compile_backend="aot_eager")
    assert [_outputs(engine, [p]) for p in prompts] == eager
    assert engine.stats.compiled_steps > 0 and engine.cache.report().kv_sequences_compressed == 2
