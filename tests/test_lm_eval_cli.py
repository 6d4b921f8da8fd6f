"""``lm_eval --model hybrid`` for an installed user: lm-eval has no plugin entry points, so the package's
``hybrid-lm-eval`` command is lm-eval's own CLI after the import that registers the model (and with this
package's tasks on the include path); lm-eval's default device ``cuda:0`` falls back to the CPU with a warning."""

import logging
import sys

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


def test_hybrid_lm_eval_indexes_lm_evals_own_tasks_only_when_one_is_asked_for(tmp_path, monkeypatch):
    """Only our tasks asked for: lm-eval's ~15k configs are not indexed (tens of seconds); any other task, a config
    file or `ls`: they are. The class lm-eval's CLI builds is lm-eval's own again after the run."""
    import lm_eval.tasks
    from hybrid.eval import lm_eval_run

    assert lm_eval_run._requested_tasks(["run", "--tasks", "a", "b,c", "--limit", "2", "-t", "d", "--tasks=e,f"]) \
        == ["a", "b", "c", "d", "e", "f"]
    assert lm_eval_run._requested_tasks(["run", "--config", "x.yaml"]) is None
    seen = []

    def fake_cli():
        seen.append((lm_eval.tasks.TaskManager, lm_eval.tasks.TaskManager.__init__.__kwdefaults__))

    monkeypatch.setattr("lm_eval.__main__.cli_evaluate", fake_cli)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    base = lm_eval.tasks.TaskManager
    for argv, skips in ((["--model", "hybrid", "--tasks", "mmlu_local_anatomy,mmlu_local"], True),
                        (["run", "--tasks", "mmlu_local_cloze_anatomy"], True),
                        (["--tasks", "mmlu_local_anatomy", "arc_easy"], False),
                        (["--config", "c.yaml", "--tasks", "mmlu_local"], False),
                        (["ls", "tasks"], False)):
        lm_eval_run.lm_eval_main(argv)
        cls, defaults = seen.pop()
        assert (cls is not base and defaults == {"include_defaults": False}) if skips else cls is base, argv
        assert lm_eval.tasks.TaskManager is base
