"""Sampling filters, seeds and stop conditions (unit level, then through the engine)."""

import pytest
import torch

from hybrid import Engine, HybridLM, SamplingParams, load_tokenizer, recipes
from hybrid.sampling import apply_repetition_penalty, draw, filtered_probs, sample_tokens

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
LOGITS = PROBS.log().float()


def support(params: SamplingParams) -> list[int]:
    return torch.nonzero(filtered_probs(LOGITS, params)).flatten().tolist()


def test_filters_keep_the_right_tokens():
    assert support(SamplingParams(temperature=1.0)) == [0, 1, 2, 3]
    assert support(SamplingParams(temperature=1.0, top_k=2)) == [0, 1]
    assert support(SamplingParams(temperature=1.0, top_p=0.5)) == [0]  # smallest set with mass >= top_p
    assert support(SamplingParams(temperature=1.0, top_p=0.75)) == [0, 1]
    assert support(SamplingParams(temperature=1.0, top_p=0.81)) == [0, 1, 2]
    assert support(SamplingParams(temperature=1.0, min_p=0.5)) == [0, 1]  # p >= 0.25
    assert support(SamplingParams(temperature=1.0, top_k=3, min_p=0.4)) == [0, 1]
    kept = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(kept[:2], torch.tensor([0.625, 0.375], dtype=torch.float64))


def test_temperature_reshapes_the_distribution():
    cold = filtered_probs(LOGITS, SamplingParams(temperature=0.5))
    assert torch.allclose(cold, PROBS ** 2 / (PROBS ** 2).sum())


def test_draws_follow_the_distribution_and_the_seed():
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(PROBS, g) for _ in range(4000)]), minlength=4)
    assert torch.allclose(counts / 4000, PROBS.float(), atol=0.03)
    a = [draw(PROBS, torch.Generator().manual_seed(5)) for _ in range(3)]
    assert len(set(a)) == 1


def test_repetition_penalty():
    logits = torch.tensor([2.0, 1.0, -1.0, 0.5])
    out = apply_repetition_penalty(logits, torch.tensor([0, 2, 2]), 2.0)
    assert out.tolist() == [1.0, 1.0, -2.0, 0.5]
    # greedy with a strong penalty moves off the already-seen argmax
    assert sample_tokens(logits[None], [SamplingParams(repetition_penalty=4.0)], [torch.tensor([0])],
                         [torch.Generator()]) == [1]
    assert sample_tokens(logits[None], [SamplingParams()], [torch.tensor([0])], [torch.Generator()]) == [0]


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
