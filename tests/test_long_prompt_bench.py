"""benchmarks/prefill.py (long prompts): one prompt per fresh process through the engine in chunks, with its
peak memory set beside the cache the specs say it needs."""

import json

import pytest

from benchmarks import prefill as long_prompt_bench


def test_one_prompt_in_a_child_process(tmp_path, capsys):
    assert long_prompt_bench.main(["--recipe", "hybrid-1to7-tiny", "--lengths", "300", "--chunk", "128",
                                   "--threads", "1", "--output", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "long_prompts.json").read_text())
    assert row["recipe"] == "hybrid-1to7-tiny" and row["seq_len"] == 300 and row["path"] == "engine, chunks of 128"
    assert row["tokens_per_s"] > 0 and row["peak_rss_MB"] >= row["baseline_MB"] > row["weights_MB"]
    assert row["cache_MB"] > 0
    assert (tmp_path / "long_prompts.png").stat().st_size > 0
    assert "hybrid-1to7-tiny" in capsys.readouterr().out


def test_unknown_recipe_fails_before_any_process():
    with pytest.raises(KeyError):
        long_prompt_bench.main(["--recipe", "no-such-recipe", "--lengths", "64"])
