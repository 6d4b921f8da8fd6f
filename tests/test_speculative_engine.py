"""Speculative decoding inside the engine: speculating, plain and prefilling requests in one step, preemption
of a speculating request, prefix caching in both caches, random workloads that never leak a block or a slot
in either cache, n-gram lookup, stats, and the config's errors."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_properties import run_workload, workload_ops
from test_speculative import assert_all_freed, generate_all, prompts_of, tiny

from hybrid import (
    AttentionConfig,
    Engine,
    HybridConfig,
    HybridLM,
    Mamba1Config,
    Mamba2Config,
    SamplingParams,
    SpeculativeConfig,
)
from hybrid.cache import NULL_BLOCK
from hybrid.speculative.ngram import ngram_lookup


def test_ngram_lookup_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    assert ngram_lookup(tokens, 2, 3, 1) == [7, 5]  # "1 2 3" last seen before 7 5
    assert ngram_lookup([4, 1, 2, 8, 1, 6, 1], 3, 3, 1) == [6, 1]  # only "1" matches, latest first; cut at the end
    assert ngram_lookup([1, 2, 3], 4, 3, 1) == []
    assert ngram_lookup([5, 5], 4, 2, 2) == []  # n_min = 2: a single repeated token is not enough


def test_speculating_plain_and_prefilling_requests_share_steps():
    """Greedy speculating requests, a plain one (repetition penalty: never speculated) and long prompts
    prefilled in chunks, in the same packed steps: every output equals the engine's without speculation."""
    target = tiny("hybrid-1to7-tiny")
    prompts = prompts_of([4, 6, 5, 40, 33])
    params = [SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=10, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6)]
    ref, _ = generate_all(target, prompts, params=params, max_batch_tokens=24)
    spec = SpeculativeConfig(method="draft", draft_model=tiny("hybrid-1to7-tiny", seed=0), num_tokens=3)
    engine = Engine(target, num_blocks=96, block_size=4, max_seqs=4, max_batch_tokens=24, speculative=spec)
    seen = []
    execute = engine.runner.execute

    def spy(chunks, *, all_logits=False, num_verify=0):
        seen.append(([len(c.tokens) for c in chunks], num_verify))
        return execute(chunks, all_logits=all_logits, num_verify=num_verify)

    engine.runner.execute = spy
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:3], params[:3], strict=True)]
    engine.step()  # the three short prompts
    ids += [engine.add_request(p, sp) for p, sp in zip(prompts[3:], params[3:], strict=True)]
    engine.run()
    assert [engine.requests[i].output for i in ids] == ref
    mixed = [(lens, nv) for lens, nv in seen if nv and 1 in lens and len(lens) > nv + lens.count(1)]
    assert mixed, f"no step held a decode, verify chunks and a prefill together: {seen}"
    assert_all_freed(engine)


def test_draft_lengths_differ_per_request_near_their_limits():
    """k is cut per request by the tokens it has left: requests with different limits verify chunks of
    different lengths in one step, and stop exactly at their limits."""
    target = tiny("mamba2-tiny")
    prompts = prompts_of([5, 5, 5])
    params = [SamplingParams(max_new_tokens=m) for m in (3, 5, 9)]
    ref, _ = generate_all(target, prompts, params=params)
    engine = Engine(target, num_blocks=96, block_size=4, max_seqs=4,
                    speculative=SpeculativeConfig(method="draft", draft_model=target, num_tokens=4))
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.step()
    before = engine.stats.draft_tokens_proposed
    engine.step()  # one verify step: drafts 1, 3 and 4 (each limit minus the token sampled minus the bonus)
    assert engine.stats.draft_tokens_proposed - before == 1 + 3 + 4
    engine.run()
    assert [engine.requests[i].output for i in ids] == ref
    assert [len(engine.requests[i].output) for i in ids] == [3, 5, 9]


def test_preempting_a_speculating_request_frees_both_caches_and_stays_lossless():
    target = tiny("jamba-tiny")
    prompts = prompts_of([6, 7, 9, 5])
    params = [SamplingParams(max_new_tokens=14)] * 4
    ref, _ = generate_all(target, prompts, params=params)
    spec = SpeculativeConfig(method="draft", draft_model=tiny("jamba-tiny", seed=2), num_tokens=3,
                             draft_num_blocks=10)
    out, engine = generate_all(target, prompts, spec, params=params, num_blocks=14, max_seqs=4)
    assert engine.stats.preemptions > 0 and engine.stats.verify_chunks > 0
    assert out == ref
    assert_all_freed(engine)


def test_prefix_caching_shares_prefixes_in_the_target_and_the_draft_cache():
    target = tiny("hybrid-1to7-tiny")
    base = prompts_of([21])[0]
    prompts = [base + [1, 2], base + [3]]
    ref, _ = generate_all(target, prompts)
    spec = SpeculativeConfig(method="draft", draft_model=tiny("samba-tiny", seed=4), num_tokens=3)
    engine = Engine(target, num_blocks=96, block_size=4, max_seqs=4, prefix_caching=True, speculative=spec)
    outs = []
    for p in prompts + prompts:  # one at a time: each later one finds the earlier ones' prefixes
        rid = engine.add_request(p, SamplingParams(max_new_tokens=12))
        engine.run()
        outs.append(engine.requests[rid].output)
    assert outs == ref + ref
    assert engine.stats.prefix_hit_tokens > 0 and engine.drafter.prefix_hit_tokens > 0
    assert_all_freed(engine)


