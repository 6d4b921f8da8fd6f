"""mmlu_local_cloze: MMLU as continuation (lm-eval's mmlu_continuation prompt) from the local files."""

import pytest
import torch
from hybrid.eval.tasks import TASKS_DIR
from test_eval_mmlu_local import ROWS, write_csv

from hybrid import HybridLM, recipes


@pytest.fixture
def task_manager(tmp_path):
    from lm_eval.tasks import TaskManager

    write_csv(tmp_path, "anatomy", ROWS)
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"mmlu_dir": str(tmp_path)})


def test_cloze_docs_choices_and_targets(task_manager):
    tm = task_manager
    assert {"mmlu_local_cloze", "mmlu_local_cloze_stem", "mmlu_local_cloze_humanities"} <= set(tm.all_groups)
    assert sum(t.startswith("mmlu_local_cloze_") for t in tm.all_subtasks) == 57
    task = tm.load(["mmlu_local_cloze_anatomy"])["tasks"]["mmlu_local_cloze_anatomy"]
    docs = list(task.test_docs())
    assert task.fewshot_context(docs[0], num_fewshot=0) == (
        "The following are questions (with answers) about anatomy.\n\nQuestion: What is 1 + 1?\nAnswer:")
    assert task.doc_to_choice(docs[0]) == ["1", "2", "3", "None"] and task.doc_to_target(docs[0]) == 1
    assert task.doc_to_choice(docs[1]) == ["None", "yes, really", "no", "maybe"] and task.doc_to_target(docs[1]) == 0
    task.build_all_requests(limit=None, rank=0, world_size=1)
    first = [r for r in task.instances if r.doc_id == 0]
    # one loglikelihood request per choice, the choice's own text after a space
    assert [r.args[1] for r in first] == [" 1", " 2", " 3", " None"]
    assert {m["metric"] for m in task.config.metric_list} == {"acc", "acc_norm"}


def test_cloze_scores_acc_and_acc_norm_through_the_hybrid_model(task_manager, tmp_path):
    from hybrid.eval.lm_eval_run import run

    torch.manual_seed(0)
    model = HybridLM(recipes.get("llama-tiny")).eval()
    results = run(model, tasks=["mmlu_local_cloze_anatomy"], num_fewshot=0, mmlu_dir=str(tmp_path), batch_size=4)
    entry = results["results"]["mmlu_local_cloze_anatomy"]
    assert 0.0 <= entry["acc,none"] <= 1.0 and 0.0 <= entry["acc_norm,none"] <= 1.0
    assert results["n-samples"]["mmlu_local_cloze_anatomy"]["effective"] == 2
