"""lm-eval through the engine's prefix cache (``prefix_caching=True``): log-likelihoods equal the direct
computation, with far fewer positions computed when contexts are shared."""

import dataclasses

import pytest
import torch
from hybrid.eval.lm_eval_model import HybridEvalLM
from hybrid.eval.lm_eval_run import run, task_accuracy
from test_eval_lm_eval_model import QUESTIONS

from hybrid import HybridLM, recipes


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return HybridLM(dataclasses.replace(recipes.get("hybrid-1to7-tiny"), vocab_size=259)).eval()


def test_loglikelihoods_equal_the_direct_computation(model):
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(0, 256, (90,), generator=g).tolist()
    requests = []
    for q in range(3):
        ctx = shared + torch.randint(0, 256, (7 + q,), generator=g).tolist()
        for c in range(4):  # one-token choices differing only in their last token, and longer ones
            requests.append((None, ctx, [32, 65 + c]))
            requests.append((None, ctx, torch.randint(0, 256, (1 + c,), generator=g).tolist()))
    direct = HybridEvalLM(pretrained=model)._loglikelihood_tokens(requests, disable_tqdm=True)
    cached_lm = HybridEvalLM(pretrained=model, prefix_caching=True, max_batch_tokens=32, batch_size=4)
    cached = cached_lm._loglikelihood_tokens(requests, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(direct, cached, strict=True):
        assert b == pytest.approx(a, abs=1e-4)
        assert ga == gb
    stats = cached_lm.engine.stats
    assert stats.prefix_hit_tokens > 0
    assert cached_lm.tokens_computed < sum(len(c) + len(x) for _, c, x in requests) / 4


def test_mmlu_through_the_prefix_cache_equals_the_direct_run(model, tmp_path):
    for split, rows in (("dev", QUESTIONS[:2]), ("test", QUESTIONS)):
        (tmp_path / split).mkdir()
        lines = ["question,choice0,choice1,choice2,choice3,answer", *(",".join(r) for r in rows)]
        (tmp_path / split / f"anatomy_{split}.csv").write_text("\n".join(lines) + "\n")
    kw = dict(tasks=["mmlu_local_anatomy"], num_fewshot=2, mmlu_dir=str(tmp_path), log_samples=True)
    off = run(model, **kw)
    on = run(model, prefix_caching=True, max_batch_tokens=64, **kw)
    assert task_accuracy(on, "mmlu_local_anatomy") == task_accuracy(off, "mmlu_local_anatomy")
    for a, b in zip(off["samples"]["mmlu_local_anatomy"], on["samples"]["mmlu_local_anatomy"], strict=True):
        # resps: per choice [(loglikelihood, is_greedy)]
        assert [r[0][0] for r in b["resps"]] == pytest.approx([r[0][0] for r in a["resps"]], abs=1e-4)
        assert [r[0][1] for r in b["resps"]] == [r[0][1] for r in a["resps"]]
    assert on["hybrid_tokens_computed"] < off["hybrid_tokens_computed"]
    with pytest.raises(ValueError, match="prefix_caching must be true or false"):
        HybridEvalLM(pretrained=model, prefix_caching="maybe")