def test_stats_count_drafts_and_split_the_verify_time():
    target = tiny("nemotronh-tiny")
    _, engine = generate_all(target, prompts_of([7, 8]), SpeculativeConfig(method="draft", draft_model=target,
                                                                             num_tokens=4))
    s = engine.stats
    assert s.draft_tokens_accepted == s.draft_tokens_proposed > 0 and s.acceptance_rate == 1.0
    assert s.mean_accepted_length == pytest.approx(s.draft_tokens_accepted / s.verify_chunks)
    assert s.verify_steps > 0 and s.verify_forward_seconds > 0 and s.draft_seconds > 0
    assert s.accept_seconds > 0 and s.rollback_seconds > 0
    assert s.verify_state_bytes > 0
    assert s.decode_tokens > 0  # emitted tokens of verify steps count as decoded


def test_config_and_engine_errors_say_what_to_do():
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="needs draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="drafts without a model"):
        SpeculativeConfig(method="ngram", draft_model=object())
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculativeConfig(method="ngram", num_tokens=0)
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(method="ngram", ngram_min=3, ngram_max=2)
    target = tiny("llama-tiny")
    other = HybridLM(dataclasses.replace(target.config, vocab_size=128))
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(target, num_blocks=8, speculative=SpeculativeConfig(method="draft", draft_model=other))
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        Engine(target, num_blocks=8, speculative={"method": "ngram"})


# ---- random workloads ----------------------------------------------------------------------------
CFG = HybridConfig(vocab_size=16, d_model=32, pattern="M*-m", attention=AttentionConfig(n_heads=2, n_kv_heads=1),
                   mamba2=Mamba2Config(head_dim=16, d_state=8, chunk_size=8), mamba1=Mamba1Config(d_state=4))
NUM_BLOCKS, BLOCK_SIZE, MAX_SEQS = 8, 4, 3


def small(seed):
    torch.manual_seed(seed)
    m = HybridLM(CFG).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(30)
    return m


TARGET, DRAFT = small(0), small(1)


def check_invariants(engine):
    live = {r.request_id for r in engine.running}
    for m in (engine.cache_manager, getattr(engine.drafter, "manager", None)):
        if m is None:
            continue
        assert set(m.seqs) <= live
        blocks = m.blocks_in_use()
        assert NULL_BLOCK not in blocks and len(blocks) == len(set(blocks)), "a block belongs to two sequences"
        assert sorted(m.kv.allocator.free_ids()) == sorted(set(range(1, m.kv.num_blocks + 1)) - set(blocks))
        slots = [m.state_slot(r) for r in m.seqs]
        assert len(slots) == len(set(slots)) and m.num_free_slots + len(slots) == m.ssm.num_slots
        for rid, seq in m.seqs.items():  # no KV blocks past what the sequence's tokens (and drafts) need
            req = engine.requests[rid]
            assert len(seq.blocks) <= m.kv.blocks_for(req.num_tokens + engine.speculative.num_tokens)
    assert set(engine.cache_manager.seqs) == live
    for r in engine.requests.values():
        assert len(r.output) <= r.params.max_new_tokens


OPS = workload_ops(10, 9, 20)


@settings(max_examples=20, deadline=None)
@given(ops=OPS, budget=st.integers(1, 16), method=st.sampled_from(["draft", "ngram"]), k=st.integers(1, 4),
       temperature=st.sampled_from([0.0, 1.0]))
def test_random_workloads_never_leak_and_stay_lossless(ops, budget, method, k, temperature):
    spec = SpeculativeConfig(method=method, num_tokens=k, **({"draft_model": DRAFT, "draft_num_blocks": 6}
                                                            if method == "draft" else {}))
    engine = Engine(TARGET, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_seqs=MAX_SEQS, max_batch_tokens=budget,
                    speculative=spec)
    # few distinct ids: n-gram drafts hit
    run_workload(engine, ops, vocab=4, temperature=temperature, check=check_invariants)
    assert_all_freed(engine)
    alone = Engine(TARGET, num_blocks=64, block_size=BLOCK_SIZE, max_seqs=1)
    for r in engine.requests.values():
        assert r.finish_reason in ("length", "abort")
        if r.finish_reason == "length":
            assert len(r.output) == r.params.max_new_tokens
            if temperature == 0.0:  # greedy: exactly the tokens of a plain engine
                rid = alone.add_request(r.prompt, r.params)
                alone.run()
                assert alone.requests[rid].output == r.output


