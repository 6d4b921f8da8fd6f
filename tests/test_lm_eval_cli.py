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
