"""The lm-eval model "hybrid": scores equal the model's own logits, batching changes nothing,
simple_evaluate runs an MMLU-format task, generation honours stop strings."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from hybrid.eval.lm_eval_model import HybridEvalLM
from hybrid.eval.lm_eval_run import run, task_accuracy, write_results
from lm_eval.api.instance import Instance

from hybrid import HybridLM, recipes

QUESTIONS = [
    ["What is the largest bone?", "Femur", "Stapes", "None", "Ulna", "0"],
    ["Which organ pumps blood?", "Liver", "Heart", "Lung", "Kidney", "1"],
    ["How many chambers has the human heart?", "Two", "Three", "Four", "Five", "2"],
    ["Where is the tibia?", "Arm", "Skull", "Chest", "Leg", "3"],
]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    # Mamba-2 then attention blocks; byte tokenizer ids 0..255 plus its specials (bos 256, eos 257, pad 258)
    return HybridLM(dataclasses.replace(recipes.attention_family("tiny", 0.5, 2), vocab_size=259)).eval()


@pytest.fixture
def mmlu_dir(tmp_path):
    for split, rows in (("dev", QUESTIONS[:2]), ("test", QUESTIONS)):
        (tmp_path / split).mkdir()
        lines = ["question,choice0,choice1,choice2,choice3,answer", *(",".join(r) for r in rows)]
        (tmp_path / split / f"anatomy_{split}.csv").write_text("\n".join(lines) + "\n")
    return tmp_path


def direct_loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    ctx, whole = tokenizer.encode(context, add_special_tokens=False), \
        tokenizer.encode(context + continuation, add_special_tokens=False)
    cont = whole[len(ctx):]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([whole]))[0].float(), dim=-1)
    rows = logp[len(ctx) - 1: len(whole) - 1]
    target = torch.tensor(cont)
    return float(rows.gather(1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


def test_simple_evaluate_on_local_mmlu_matches_direct_scores(model, mmlu_dir, tmp_path):
    results = run(model, tasks=["mmlu_local_anatomy"], num_fewshot=1, mmlu_dir=str(mmlu_dir), batch_size=3,
                  log_samples=True)
    acc = task_accuracy(results, "mmlu_local_anatomy")
    assert 0.0 <= acc <= 1.0
    samples = results["samples"]["mmlu_local_anatomy"]
    assert len(samples) == len(QUESTIONS)
    lm = HybridEvalLM(pretrained=model)
    correct = 0
    for s in samples:
        ctx, conts = s["arguments"][0][0], [a[1] for a in s["arguments"]]
        assert ctx.startswith("The following are multiple choice questions (with answers) about anatomy.\n\n")
        assert conts == [" A", " B", " C", " D"]
        scores = [direct_loglikelihood(model, lm.tokenizer, ctx, c) for c in conts]
        for (got, greedy), (want, want_greedy) in zip([r[0] for r in s["resps"]], scores, strict=True):
            assert got == pytest.approx(want, abs=1e-4) and greedy == want_greedy
        correct += max(range(4), key=lambda i: scores[i][0]) == s["target"]
    assert acc == pytest.approx(correct / len(samples))
    path = write_results(results, tmp_path / "out", "tiny")
    assert '"mmlu_local_anatomy"' in path.read_text()


def requests_for(contexts_and_continuations):
    return [Instance("loglikelihood", {}, (c, x), i) for i, (c, x) in enumerate(contexts_and_continuations)]


def test_batch_size_does_not_change_scores_and_greedy_flag_is_right(model):
    pairs = [("The cat sat on the", " mat"), ("Numbers: 1 2 3", " 4 5"), ("x", "y"), ("A longer context here,", " ok"),
             ("The cat sat on the", " hat"), ("Question?\nAnswer:", " B")] * 2
    one = HybridEvalLM(pretrained=model, batch_size=1).loglikelihood(requests_for(pairs), disable_tqdm=True)
    eight = HybridEvalLM(pretrained=model, batch_size=8).loglikelihood(requests_for(pairs), disable_tqdm=True)
    lm = HybridEvalLM(pretrained=model)
    for (a, ga), (b, gb), (ctx, cont) in zip(one, eight, pairs, strict=True):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb
        # rows of different lengths and 1-3 token continuations in one batch: each row's own positions scored
        want, want_greedy = direct_loglikelihood(model, lm.tokenizer, ctx, cont)
        assert b == pytest.approx(want, abs=1e-4) and gb == want_greedy
    # the model's own greedy next token must be flagged greedy, any other token not
    ctx = lm.tok_encode("The cat sat on the")
    with torch.no_grad():
        best = int(model(torch.tensor([ctx]))[0, -1].argmax())
    (_, g_best), (_, g_other) = lm._loglikelihood_tokens([(None, ctx, [best]), (None, ctx, [(best + 1) % 256])],
                                                         disable_tqdm=True)
    assert g_best and not g_other


def test_context_longer_than_max_length_is_cut_on_the_left(model):
    lm = HybridEvalLM(pretrained=model, max_length=8)
    ctx, cont = "0123456789abcdef", "gh"
    (got, _), = lm.loglikelihood(requests_for([(ctx, cont)]), disable_tqdm=True)
    ids = lm.tok_encode(ctx + cont)[-9:]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0], dim=-1)
    assert got == pytest.approx(float(logp[-2, ids[-2]] + logp[-1, ids[-1]]), abs=1e-4)


def test_loglikelihood_rolling(model):
    lm = HybridEvalLM(pretrained=model, max_length=64)
    text = "hello rolling world"
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    ids = [lm.prefix_token_id, *lm.tok_encode(text)]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids]))[0], dim=-1)
    assert got == pytest.approx(float(sum(logp[i, ids[i + 1]] for i in range(len(ids) - 1))), abs=1e-3)
    # a text longer than max_length is scored in windows: every token once, so the total stays close
    short = HybridEvalLM(pretrained=model, max_length=8)
    (windowed,) = short.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    assert windowed < 0 and abs(windowed - got) < 0.5 * abs(got)


def test_bad_model_args_are_clear():
    with pytest.raises(ValueError, match="exactly one of pretrained"):
        HybridEvalLM()
    with pytest.raises(ValueError, match="batch_size=auto"):
        HybridEvalLM(recipe="llama-tiny", batch_size="auto")
    with pytest.raises(KeyError, match="unknown recipe"):
        HybridEvalLM(recipe="nope-tiny")


def test_generate_until_stops_at_stop_strings(model):
    lm = HybridEvalLM(pretrained=model, max_gen_toks=24)
    prompts = ["Once upon a time", "The answer is"]

    def gen(until, max_gen_toks=24):
        reqs = [Instance("generate_until", {}, (p, {"until": until, "max_gen_toks": max_gen_toks}), i)
                for i, p in enumerate(prompts)]
        return lm.generate_until(reqs, disable_tqdm=True)

    free = gen([])
    # greedy output equals the model's own argmax continuation, token by token (up to EOS)
    ids = lm.tok_encode(prompts[0])
    start = len(ids)
    with torch.no_grad():
        for _ in range(24):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            if ids[-1] == lm.eot_token_id:
                ids.pop()
                break
    assert free[0] == lm.tok_decode(ids[start:])
    assert gen([], max_gen_toks=5)[0] == lm.tok_decode(ids[start:start + 5])
    for i, text in enumerate(free):
        assert len(text) >= 6, "the random model should produce a few characters"
        stop = text[3:5]
        got = gen([stop, "never-appears"])[i]
        assert stop not in got and got == text.split(stop)[0]


def test_registered_with_lm_eval_and_built_from_model_args():
    from lm_eval.api.registry import get_model

    assert get_model("hybrid") is HybridEvalLM
    lm = HybridEvalLM.create_from_arg_string("recipe=llama-tiny,batch_size=2,max_length=64", {"device": "cpu"})
    assert lm.batch_size == 2 and lm.max_length == 64 and lm.model.config.pattern == recipes.get("llama-tiny").pattern
