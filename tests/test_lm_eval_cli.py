"""``lm_eval --model hybrid`` for an installed user: lm-eval has no plugin entry points, so the package's
``hybrid-lm-eval`` command is lm-eval's own CLI after the import that registers the model (and with this
package's tasks on the include path); lm-eval's default device ``cuda:0`` falls back to the CPU with a warning."""

import logging
import sys
from pathlib import Path

import pytest
import torch
from hybrid.eval.lm_eval_model import resolve_device
from test_eval_mmlu_local import ROWS, write_csv


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback is for machines without CUDA")
def test_cuda_default_falls_back_to_cpu_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert resolve_device("cuda:0") == torch.device("cpu")
    assert "running on the CPU" in caplog.text
    assert resolve_device(None) == torch.device("cpu") and resolve_device("cpu") == torch.device("cpu")


def test_hybrid_lm_eval_runs_lm_evals_cli_with_the_hybrid_model(tmp_path, monkeypatch, capsys, caplog):
    from hybrid.eval.lm_eval_run import lm_eval_main

    write_csv(tmp_path, "anatomy", ROWS)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # lm_eval_main sets it for lm-eval's parser
    lm_eval_main(["--model", "hybrid", "--model_args", "recipe=llama-tiny", "--batch_size", "2", "--tasks",
                  "mmlu_local_anatomy", "--limit", "2", "--metadata", f'{{"mmlu_dir": "{tmp_path}"}}'])
    out = capsys.readouterr().out
    assert "hybrid ({'recipe': 'llama-tiny'})" in out and "|anatomy|" in out and "|acc   |" in out, out[-2000:]
    if not torch.cuda.is_available():  # lm-eval's default device cuda:0
        assert "running on the CPU" in caplog.text


@pytest.fixture
def lm_evals_own_tasks_are_arc_only(monkeypatch):
    """lm-eval's own task folder indexed as if it held only its ARC configs. The ~15k real ones take 15-50 s to
    index (and list) on 2 cores; what these tests check (ours beside lm-eval's, lm-eval's indexed only when asked
    for) needs one family of them. Every other folder (ours, a user's) is indexed as it is."""
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    own = Path(lm_eval.tasks.__file__).resolve().parent
    real = TaskIndex._iter_yaml_files

    def arc_only(root):
        return real(own / "arc" if Path(root).resolve() == own else root)

    monkeypatch.setattr(TaskIndex, "_iter_yaml_files", staticmethod(arc_only))


def test_the_task_manager_indexes_lm_evals_own_tasks_only_when_one_is_asked_for(tmp_path,
                                                                                  lm_evals_own_tasks_are_arc_only):
    """Only our tasks asked for: lm-eval's ~15k configs are not indexed (tens of seconds) and the tasks load; any
    other name (lm-eval's task, a glob) or a listing: they are, and lm-eval's task loads beside ours."""
    from hybrid.eval.tasks import task_manager

    write_csv(tmp_path, "anatomy", ROWS)
    tm = task_manager(tmp_path)
    assert "mmlu_local_anatomy" in tm.hybrid_tasks and "arc_easy" not in tm.hybrid_tasks
    assert tm.match_tasks(["mmlu_local_anatomy"]) == ["mmlu_local_anatomy"]
    loaded = tm.load(["mmlu_local_anatomy"])
    assert list(loaded["tasks"]) == ["mmlu_local_anatomy"] and len(loaded["tasks"]["mmlu_local_anatomy"].eval_docs) == 2
    assert tm.task_index["mmlu_local_anatomy"] is not None  # lm-eval reads the loaded tasks' entries after a run
    assert tm._defaults_pending is not None  # still only our folder indexed
    assert tm.match_tasks(["arc_easy", "mmlu_local_anatomy"]) == ["arc_easy", "mmlu_local_anatomy"]
    assert tm._defaults_pending is None and "arc_easy" in tm.all_tasks and "mmlu_local" in tm.all_tasks
    listing, asked = task_manager(tmp_path), []
    listing.index_defaults = lambda: asked.append("indexed")  # (a second real index costs tens of seconds)
    assert isinstance(listing.all_tasks, list) and asked == ["indexed"]  # a listing is everything
    asked.clear()
    listing.list_all_tasks()
    assert asked
    ours = task_manager(tmp_path, include_defaults=False)
    assert ours.match_tasks(["arc_easy"]) == [] and "arc_easy" not in ours.all_tasks


def test_hybrid_lm_eval_runs_lm_evals_cli_on_a_task_manager_that_indexes_lazily(monkeypatch):
    """lm-eval's CLI builds its own TaskManager: for run, ls and validate it gets ours_first's (indexing lm-eval's
    configs only for a task that is not ours); a user's own --include_path gets lm-eval's; lm-eval's class is back
    after the run."""
    import lm_eval.tasks
    from hybrid.eval import lm_eval_run

    seen = []
    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", lambda: seen.append(lm_eval.tasks.TaskManager))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    base = lm_eval.tasks.TaskManager
    for argv, lazy in ((["--model", "hybrid", "--tasks", "mmlu_local_anatomy,mmlu_local"], True),
                       (["ls", "tasks"], True),
                       (["run", "--tasks", "x", "--include_path", "mine/"], False)):
        lm_eval_run.lm_eval_main(argv)
        cls = seen.pop()
        assert (cls is not base and issubclass(cls, base)) if lazy else cls is base, argv
        assert lm_eval.tasks.TaskManager is base


def test_hybrid_lm_eval_ls_lists_our_tasks_beside_lm_evals(monkeypatch, capsys, lm_evals_own_tasks_are_arc_only):
    """``hybrid-lm-eval ls tasks``: lm-eval's own listing, with ours in it."""
    from hybrid.eval.lm_eval_run import lm_eval_main

    monkeypatch.setattr(sys, "argv", list(sys.argv))
    lm_eval_main(["ls", "tasks"])
    out = capsys.readouterr().out
    assert "mmlu_local_anatomy" in out and "mmlu_local " in out and "arc_easy" in out, out[-2000:]


def test_simple_evaluate_without_our_task_manager_fails_as_lm_eval_fails(lm_evals_own_tasks_are_arc_only):
    """The documented limit (docs/evaluation.md): lm-eval's own TaskManager does not know our tasks, and says so by
    name; ``task_manager=hybrid.eval.tasks.task_manager(...)`` is the way (tests/test_lm_eval_routes.py)."""
    import hybrid.eval.lm_eval_model  # noqa: F401  (registers the model "hybrid")
    import lm_eval

    with pytest.raises(KeyError, match="mmlu_local_anatomy"):
        lm_eval.simple_evaluate(model="hybrid", model_args="recipe=llama-tiny", tasks=["mmlu_local_anatomy"], limit=1)
