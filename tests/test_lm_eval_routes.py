"""The three ways a user runs lm-eval on a hybrid model, from the installed wheel (not the source tree), each
finding the ``hybrid`` model and the ``mmlu_local_*`` tasks on a tiny checkpoint and a 2-question MMLU folder:

- Python: ``import hybrid.eval.lm_eval_model`` (registers the model), then ``lm_eval.simple_evaluate(...,
  task_manager=hybrid.eval.tasks.task_manager(MMLU))``: lm-eval 0.4.x's default TaskManager indexes only its
  own folder and reads no plugin entry points, so its own ``task_manager=`` argument is how our tasks get in;
- ``hybrid-lm-eval``: lm-eval's own command line, every flag passed through (``run``, ``ls``);
- ``hybrid eval``.
(``hybrid-lm-eval ls`` and the plain call without ``task_manager=``, which fails as lm-eval fails, run in-process
in tests/test_lm_eval_cli.py, on lm-eval's ARC configs alone: a listing of all its ~15k takes ~50 s on 2 cores.)"""

import json

import pytest
from test_eval_mmlu_local import ROWS, write_csv
from test_wheel import run  # the `installed` fixture (conftest.py): the wheel in a fresh venv, outside the repository

pytest.importorskip("lm_eval")

SIMPLE_EVALUATE = """
import json, sys
import lm_eval
import hybrid.eval.lm_eval_model  # registers the lm-eval model "hybrid"
from hybrid.eval.tasks import task_manager
assert "site-packages" in hybrid.eval.lm_eval_model.__file__, hybrid.eval.lm_eval_model.__file__
ckpt, mmlu = sys.argv[1:3]
results = lm_eval.simple_evaluate(model="hybrid", model_args=f"pretrained={ckpt},batch_size=2",
                                  tasks=["mmlu_local_anatomy"], limit=2, num_fewshot=1,
                                  task_manager=task_manager(mmlu))
print(json.dumps({"acc": results["results"]["mmlu_local_anatomy"]["acc,none"], "n_shot": results["n-shot"],
                  "n": results["n-samples"]["mmlu_local_anatomy"]["effective"],
                  "model": results["config"]["model"]}))
"""


@pytest.fixture(scope="module")
def tiny(installed, tmp_path_factory):
    """A tiny checkpoint folder and a 2-question MMLU folder (one subject, anatomy)."""
    env_dir, env, outside = installed
    root = tmp_path_factory.mktemp("routes")
    write_csv(root / "mmlu", "anatomy", ROWS)
    out = run([str(env_dir / "bin" / "python"), "-c", "import sys, hybrid; hybrid.save_pretrained(hybrid.HybridLM("
               "hybrid.recipes.get('llama-tiny')), sys.argv[1])", str(root / "ckpt")], env, outside)
    assert out.returncode == 0, out.stderr[-2000:]
    return root / "ckpt", root / "mmlu"


def test_simple_evaluate_with_the_packages_task_manager(installed, tiny):
    env_dir, env, outside = installed
    ckpt, mmlu = tiny
    out = run([str(env_dir / "bin" / "python"), "-c", SIMPLE_EVALUATE, str(ckpt), str(mmlu)], env, outside)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    got = json.loads(next(line for line in lines if line.startswith("{")))
    assert got["model"] == "hybrid" and got["n"] == 2 and got["n_shot"] == {"mmlu_local_anatomy": 1}
    assert 0.0 <= got["acc"] <= 1.0


def test_hybrid_lm_eval_is_lm_evals_cli_with_our_model_and_tasks(installed, tiny):
    env_dir, env, outside = installed
    ckpt, mmlu = tiny
    cli = str(env_dir / "bin" / "hybrid-lm-eval")
    out = run([cli, "--model", "hybrid", "--model_args", f"pretrained={ckpt}", "--device", "cpu", "--batch_size",
               "2", "--tasks", "mmlu_local_anatomy", "--limit", "2", "--num_fewshot", "1", "--metadata",
               json.dumps({"mmlu_dir": str(mmlu)}), "--output_path", str(ckpt.parent / "lm_eval_out")], env, outside)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "|anatomy|" in out.stdout and "|acc   |" in out.stdout, out.stdout[-2000:]
    assert list((ckpt.parent / "lm_eval_out").rglob("results_*.json")), "--output_path was not passed through"


def test_hybrid_eval(installed, tiny):
    env_dir, env, outside = installed
    ckpt, mmlu = tiny
    results = ckpt.parent / "eval_out"
    out = run([str(env_dir / "bin" / "hybrid"), "eval", "--model", str(ckpt), "--tasks", "mmlu_local_anatomy",
               "--mmlu-dir", str(mmlu), "--limit", "2", "--batch-size", "2", "--output", str(results)], env, outside)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "|anatomy|" in out.stdout and "wrote" in out.stdout, out.stdout[-2000:]
    written = json.loads(next(results.glob("results_*.json")).read_text())
    assert written["n-shot"] == {"mmlu_local_anatomy": 0}  # the default --help states: the task's own, 0
