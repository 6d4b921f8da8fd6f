"""benchmarks/llamacpp.py without llama.cpp: llama-bench's JSON read back, the rows / ratios / goal verdicts,
the table, the JSON + PNG report, the turn-taking, and the clear stops when llama.cpp is not there."""

import json

import pytest

from benchmarks import llamacpp as lb

# what `llama-bench -m model.gguf -p 2048 -n 0,16 -t 2 -r 2 -o json` prints (fields trimmed; values as it writes)
CANNED = json.dumps([
    {"build_commit": "unknown", "cpu_info": "AMD EPYC", "model_type": "mamba2 ?B all F32", "n_batch": 2048,
     "n_ubatch": 512, "n_threads": 2, "type_k": "f16", "type_v": "f16", "flash_attn": -1, "repack": True,
     "n_prompt": 2048, "n_gen": 0, "n_depth": 0, "avg_ns": 750000000, "samples_ns": [800000000, 700000000],
     "samples_ts": [2560.0, 2925.71]},
    {"build_commit": "unknown", "cpu_info": "AMD EPYC", "model_type": "mamba2 ?B all F32", "n_batch": 2048,
     "n_ubatch": 512, "n_threads": 2, "type_k": "f16", "type_v": "f16", "flash_attn": -1, "repack": True,
     "n_prompt": 0, "n_gen": 16, "n_depth": 0, "avg_ns": 90000000, "samples_ns": [90000000, 90000000],
     "samples_ts": [177.8, 177.8]},
])


def test_parse_keeps_prompt_tests_in_seconds_and_drops_decode():
    assert lb.parse_llama_bench(CANNED) == {2048: [0.8, 0.7]}
    assert lb.llama_bench_settings(CANNED)["n_ubatch"] == 512


@pytest.mark.parametrize("text, match", [("main: error loading model", "did not print JSON"),
                                         (json.dumps([json.loads(CANNED)[1]]), "no prompt-processing test")])
def test_parse_rejects_what_is_not_a_prompt_benchmark(text, match):
    with pytest.raises(ValueError, match=match):
        lb.parse_llama_bench(text)


def test_rows_ratios_and_goal():
    theirs = lb.parse_llama_bench(CANNED)[2048]
    secs = {"forward": [1.0, 0.5, 2.0], "engine": [1.024, 1.024, 1.024], "llama.cpp": theirs}
    row = lb.comparison_row("mamba2", 2048, secs)
    assert row["forward"] == {"min": 1024.0, "median": 2048.0, "max": 4096.0, "runs": 3}
    assert row["llama.cpp"]["median"] == round((2048 / 0.8 + 2048 / 0.7) / 2, 1)  # median of two rates: their mean
    assert row["forward_ratio"] == round(2048.0 / row["llama.cpp"]["median"], 3)
    assert row["engine_ratio"] == round(2000.0 / row["llama.cpp"]["median"], 3) < 1
    assert row["goal"] == ">= 1x" and row["met"] is False  # the engine is below llama.cpp: not met
    faster = lb.comparison_row("bamba", 2048, {"forward": [0.5], "engine": [0.6], "llama.cpp": [0.7]})
    assert faster["met"] is True
    llama = lb.comparison_row("llama", 2048, {"forward": [0.9], "llama.cpp": [0.7]})  # no goal stated for it
    assert llama["goal"] is None and llama["met"] is None and "engine" not in llama and "engine_ratio" not in llama
    table = lb.markdown([row, llama])
    assert "| mamba2 | 2048 | 2048 (1024-4096) | 2000 (2000-2000) | 2743 (2560-2926) | 0.75x | 0.73x | **not met** |" \
        in table
    assert "| llama | 2048 | 2276 (2276-2276) | — | 2926 (2926-2926) | 0.78x | — | — |" in table


def test_report_writes_json_and_png(tmp_path):
    rows = [lb.comparison_row("mamba2", L, {"forward": [L / 2000], "engine": [L / 2100], "llama.cpp": [L / 2500]})
            for L in (2048, 8192)]
    js, png = lb.write_report(rows, {"threads": 2}, tmp_path / "out")
    back = json.loads(js.read_text())
    assert back["settings"] == {"threads": 2} and back["rows"] == rows
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_turns_interleave_after_warmup():
    calls = []

    def fn(name):
        return lambda: calls.append(name) or 0.1

    times = lb.take_turns({"a": fn("a"), "b": fn("b")}, {"a": 1}, repeats=2, progress=False)
    assert calls == ["a", "a", "b", "a", "b"] and times == {"a": [0.1, 0.1], "b": [0.1, 0.1]}


def test_without_a_tree_it_skips_with_a_message(monkeypatch, capsys):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    assert lb.main([]) == 0
    assert "skipped: no llama.cpp tree given: pass --llama-cpp DIR" in capsys.readouterr().err


def test_a_folder_that_is_not_llama_cpp_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="is not a llama.cpp source tree"):
        lb.main(["--llama-cpp", str(tmp_path)])


def test_a_tree_without_llama_bench_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_BENCH", raising=False)
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    with pytest.raises(SystemExit, match="no llama-bench executable .* -DLLAMA_BUILD_TOOLS=ON"):
        lb.main(["--llama-cpp", str(tmp_path)])
