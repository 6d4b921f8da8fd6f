"""benchmarks/before_after.py: each tree's own hybrid times its prefill (checked, not assumed), the table has
a row per tree and recipe with its ratio to the first tree, and bad arguments stop with a message."""

import json
import sys
from pathlib import Path

import pytest

from benchmarks import before_after

ROOT = Path(__file__).resolve().parents[1]


def test_this_tree_against_itself(tmp_path, capsys):
    out = tmp_path / "ba.json"
    before_after.main(["--trees", str(ROOT), str(ROOT), "--python", sys.executable, sys.executable,
                       "--recipes", "llama-tiny", "--length", "8", "--repeats", "2", "--rounds", "1", "--threads", "1",
                       "--lock", "", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["tree"]) for r in rows] == [("llama-tiny", str(ROOT))] * 2
    assert rows[0]["med/ref"] == 1.0 and all(r["min"] <= r["tok/s_med"] <= r["max"] for r in rows)
    assert "llama-tiny" in capsys.readouterr().out


def test_a_tree_whose_interpreter_imports_another_hybrid_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="imports hybrid from .*not from the tree"):
        before_after.main(["--trees", str(tmp_path), "--python", sys.executable, "--recipes", "llama-tiny",
                           "--length", "4", "--repeats", "1", "--rounds", "1", "--threads", "1", "--lock", ""])


def test_bad_arguments(tmp_path):
    with pytest.raises(SystemExit, match="no interpreter at"):
        before_after.main(["--trees", str(tmp_path), "--rounds", "1"])
    with pytest.raises(SystemExit, match="names 1 interpreters for 2 trees"):
        before_after.main(["--trees", str(tmp_path), str(tmp_path), "--python", sys.executable])
