"""Speculative decoding: lossless greedy output for every recipe family with any draft, the rejection rule's
output distribution (chi-square against the exact target distribution, with a broken rule that must fail),
Mamba state rollback, mixed steps, preemption, prefix caching, stats, and the config's errors."""

import copy

import pytest
import torch

from hybrid import Engine, HybridConfig, HybridLM, Mamba2Config, SamplingParams, SpeculativeConfig, recipes
from hybrid.config import AttentionConfig
from hybrid.speculative.verifier import draw, token_probs, verify

TINY = [n for n in recipes.names() if n.endswith("-tiny")]


def tiny(name: str, seed: int = 0, sharpen: float = 30.0) -> HybridLM:
    torch.manual_seed(seed)
    model = HybridLM(recipes.get(name)).eval()
    with torch.no_grad():  # sharper logits than the 0.02 init: greedy picks far from ties
        (model.lm_head.weight if model.lm_head is not None else model.embed.weight).mul_(sharpen)
    return model


def prompts_of(lengths, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def generate_all(model, prompts, spec=None, params=None, **kw):
    kw = {"num_blocks": 96, "block_size": 4, "max_seqs": 4, "max_batch_tokens": 64} | kw
    engine = Engine(model, speculative=spec, **kw)
    params = params or [SamplingParams(max_new_tokens=12)] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    engine.run()
    return [engine.requests[i].output for i in ids], engine


def assert_all_freed(engine):
    """Nothing held in the target's cache or the draft's once every request is done."""
    managers = [engine.cache_manager] + ([engine.drafter.manager] if hasattr(engine.drafter, "manager") else [])
    for m in managers:
        assert not m.seqs and m.num_free_slots == m.ssm.num_slots
        if m.prefix is None:
            assert m.num_free_blocks == m.kv.num_blocks
    if hasattr(engine.drafter, "computed"):
        assert not engine.drafter.computed


# ---- lossless greedy -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_greedy_output_is_identical_with_any_draft(name):
    """Every recipe as target: draft = target (all accepted), an unrelated random draft (almost nothing
    accepted), n-gram lookup: the greedy tokens equal the engine's without speculation."""
    target = tiny(name)
    prompts = prompts_of([5, 11, 3]) + [[7, 8, 9, 10] * 4]  # the last one repeats: n-gram drafts hit
    ref, _ = generate_all(target, prompts)
    for spec, lo, hi in ((SpeculativeConfig(method="draft", draft_model=target, num_tokens=3), 1.0, 1.0),
                         (SpeculativeConfig(method="draft", draft_model=tiny(name, seed=1), num_tokens=4), 0.0, 0.2),
                         (SpeculativeConfig(method="ngram", num_tokens=4), 0.0, 1.0)):
        out, engine = generate_all(target, prompts, spec)
        assert out == ref, spec.method
        s = engine.stats
        assert s.draft_tokens_proposed > 0 and lo <= s.acceptance_rate <= hi
        assert_all_freed(engine)


def test_draft_model_from_another_family_is_lossless():
    """A transformer drafting for a hybrid (same vocabulary), with k above the tokens left near the end."""
    target, draft = tiny("hybrid-1to7-tiny"), tiny("llama-tiny", seed=3)
    prompts = prompts_of([6, 2, 17])
    ref, _ = generate_all(target, prompts)
    out, engine = generate_all(target, prompts, SpeculativeConfig(method="draft", draft_model=draft, num_tokens=8))
    assert out == ref
    assert_all_freed(engine)


# ---- the Mamba rollback ------------------------------------------------------------------------------
def noisy_copy(model, scale, seed=5):
    torch.manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().clamp_min(1e-3))
    return other


@pytest.mark.parametrize(("name", "noise"), [("hybrid-1to7-tiny", 0.02), ("jamba-tiny", 0.05),
                                             ("gla-hybrid-tiny", 0.02)])
