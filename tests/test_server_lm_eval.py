"""lm-eval's own ``local-completions`` model (its client, not ours) scores a local multiple-choice task
against ``hybrid serve``; its log-likelihoods equal those of our ``hybrid`` lm-eval model on the
same checkpoint."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hybrid.eval.lm_eval_run import run
from hybrid.eval.tasks import TASKS_DIR
from server_helpers import idle_and_empty, running_server

import hybrid
from hybrid import recipes

QUESTIONS = [
    ["What is the largest bone?", "Femur", "Stapes", "None", "Ulna", "0"],
    ["Which organ pumps blood?", "Liver", "Heart", "Lung", "Kidney", "1"],
    ["How many chambers has the human heart?", "Two", "Three", "Four", "Five", "2"],
    ["Where is the tibia?", "Arm", "Skull", "Chest", "Leg", "3"],
]
TASK = "mmlu_local_anatomy"


@pytest.fixture
def mmlu_dir(tmp_path):
    for split, rows in (("dev", QUESTIONS[:2]), ("test", QUESTIONS)):
        (tmp_path / "mmlu" / split).mkdir(parents=True)
        lines = ["question,choice0,choice1,choice2,choice3,answer", *(",".join(r) for r in rows)]
        (tmp_path / "mmlu" / split / f"anatomy_{split}.csv").write_text("\n".join(lines) + "\n")
    return tmp_path / "mmlu"


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    # Mamba-2 and attention blocks; byte tokenizer ids 0..255 plus its specials (bos 256, eos 257, pad 258)
    model = hybrid.HybridLM(dataclasses.replace(recipes.attention_family("tiny", 0.5, 2), vocab_size=259))
    return hybrid.save_pretrained(model, tmp_path / "ckpt")


def scores(results) -> list[list[tuple[float, bool]]]:
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[tuple(r[0]) for r in s["resps"]] for s in samples]


def test_lm_eval_local_completions_equals_the_hybrid_model(checkpoint, mmlu_dir):
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    model = hybrid.from_pretrained(checkpoint)
    with running_server(model, name="ckpt") as (server, _, _):
        manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                              metadata={"mmlu_dir": str(mmlu_dir)})
        # lm-eval's own "local-completions" class (built directly: its registry by name depends on what
        # was imported first). tokenizer_backend=auto finds the server's /tokenizer_info and /tokenize,
        # so lm-eval tokenizes as the server does.
        lm = LocalCompletionsAPI(base_url=f"{server.url}/v1/completions", model="ckpt", batch_size=4,
                                 num_concurrent=1, max_retries=1)
        assert lm.tokenizer_backend == "remote"
        served = lm_eval.simple_evaluate(model=lm, tasks=[TASK], num_fewshot=1, task_manager=manager,
                                         log_samples=True, bootstrap_iters=0)
        assert idle_and_empty(server)
    ours = run(str(checkpoint), tasks=[TASK], num_fewshot=1, mmlu_dir=str(mmlu_dir), batch_size=3, log_samples=True)
    got, want = scores(served), scores(ours)
    assert len(got) == len(QUESTIONS) and all(len(g) == 4 for g in got)
    for g_row, w_row in zip(got, want, strict=True):
        for (g_ll, g_greedy), (w_ll, w_greedy) in zip(g_row, w_row, strict=True):
            assert g_ll == pytest.approx(w_ll, abs=1e-4) and g_greedy == w_greedy
    acc = served["results"][TASK]["acc,none"]
    assert acc == ours["results"][TASK]["acc,none"]
