"""The natural-language recall probe, held-out perplexity / top-1 agreement, and the Wilson interval."""

import math

import pytest
import torch
from hybrid.eval.intervals import wilson
from hybrid.eval.perplexity import perplexity, top1
from hybrid.eval.recall_probe import make_probe, recall, score_probe

from hybrid import ByteTokenizer, HybridLM, recipes


class Oracle(torch.nn.Module):
    """Puts all its mass on the token that really comes next in the sequence it is given: a perfect copier."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.p = torch.nn.Parameter(torch.zeros(()))

    def forward(self, ids, logits_to_keep=0):
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float() * 20
        return logits[:, logits_to_keep] if isinstance(logits_to_keep, torch.Tensor) else logits


def test_probe_layout():
    tok = ByteTokenizer()
    p = make_probe(tok, 1024, 6, seed=1)
    assert 1000 <= len(p.ids) <= 1040 and len(p.answers) == 6
    text = tok.decode(p.ids)
    for s, e in p.answers:
        ans = tok.decode(p.ids[s:e])
        assert len(ans) == 4 and ans.isdigit() and text[:text.index(ans)].endswith("555-")
        assert text.count(f"555-{ans}.") == 2  # once in the book, once as the answer
    assert make_probe(tok, 1024, 6, seed=1).ids == p.ids and make_probe(tok, 1024, 6, seed=2).ids != p.ids
    with pytest.raises(ValueError, match="fewer than the"):
        make_probe(tok, 200, 50, seed=0)


def test_copier_scores_one_and_random_model_scores_chance():
    tok = ByteTokenizer()
    got = recall(Oracle(259), tok, lengths=(1024, 2048), n_queries=5, contexts=2, progress=False)
    assert all(got[L]["exact"] == 1.0 and got[L]["token_acc"] == 1.0 and got[L]["n"] == 10 for L in (1024, 2048))
    assert got[1024]["mean_answer_logprob"] > -1e-3
    torch.manual_seed(0)
    random_model = HybridLM(recipes.get("llama-tiny")).eval()
    got = recall(random_model, tok, lengths=(1024,), n_queries=6, contexts=1, progress=False)
    # chance for a 9-byte random number is ~10^-4 per answer: an untrained model gets none
    assert got[1024]["exact"] == 0.0 and got[1024]["ci95"][0] == 0.0 and got[1024]["mean_answer_logprob"] < -2
    assert got[1024]["token_acc"] < 0.2
    exact, token_acc, logp = score_probe(random_model, make_probe(tok, 1024, 3, seed=0))
    assert len(exact) == len(token_acc) == len(logp) == 3


def test_perplexity_and_agreement():
    torch.manual_seed(0)
    model = HybridLM(recipes.get("llama-tiny")).eval()
    tokens = torch.randint(0, 256, (4 * 64 + 10,))
    t1 = top1(model, tokens, seq_len=64, batch_size=3)
    assert t1.shape == (4, 63)
    same = perplexity(model, tokens, seq_len=64, batch_size=2, teacher_top1=t1)
    assert same["top1_agreement"] == 1.0 and same["scored_tokens"] == 4 * 63
    logits = model(tokens[:256].view(4, 64))[:, :-1]
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:256].view(4, 64)[:, 1:].flatten())
    assert math.isclose(same["nll"], float(ref), rel_tol=1e-5) and same["ppl"] == math.exp(same["nll"])
    assert perplexity(Oracle(259), tokens, seq_len=64)["ppl"] < 1.001
    assert perplexity(Oracle(259), tokens, seq_len=64, teacher_top1=t1)["top1_agreement"] < 0.1
    with pytest.raises(ValueError, match="same tokens and seq_len"):
        perplexity(model, tokens, seq_len=32, teacher_top1=t1)


def test_wilson_interval():
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and 0.25 < hi < 0.35  # not empty at zero successes
    lo, hi = wilson(173, 600)  # ~0.288 on 600 questions: about +-0.036
    assert 0.25 < lo < 0.26 and 0.32 < hi < 0.33
    assert wilson(10, 10)[1] == 1.0