def test_rolled_back_state_equals_the_state_of_decoding_the_kept_tokens(name, noise):
    """After verify steps that accepted some drafts and rejected others, each request's Mamba conv and SSM
    states (GLA's conv and recurrent ones) and its KV entries equal those of a plain engine that computed the
    same tokens."""
    target = tiny(name)
    draft = noisy_copy(target, noise)  # agrees with the target often, not always: partial acceptance
    spec = SpeculativeConfig(method="draft", draft_model=draft, num_tokens=4)
    engine = Engine(target, num_blocks=64, block_size=4, max_seqs=2, speculative=spec)
    plain = Engine(target, num_blocks=64, block_size=4, max_seqs=2)
    prompt = prompts_of([9])[0]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=40))
    for _ in range(5):
        engine.step()
    req = engine.requests[rid]
    partial = engine.stats.draft_tokens_accepted
    assert 0 < partial < engine.stats.draft_tokens_proposed, "the test needs partly accepted drafts"
    pid = plain.add_request(req.tokens[:req.num_computed], SamplingParams(max_new_tokens=2))
    plain.step()  # prefills exactly the tokens the speculating engine has cached
    preq = plain.requests[pid]
    assert preq.num_computed == req.num_computed
    a, b = engine.cache_manager.state_slot(rid), plain.cache_manager.state_slot(pid)
    for states, pstates in zip(engine.cache.ssm.pools.values(), plain.cache.ssm.pools.values(), strict=True):
        for t, pt in zip(states, pstates, strict=True):  # each state tensor the layer's spec names
            torch.testing.assert_close(t[a], pt[b], rtol=1e-4, atol=1e-5)
    m, pm = engine.cache_manager, plain.cache_manager
    n = req.num_computed
    assert len(m.block_table(rid)) == m.kv.blocks_for(n), "rejected tokens' blocks were given back"
    slots, pslots = m.pool_slots(rid, 0, n), pm.pool_slots(pid, 0, n)
    for (k, v), (pk, pv) in zip(engine.cache.kv.pools.values(), plain.cache.kv.pools.values(), strict=True):
        flat, pflat = k.flatten(0, 1), pk.flatten(0, 1)
        torch.testing.assert_close(flat[slots], pflat[pslots], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v.flatten(0, 1)[slots], pv.flatten(0, 1)[pslots], rtol=1e-4, atol=1e-5)


# ---- the rejection rule ------------------------------------------------------------------------------
def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square test of observed counts against expected counts (cells expecting fewer than 5
    pooled into one), as a p-value."""
    counts, expected = counts.double(), expected.double()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = counts.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.double), stat / 2))


def run_rule(p, q, n_trials, *, broken: bool):
    """Draw K drafts from q, verify them against p with the rule; returns the first emitted token of each
    trial. ``broken``: the sanity check's broken rule, verifying with a uniform q instead of the one the
    drafts came from. (Treating sampled drafts as if q were one-hot is no broken rule: accepting with p(d)
    and resampling from p without d also gives p, only with fewer acceptances.)"""
    g = torch.Generator().manual_seed(1)
    K, V = q.shape
    u_draft = torch.rand(n_trials, K, generator=g, dtype=torch.double)
    drafts = torch.stack([draw(q[j].expand(n_trials, V), u_draft[:, j]) for j in range(K)], 1)
    P = p.expand(n_trials, K + 1, V)
    Q = torch.full((n_trials, K, V), 1.0 / V) if broken else q.expand(n_trials, K, V)
    accepted, token = verify(P, drafts, torch.full((n_trials,), K), Q, torch.rand(n_trials, K, generator=g),
                             torch.rand(n_trials, K + 1, generator=g))
    first = torch.where(accepted > 0, drafts[:, 0], token)
    return first, accepted


def test_rejection_rule_keeps_the_target_distribution_and_a_broken_rule_fails():
    """First emitted token over many trials, chi-square against p: the rule passes (p-value not tiny), the
    sanity check's broken rule (the verifier told the wrong proposal distribution) fails it."""
    torch.manual_seed(0)
    V, K, n = 6, 3, 20000
    p = torch.softmax(torch.randn(K + 1, V) * 1.5, -1)
    q = torch.softmax(torch.randn(K, V) * 1.5, -1)
    first, accepted = run_rule(p, q, n, broken=False)
    assert 0 < accepted.float().mean() < K
    assert chi2_pvalue(torch.bincount(first, minlength=V), p[0] * n) > 1e-3
    wrong, _ = run_rule(p, q, n, broken=True)
    assert chi2_pvalue(torch.bincount(wrong, minlength=V), p[0] * n) < 1e-6


