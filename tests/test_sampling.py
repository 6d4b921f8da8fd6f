"""Sampling filters, seeds and stop conditions (unit level on batched tensors, then through the engine)."""

import pytest
import torch

from hybrid import Engine, HybridLM, SamplingParams, load_tokenizer, recipes
from hybrid.sampling import SamplingBatch, apply_repetition_penalty, filtered_probs, sample, uniforms

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
LOGITS = PROBS.log().float()


def batch_of(params: list[SamplingParams], seeds=None, counters=None, contexts=None, vocab=4) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, seeds or [0] * n, counters or [0] * n, contexts, vocab, "cpu")


def probs_in_vocab_order(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The normalised sampling distribution of one row, token by token."""
    probs, order = filtered_probs(logits[None], batch_of([params], vocab=logits.shape[-1]))
    if order is not None:
        probs = torch.zeros_like(probs).scatter(1, order, probs)
    return (probs / probs.sum())[0]


def support(params: SamplingParams) -> list[int]:
    return torch.nonzero(probs_in_vocab_order(LOGITS, params)).flatten().tolist()


def test_filters_keep_the_right_tokens():
    assert support(SamplingParams(temperature=1.0)) == [0, 1, 2, 3]
    assert support(SamplingParams(temperature=1.0, top_k=2)) == [0, 1]
    assert support(SamplingParams(temperature=1.0, top_p=0.5)) == [0]  # smallest set with mass >= top_p
    assert support(SamplingParams(temperature=1.0, top_p=0.75)) == [0, 1]
    assert support(SamplingParams(temperature=1.0, top_p=0.81)) == [0, 1, 2]
    assert support(SamplingParams(temperature=1.0, min_p=0.5)) == [0, 1]  # p >= 0.25
    assert support(SamplingParams(temperature=1.0, top_k=3, min_p=0.4)) == [0, 1]
    kept = probs_in_vocab_order(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(kept[:2].double(), torch.tensor([0.625, 0.375], dtype=torch.float64))


def test_rows_with_different_settings_are_filtered_side_by_side():
    """One batch: each row gets its own filter, exactly as it would alone."""
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0),
              SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=0.5, min_p=0.5)]
    probs, order = filtered_probs(LOGITS.expand(4, 4), batch_of(params))
    together = torch.zeros_like(probs).scatter(1, order, probs)
    for b, p in enumerate(params):
        alone = probs_in_vocab_order(LOGITS, p)
        assert torch.allclose(together[b] / together[b].sum(), alone)


def test_temperature_reshapes_the_distribution():
    cold = probs_in_vocab_order(LOGITS, SamplingParams(temperature=0.5))
    assert torch.allclose(cold.double(), PROBS ** 2 / (PROBS ** 2).sum(), atol=1e-6)


def test_uniforms_are_a_pure_function_of_seed_and_counter():
    seeds = torch.tensor([5, 5, 6, 2**62], dtype=torch.long)
    counters = torch.tensor([0, 1, 0, 7], dtype=torch.long)
    u = uniforms(seeds, counters)
    assert torch.equal(u, uniforms(seeds, counters)) and ((u >= 0) & (u < 1)).all()
    assert len(set(u.tolist())) == 4
    assert uniforms(seeds[2:3], counters[2:3]).item() == u[2].item()  # batch composition does not matter
    many = uniforms(torch.full((20000,), 3, dtype=torch.long), torch.arange(20000))
    assert abs(many.mean().item() - 0.5) < 0.01 and abs(many.var().item() - 1 / 12) < 0.005


def test_draws_follow_the_distribution_and_the_seed():
    n = 4000
    params = [SamplingParams(temperature=1.0)] * n
    ids = sample(LOGITS.expand(n, 4), batch_of(params, seeds=[1] * n, counters=list(range(n))))
    counts = torch.bincount(ids, minlength=4)
    assert torch.allclose(counts / n, PROBS.float(), atol=0.03)
    # the same (seed, counter) draws the same token; a filter never lets a filtered token through
    again = sample(LOGITS.expand(n, 4), batch_of(params, seeds=[1] * n, counters=list(range(n))))
    assert torch.equal(ids, again)
    top2 = sample(LOGITS.expand(n, 4), batch_of([SamplingParams(temperature=1.0, top_k=2)] * n,
                                                 seeds=[2] * n, counters=list(range(n))))
    assert set(top2.tolist()) == {0, 1}


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.tensor([[0.1, 3.0, 0.2, 0.0], [5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 9.0]])
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams()]
    assert sample(logits, batch_of(params)).tolist() == [1, 0, 3]


def test_repetition_penalty():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    seen = torch.tensor([[True, False, True, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, 1.0, -2.0, 0.5]]
    # greedy with a strong penalty moves off the already-seen argmax; without one it stays
    assert sample(logits, batch_of([SamplingParams(repetition_penalty=4.0)], contexts=[[0]])).tolist() == [1]
    assert sample(logits, batch_of([SamplingParams()], contexts=[[0]])).tolist() == [0]


def test_params_are_validated():
    for bad in (dict(max_new_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1),
                dict(min_p=1.5), dict(repetition_penalty=0.0), dict(stop=("",))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = recipes.get("hybrid-1to7-tiny")
    m = HybridLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the 0.02 init, so samples differ between seeds
        m.lm_head.weight.mul_(50)
    return m


def run(model, prompt, params, tokenizer=None, **kw):
    engine = Engine(model, num_blocks=16, block_size=8, tokenizer=tokenizer, **kw)
    rid = engine.add_request(prompt, params)
    engine.run()
    return engine.requests[rid]


def test_same_seed_same_output_whatever_the_batch(model):
    p = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=11)
    alone = run(model, [1, 2, 3], p).output
    engine = Engine(model, num_blocks=32, block_size=8)
    engine.add_request([9, 9], SamplingParams(max_new_tokens=5, temperature=1.0, seed=1))
    rid = engine.add_request([1, 2, 3], p)
    engine.run()
    assert engine.requests[rid].output == alone
    other = run(model, [1, 2, 3], SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=12)).output
    assert other != alone


def test_stop_token_ids_and_max_new_tokens(model):
    greedy = run(model, [5, 6, 7], SamplingParams(max_new_tokens=10)).output
    assert len(greedy) == 10
    stop = greedy[4]
    first = greedy.index(stop)
    r = run(model, [5, 6, 7], SamplingParams(max_new_tokens=10, stop_token_ids=(stop,)))
    assert r.output == greedy[:first] and r.finish_reason == "stop"


def test_stop_strings_cut_the_text(model):
    tok = load_tokenizer(None)
    free = run(model, tok.encode("ab"), SamplingParams(max_new_tokens=12), tokenizer=tok)
    text = free.text
    stop = text[5:7]
    r = run(model, tok.encode("ab"), SamplingParams(max_new_tokens=12, stop=(stop,)), tokenizer=tok)
    assert r.finish_reason == "stop"
    assert r.text == text[:text.index(stop)]
    assert not r.text.endswith(stop) and stop not in r.text
