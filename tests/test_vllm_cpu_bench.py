"""benchmarks/vllm_cpu.py without vLLM: a stand-in interpreter records the command benchmarks.decode
--vllm-python runs and answers as run_vllm.py does; the export it hands vLLM, the rate it reads back, the cache
of exports, and its refusals."""

import json
import stat

import pytest
import torch

from benchmarks import vllm_cpu as v
from hybrid import recipes
from hybrid.model import HybridLM

FAKE = """#!/bin/sh
# a stand-in for a vLLM venv's python: `-c "import vllm"` succeeds (or fails when FAIL is set), and
# `run_vllm.py bench EXPORT OUT ...` writes run_vllm.py's result JSON to OUT and records its arguments
if [ "$1" = "-c" ]; then
  [ -z "$FAIL" ] || { echo "ModuleNotFoundError: No module named 'vllm'" >&2; exit 1; }
  exit 0
fi
echo "$@" >> "$(dirname "$0")/calls.txt"
echo "$VLLM_CPU_OMP_THREADS_BIND" >> "$(dirname "$0")/bind.txt"
echo '{"prefill_tok_s": [5.0], "decode_tok_s": [30.0, 10.0, 20.0]}' > "$4"
"""


@pytest.fixture
def fake_python(tmp_path):
    py = tmp_path / "venv" / "python"
    py.parent.mkdir()
    py.write_text(FAKE)
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    return py


def _model(name):
    torch.manual_seed(0)
    return HybridLM(recipes.get(name)).eval()


def test_decode_rate_from_the_runner(tmp_path, fake_python):
    v.check_python(str(fake_python))
    row = v.vllm_decode("hybrid-1to7-tiny", _model("hybrid-1to7-tiny"), str(fake_python), tmp_path / "work",
                        batch=32, prompt=16, new_tokens=64, dtype="float32")
    assert (row["tok/s"], row["min"], row["max"], row["format"]) == (20.0, 10.0, 30.0, "granitemoehybrid")
    export = tmp_path / "work" / "hybrid-1to7-tiny" / "export-granitemoehybrid"
    assert json.loads((export / "config.json").read_text())["model_type"] == "granitemoehybrid"
    args = (fake_python.parent / "calls.txt").read_text().split()
    assert args[0].endswith("scripts/serving/run_vllm.py") and args[1:3] == ["bench", str(export)]
    assert args[args.index("--decode") + 1] == "32x64" and args[args.index("--decode-prompt") + 1] == "16"
    assert args[args.index("--dtype") + 1] == "float32"
    assert (fake_python.parent / "bind.txt").read_text().split() == ["0-1"]  # two cores, as ours
    mtime = (export / "config.json").stat().st_mtime_ns
    v.vllm_decode("hybrid-1to7-tiny", _model("hybrid-1to7-tiny"), str(fake_python), tmp_path / "work",
                  batch=8, prompt=16, new_tokens=64, dtype="bfloat16")
    assert (export / "config.json").stat().st_mtime_ns == mtime  # the export is made once


def test_formats_per_family():
    assert v.vllm_format("llama-small") == "llama" and v.vllm_format("mamba2-d512") == "mamba2"
    with pytest.raises(SystemExit, match="no vLLM format known for recipe 'mamba1-tiny'"):
        v.vllm_format("mamba1-tiny")


def test_refusals(tmp_path, fake_python, monkeypatch):
    with pytest.raises(SystemExit, match="no such executable.*check_serving.sh"):
        v.check_python(str(tmp_path / "nowhere" / "python"))
    monkeypatch.setenv("FAIL", "1")
    with pytest.raises(SystemExit, match="`import vllm` fails there .*No module named 'vllm'"):
        v.check_python(str(fake_python))


def test_a_failed_run_says_where_its_log_is(tmp_path):
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\necho 'RuntimeError: no CPU backend' >&2\nexit 3\n")
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(RuntimeError, match=r"(?s)vLLM failed: .*\(log .*\.log\):.*no CPU backend"):
        v.vllm_decode("llama-tiny", _model("llama-tiny"), str(py), tmp_path, batch=4, prompt=16, new_tokens=8,
                      dtype="float32")


def test_ours_timed_the_way_vllm_is():
    with torch.inference_mode():
        row = v.ours_same_way(_model("llama-tiny"), batch=3, prompt=5, new_tokens=4, repeats=2)
    assert 0 < row["min"] <= row["tok/s"] <= row["max"]