def test_greedy_rule_accepts_exactly_the_argmax_prefix():
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]])
    p = token_probs(logits[0], [SamplingParams()] * 3)[None]
    accepted, token = verify(p, torch.tensor([[1, 2]]), torch.tensor([2]), None, torch.rand(1, 2), torch.rand(1, 3))
    assert accepted.tolist() == [1] and token.tolist() == [0]  # draft 1 is the argmax, draft 2 is not
    accepted, token = verify(p, torch.tensor([[1, 0]]), torch.tensor([2]), None, torch.rand(1, 2), torch.rand(1, 3))
    assert accepted.tolist() == [2] and token.tolist() == [2]  # both accepted: the bonus argmax


SMALL = HybridConfig(vocab_size=8, d_model=32, pattern="M*", attention=AttentionConfig(n_heads=2, n_kv_heads=1),
                     mamba2=Mamba2Config(head_dim=16, d_state=8, chunk_size=8))


def small_model(seed: int) -> HybridLM:
    torch.manual_seed(seed)
    m = HybridLM(SMALL).eval()
    with torch.no_grad():  # logits spread over the 8 tokens, neither uniform nor one-hot
        m.lm_head.weight.mul_(10)
    return m


def sampled_pairs(engine, prompt, n, temperature):
    """(out[1], out[2]) of ``n`` samples continuing ``prompt`` + one fixed first token: forks of one source
    request (one prefill per round), each fork with its own seed, 3 tokens each: its first verify step checks
    2 drafts and can emit both tokens."""
    pairs, seed = [], 0
    while len(pairs) < n:
        src = engine.add_request(prompt, SamplingParams(max_new_tokens=4, temperature=temperature, seed=12345))
        engine.step()
        first = engine.requests[src].output[0]
        forks = []
        while len(engine.running) < engine.max_seqs and len(pairs) + len(forks) < n:
            forks.append(engine.fork(src, SamplingParams(max_new_tokens=4, temperature=temperature, seed=seed)))
            seed += 1
        engine.run()
        pairs += [engine.requests[f].output[1:3] for f in forks]
    return first, torch.tensor(pairs)


def test_engine_samples_the_target_distribution_through_speculation():
    """The joint distribution of the 2nd and 3rd generated tokens (both through the rejection rule: drafted,
    accepted or resampled) from a speculating engine, chi-square against the exact target distribution
    computed with the full forward; breaking the rule (the verifier told a uniform proposal distribution)
    fails the same test."""
    target, draft = small_model(0), small_model(1)
    prompt, n, V, temperature = [1, 2, 3, 4], 2000, SMALL.vocab_size, 0.8
    spec = SpeculativeConfig(method="draft", draft_model=draft, num_tokens=2)

    def engine():
        return Engine(target, num_blocks=512, block_size=4, max_seqs=100, max_batch_tokens=1024, speculative=spec)

    good = engine()
    first, pairs = sampled_pairs(good, prompt, n, temperature)
    assert 0.05 < good.stats.acceptance_rate < 0.95  # drafts are accepted and rejected: the rule is exercised
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt + [first]]))[0, -1] / temperature, -1)
        p2 = torch.softmax(target(torch.tensor([prompt + [first, b] for b in range(V)]))[:, -1] / temperature, -1)
    exact = (p1[:, None] * p2).flatten() * n
    assert chi2_pvalue(torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V), exact) > 1e-3

    bad = engine()
    propose = bad.drafter.propose

    def uniform_q(reqs, ks):  # the broken rule: the drafts' real proposal distribution is not what is verified
        drafts, qs = propose(reqs, ks)
        return drafts, [None if q is None else torch.full_like(q, 1.0 / V) for q in qs]

    bad.drafter.propose = uniform_q
    first_bad, pairs = sampled_pairs(bad, prompt, n, temperature)
    assert first_bad == first
    assert chi2_pvalue(torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V), exact) < 1e-6
