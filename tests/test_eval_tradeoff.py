"""`hybrid tradeoff` end to end at micro size (MQAR and MMLU paths), `hybrid bench` writing its rows
with their spread, and the timing/claim helpers the report is built from."""

import csv
import json

import pytest
import torch
from hybrid.eval import timing as prefill_bench
from hybrid.eval.tasks import TASKS_DIR
from hybrid.eval.tradeoff_report import crossing

import hybrid
from hybrid import HybridLM, recipes
from hybrid.cache import sequences_that_fit
from hybrid.cli import main


@pytest.fixture(autouse=True)
def quick_peak_probe(monkeypatch):
    """The real probe times several large matmuls for seconds; these tests check the plumbing around it
    (tests/test_matmul_peak.py checks the probe itself), so it times one small shape without a warm-up."""
    monkeypatch.setattr(prefill_bench, "CPU_PEAK_SHAPES", ((256, 256, 256),))
    monkeypatch.setattr(prefill_bench, "PEAK_WARMUP_S", 0.0)


def test_tradeoff_micro_writes_json_csv_markdown_png(tmp_path, capsys):
    out = tmp_path / "report"
    main(["tradeoff", "--shares", "0", "0.5", "1", "--n-blocks", "2", "--seeds", "0", "1", "--steps", "2",
          "--train-batch", "4", "--train-kv-pairs", "2", "4", "--kv-pairs", "2", "4", "--eval-sequences", "4",
          "--speed-size", "tiny", "--lengths", "16", "32", "--long-lengths", "64", "--long-shares", "0", "1",
          "--chunk", "16", "--repeats", "2", "--warmup", "0", "--threads", "1", "--output", str(out)])
    printed = capsys.readouterr().out
    report = json.loads((out / "tradeoff.json").read_text())
    members, settings = report["members"], report["settings"]
    assert [m["model"] for m in members] == ["attn=0", "attn=1/2", "attn=1"]
    assert settings["threads"] == 1 and settings["dtype"] == "float32" and settings["source"] == "mqar"
    assert settings["wall_s"] > 0 and settings["date"][:2] == "20" and settings["machine"]["cores"] >= 1
    for m in members:
        assert len(m["seeds"]) == 2 and m["accuracy_min"] <= m["accuracy"] <= m["accuracy_max"]
        assert set(m["per_kv"]) == {"2", "4"} or set(m["per_kv"]) == {2, 4}
        lengths = [r["seq_len"] for r in m["prefill"]]
        # 64 tokens only for the members named in --long-shares, with one run there
        assert lengths == ([16, 32, 64] if m["model"] != "attn=1/2" else [16, 32])
        for r in m["prefill"]:
            assert r["prefill_min_ms"] <= r["prefill_ms"] <= r["prefill_max_ms"]
            assert r["runs"] == (1 if r["seq_len"] == 64 else 2) and r["chunk"] == 16
        speed = HybridLM(recipes.attention_family("tiny", m["attn_share"], 2))
        for r in m["memory"]:  # the cache specs and the cache's own count, nothing re-derived
            assert r["cache_bytes"] == speed.cache_spec().bytes_per_sequence(r["seq_len"], block_size=16)
            assert r["seqs_in_budget"] == sequences_that_fit(speed.config, 4 * 2**30, r["seq_len"],
                                                             kv_dtype=torch.float32, conv_dtype=torch.float32)
    with open(out / "tradeoff.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["model"] for r in rows] == ["attn=0", "attn=1/2", "attn=1"]
    for col in ("mqar_acc", "mqar_acc_seed_min", "mqar_acc_seed_max", "mqar_acc@4kv", "prefill_ms@32",
                "prefill_min_ms@32", "prefill_max_ms@32", "spread@32", "wide@32", "prefill_cut@32",
                "cache_bytes@64", "seqs_in_budget@64", "memory_cut@64"):
        assert col in rows[0], col
    assert rows[1]["prefill_ms@64"] == "" and float(rows[0]["prefill_cut@64"]) < 1
    md = (out / "tradeoff.md").read_text()
    assert "| attn=1/2" in md and "1 threads" in md and "The seed's claim, tested" in md
    assert "Pure Mamba-2 (`attn=0`)" in md and "Pure Mamba-2 (`attn=0`)" in printed
    assert report["claim"][0].startswith("Claim:")
    assert (out / "tradeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("mixer,sym,name", [("gdn", "G", "Gated DeltaNet"), ("gla", "L", "GLA")])
def test_tradeoff_mixer_builds_the_family_with_that_mixer(tmp_path, mixer, sym, name):
    """--mixer gdn / gla: the same report, the constant-state mixers of both the MQAR and the timed models are
    G / L, and the report names the pure member by the mixer's name."""
    out = tmp_path / mixer
    main(["tradeoff", "--mixer", mixer, "--shares", "0", "0.5", "--n-blocks", "2", "--seeds", "0", "--steps", "2",
          "--train-batch", "4", "--train-kv-pairs", "2", "--kv-pairs", "2", "--eval-sequences", "4",
          "--speed-size", "tiny", "--lengths", "16", "--long-lengths", "--long-shares", "--chunk", "16",
          "--repeats", "1", "--warmup", "0", "--threads", "1", "--output", str(out)])
    report = json.loads((out / "tradeoff.json").read_text())
    assert report["settings"]["mixer"] == mixer
    assert [(m["acc_pattern"], m["speed_model"]["pattern"]) for m in report["members"]] == [
        (sym * 2, f"{sym}-{sym}-"), (sym + "*", f"{sym}-*-")]
    assert f"Pure {name} (`attn=0`)" in (out / "tradeoff.md").read_text()


def test_tradeoff_rejects_long_shares_outside_the_family(tmp_path):
    with pytest.raises(SystemExit, match="long_shares"):
        main(["tradeoff", "--shares", "0", "1", "--long-shares", "0.5", "--steps", "1", "--output", str(tmp_path)])


def test_bench_writes_json_and_csv_with_spread(tmp_path, capsys):
    main(["bench", "--recipe", "llama-tiny", "mamba2-tiny", "--lengths", "16", "32", "--repeats", "2",
          "--warmup", "0", "--threads", "1", "--output", str(tmp_path / "bench.json")])
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["matmul_peak_GFLOP/s"] > 0 and report["threads"] == 1
    assert report["matmul_peak_shape"] == [256, 256, 256]  # the probe's only shape here, recorded with the rate
    assert [(r["model"], r["seq_len"]) for r in report["rows"]] == [
        ("llama-tiny", 16), ("llama-tiny", 32), ("mamba2-tiny", 16), ("mamba2-tiny", 32)]
    for r in report["rows"]:
        assert r["prefill_min_ms"] <= r["prefill_ms"] <= r["prefill_max_ms"] and r["runs"] == 2
        assert 0 < r["of_peak"] and r["cache_MB/seq"] > 0 and r["spread"] >= 0
    main(["bench", "--recipe", "llama-tiny", "--lengths", "16", "--repeats", "1", "--no-peak", "--decode-tokens", "3",
          "--decode-ctx", "8", "--output", str(tmp_path / "bench.csv")])
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["model"] == "llama-tiny" and "of_peak" not in rows[0]
    assert rows[1]["decode_ctx"] == "8" and float(rows[1]["decode_tok/s"]) > 0
    printed = capsys.readouterr().out
    assert "prefill_min_ms" in printed and "threads" in printed


def test_wide_timing_is_measured_again_and_flagged():
    calls = []
    slow_first = iter([0.001, 0.050, 0.001, 0.001, 0.001, 0.001])  # first attempt wide, second steady

    def fn():
        calls.append(1)
        import time
        time.sleep(next(slow_first))

    t = prefill_bench.measure(fn, torch.device("cpu"), warmup=0, repeats=3, max_spread=0.25)
    assert len(calls) == 6 and t.attempts == 2 and len(t.seconds) == 3
    assert t.wide == (t.spread > 0.25)  # the second attempt decides; sleep jitter may still widen it

    def always_wide():
        import time
        time.sleep(0.05 if len(calls) % 2 else 0.001)
        calls.append(1)

    calls.clear()
    t = prefill_bench.measure(always_wide, torch.device("cpu"), warmup=0, repeats=2, max_spread=0.25)
    assert t.attempts == 2 and t.wide and t.row()["wide"] is True


def test_crossing_interpolates_in_log_length():
    assert crossing({2048: 0.5, 8192: 0.7, 32768: 0.9}) == (32768, pytest.approx(2 ** 14))
    assert crossing({2048: 0.85}) == (2048, None)
    assert crossing({2048: 0.1, 8192: 0.3}) == (None, None)


def _write_mmlu(root, questions=2):
    subjects = sorted(p.stem.removeprefix("mmlu_local_") for p in TASKS_DIR.glob("mmlu_local_*.yaml")
                      if not p.stem.startswith("mmlu_local_cloze_"))
    assert len(subjects) == 57
    for split in ("dev", "test"):
        (root / split).mkdir(parents=True)
        for s in subjects:
            lines = ["question,choice0,choice1,choice2,choice3,answer"]
            lines += [f"{s} question {i}?,alpha,beta,gamma,None,{i % 4}" for i in range(questions)]
            (root / split / f"{s}_{split}.csv").write_text("\n".join(lines) + "\n")
    return subjects


def test_tradeoff_scores_checkpoints_on_all_of_mmlu_local(tmp_path, capsys):
    mmlu = tmp_path / "mmlu"
    subjects = _write_mmlu(mmlu)
    paths = []
    for name in ("llama-tiny", "mamba2-tiny"):
        torch.manual_seed(0)
        hybrid.save_pretrained(HybridLM(recipes.get(name)), tmp_path / name)
        paths.append(str(tmp_path / name))
    out = tmp_path / "report"
    main(["tradeoff", "--checkpoints", *paths, "--tasks", "mmlu_local", "--num-fewshot", "1", "--limit", "1",
          "--mmlu-dir", str(mmlu), "--lengths", "16", "--long-lengths", "32", "--repeats", "2", "--warmup", "0",
          "--chunk", "16", "--threads", "1", "--output", str(out)])
    printed = capsys.readouterr().out
    report = json.loads((out / "tradeoff.json").read_text())
    assert report["settings"]["source"] == "lm-eval" and report["settings"]["limit"] == 1
    members = report["members"]
    assert [m["model"] for m in members] == paths
    groups = {"mmlu_local_humanities", "mmlu_local_other", "mmlu_local_social_sciences", "mmlu_local_stem"}
    for m in members:
        assert set(m["groups"]) == groups | {"mmlu_local"} and m["questions"] == 57  # --limit 1 per subject
        assert {f"mmlu_local_{s}" for s in subjects} | groups | {"mmlu_local"} == set(m["per_task"])
        assert 0 <= m["accuracy"] <= 1 and m["stderr"] is not None
        assert [r["seq_len"] for r in m["prefill"]] == [16, 32]  # checkpoints: every length, each timed
        assert all(r["prefill_ms"] > 0 for r in m["prefill"])
    with open(out / "tradeoff.csv") as f:
        row = next(csv.DictReader(f))
    assert {"acc", "acc_stderr", "mmlu_local", "mmlu_local_stem", "mmlu_local_anatomy", "prefill_ms@32",
            "cache_bytes@32", "seqs_in_budget@32"} <= set(row)
    md = (out / "tradeoff.md").read_text()
    assert "| mmlu_local_world_religions" in md and "humanities" in md and "humanities" in printed
    assert "accuracy points" in md
    assert len(list((out / "lm_eval").glob("results_*.json"))) == 2 and (out / "tradeoff.png").is_file()


def test_memory_columns_take_the_cache_dtypes(tmp_path):
    """``--kv-dtype`` / ``--state-dtype`` (issue 15): the memory columns count the compressed cache exactly as
    the engine would allocate it (specs with scales = ``sequences_that_fit``), and a bad name fails before
    any training."""
    from hybrid.eval.tradeoff import memory_rows

    model = HybridLM(recipes.attention_family("tiny", 0.25, 4))
    plain = memory_rows(model, [64, 1024], 2**30)
    packed = memory_rows(model, [64, 1024], 2**30, kv_dtype="int8", state_dtype="int8")
    # state_dtype int8 keeps the conv state in the model's dtype (hybrid.cache.cache_dtypes)
    conv = next(model.parameters()).dtype
    spec = model.cache_spec(kv_dtype=torch.int8, conv_dtype=conv, ssm_dtype=torch.int8)
    for p, q in zip(plain, packed, strict=True):
        assert q["cache_bytes"] == spec.bytes_per_sequence(q["seq_len"], block_size=16) < p["cache_bytes"]
        assert q["seqs_in_budget"] == sequences_that_fit(model.config, 2**30, q["seq_len"], kv_dtype="int8",
                                                         conv_dtype=conv, ssm_dtype="int8") > p["seqs_in_budget"]
    with pytest.raises(SystemExit, match="kv_dtype"):
        main(["tradeoff", "--kv-dtype", "int4", "--steps", "1", "--output", str(tmp_path)])