def test_mamba2_closed_form_verify_equals_step_ops_at_every_position():
    """The closed-form verify chunk (conv + SSD) gives the outputs and the states after each position that
    running the one-token step ops position by position gives (the per-position reference path)."""
    from hybrid.cache.views import StateCacheView, StateRows
    from hybrid.speculative.verify_states import VerifyStates

    torch.manual_seed(0)
    layer = HybridLM(CFG).layers[0].mixer  # a Mamba-2 mixer
    n, lengths = 3, [5, 2, 4]
    m = layer.cfg
    conv_pool = torch.randn(n + 1, m.conv_dim, m.d_conv - 1)
    ssm_pool = torch.randn(n + 1, layer.n_heads, layer.head_dim, layer.d_state)
    slots = torch.tensor([2, 0, 3])
    T = sum(lengths)
    xBC, dt_raw = torch.randn(T, m.conv_dim), torch.randn(T, layer.n_heads)
    closed, stepped = VerifyStates(lengths, slots, "cpu"), VerifyStates(lengths, slots, "cpu")
    before = (conv_pool.clone(), ssm_pool.clone())
    with torch.no_grad():
        view = StateCacheView(("conv", "ssm"), (StateRows(conv_pool), StateRows(ssm_pool)))
        y_closed = closed.run_chunk(view, (xBC, dt_raw), layer.verify_chunk)
        y_step = stepped.run(view, (xBC, dt_raw), layer.step)
    torch.testing.assert_close(y_closed, y_step, rtol=1e-4, atol=1e-5)
    assert torch.equal(conv_pool, before[0]) and torch.equal(ssm_pool, before[1]), "the slots stay as they were"
    (_, (conv_c, ssm_c)), (_, (conv_s, ssm_s)) = closed.layers[0], stepped.layers[0]
    for i, length in enumerate(lengths):  # positions past a chunk's end are padding, never committed
        torch.testing.assert_close(conv_c[:length, i], conv_s[:length, i])
        torch.testing.assert_close(ssm_c[:length, i], ssm_s[:length, i], rtol=1e-4, atol=1e-5)


def test_cli_flags_pass_the_config_through(tmp_path, capsys):
    from hybrid import save_pretrained
    from hybrid.cli import _speculative, build_parser, main

    draft_dir = tmp_path / "draft"
    save_pretrained(tiny("llama-tiny", seed=1), str(draft_dir))
    main(["generate", "--recipe", "hybrid-1to7-tiny", "--prompt", "abcabcabc", "--max-new-tokens", "8", "--ngram",
          "--num-draft-tokens", "3", "--threads", "1"])
    assert "speculative (ngram, k=3)" in capsys.readouterr().err
    main(["generate", "--recipe", "hybrid-1to7-tiny", "--prompt", "abc", "--max-new-tokens", "6",
          "--draft-model", str(draft_dir), "--threads", "1"])
    assert "speculative (draft, k=4)" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--recipe", "llama-tiny", "--draft-model", str(draft_dir),
                                      "--num-draft-tokens", "2"])
    spec = _speculative(args, tiny("llama-tiny"))
    assert spec.method == "draft" and spec.num_tokens == 2 and spec.draft_model.config.vocab_size == 256
    assert _speculative(build_parser().parse_args(["serve", "--recipe", "llama-tiny"]), None) is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--recipe", "llama-tiny", "--ngram", "--draft-model", "x"])


@pytest.mark.parametrize("recipe", ["hybrid-1to7-tiny", "jamba-tiny", "gla-hybrid-tiny", "qwen3next-like-tiny"])
@pytest.mark.parametrize("kv_dtype,state_dtype,window", [("int8", "int8", None), ("fp8", "bfloat16", None),
                                                          ("bfloat16", "float32", 16)])
def test_speculation_on_compressed_and_pruned_caches(recipe, kv_dtype, state_dtype, window):
    """Speculation composes with cache compression (issue 15) and StreamingLLM pruning: both caches give
    everything back, and greedy tokens equal the plain engine's on the same compressed cache. A verify that steps
    position by position rounds its int8 working copy after every position as the pool's write-back does
    (StatePool.rounding): exact by construction where the plain step is that write-back (GLA, GDN, the convs).
    Not by construction (these seeds have no near-tie that flips): Mamba-2's closed-form verify, which rounds
    once at commit, and the fused int8 steps on the codes (ssd / selective), which round their own way."""
    from hybrid.cache.pruning import StreamingLLM

    target = tiny(recipe)
    prompts = prompts_of([4, 6, 5, 40, 33])
    prune = None if window is None else StreamingLLM(sinks=4, window=window)
    outs = {}
    for name, spec in [("plain", None), ("ngram", SpeculativeConfig(method="ngram", num_tokens=3)),
                       ("draft", SpeculativeConfig(method="draft", draft_model=tiny(recipe, seed=0), num_tokens=3))]:
        e = Engine(target, num_blocks=96, block_size=4, max_seqs=4, max_batch_tokens=24, speculative=spec,
                   kv_dtype=kv_dtype, state_dtype=state_dtype, kv_pruning=prune)
        ids = [e.add_request(p, SamplingParams(max_new_tokens=24)) for p in prompts]
        e.run()
        outs[name] = [e.requests[i].output for i in ids]
        assert all(len(o) == 24 for o in outs[name])
        assert_all_freed(e)
    assert outs["ngram"] == outs["plain"] and outs["draft"] == outs["plain"]
