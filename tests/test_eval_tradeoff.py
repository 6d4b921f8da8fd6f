"""`hybrid tradeoff` end to end at micro size, and `hybrid bench` writing its rows."""

import csv
import json

import hybrid
from hybrid.cli import main


def test_tradeoff_micro_writes_json_csv_markdown_png(tmp_path):
    out = tmp_path / "report"
    main(["tradeoff", "--shares", "0", "0.5", "1", "--n-blocks", "2", "--steps", "2", "--train-batch", "4",
          "--kv-pairs", "2", "4", "--eval-sequences", "4", "--lengths", "16", "32", "--repeats", "1",
          "--warmup", "0", "--output", str(out)])
    report = json.loads((out / "tradeoff.json").read_text())
    assert [r["model"] for r in report["rows"]] == ["attn=0", "attn=1/2", "attn=1"]
    assert [r["attn_share"] for r in report["rows"]] == [0.0, 0.5, 1.0]
    for row in report["rows"]:
        assert 0.0 <= row["mqar_acc"] <= 1.0 and {"mqar_acc@2kv", "mqar_acc@4kv"} <= set(row)
        assert row["prefill_ms@16"] > 0 and row["prefill_ms@32"] > 0
    assert report["rows"][0]["KV_bytes/token"] == 0 and report["rows"][2]["state_bytes/seq"] == 0
    assert len(report["prefill"]) == 6 and report["settings"]["source"] == "mqar"
    with open(out / "tradeoff.csv") as f:
        assert [r["model"] for r in csv.DictReader(f)] == ["attn=0", "attn=1/2", "attn=1"]
    md = (out / "tradeoff.md").read_text()
    assert "| attn=1/2" in md and "prefill_ms@32" in md
    assert (out / "tradeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_writes_json_and_csv(tmp_path, capsys):
    main(["bench", "--recipe", "llama-tiny", "mamba2-tiny", "--lengths", "16", "32", "--repeats", "1",
          "--warmup", "0", "--output", str(tmp_path / "bench.json")])
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["matmul_peak_GFLOP/s"] > 0
    assert [(r["model"], r["seq_len"]) for r in report["rows"]] == [
        ("llama-tiny", 16), ("llama-tiny", 32), ("mamba2-tiny", 16), ("mamba2-tiny", 32)]
    assert all(r["prefill_ms"] > 0 and 0 < r["of_peak"] and r["cache_MB/seq"] > 0 for r in report["rows"])
    main(["bench", "--recipe", "llama-tiny", "--lengths", "16", "--repeats", "1", "--no-peak", "--decode-tokens", "3",
          "--decode-ctx", "8", "--output", str(tmp_path / "bench.csv")])
    with open(tmp_path / "bench.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["model"] == "llama-tiny" and "of_peak" not in rows[0]
    assert rows[1]["decode_ctx"] == "8" and float(rows[1]["decode_tok/s"]) > 0
    assert "prefill_ms" in capsys.readouterr().out


def test_tradeoff_on_checkpoints_scores_them_with_lm_eval(tmp_path):
    from hybrid import HybridLM, recipes

    mmlu = tmp_path / "mmlu"
    for split in ("dev", "test"):
        (mmlu / split).mkdir(parents=True)
        (mmlu / split / f"anatomy_{split}.csv").write_text(
            "question,choice0,choice1,choice2,choice3,answer\nWhich bone?,Femur,None,Ulna,Skull,0\n"
            "Which organ?,Liver,Heart,Lung,Kidney,1\n")
    paths = []
    for name in ("llama-tiny", "mamba2-tiny"):
        hybrid.save_pretrained(HybridLM(recipes.get(name)), tmp_path / name)
        paths.append(str(tmp_path / name))
    out = tmp_path / "report"
    main(["tradeoff", "--checkpoints", *paths, "--tasks", "mmlu_local_anatomy", "--num-fewshot", "1",
          "--mmlu-dir", str(mmlu), "--lengths", "16", "--repeats", "1", "--warmup", "0", "--output", str(out)])
    report = json.loads((out / "tradeoff.json").read_text())
    assert report["settings"]["source"] == "lm-eval"
    assert [r["model"] for r in report["rows"]] == paths
    assert all(r["acc"] in (0.0, 0.5, 1.0) and r["prefill_ms@16"] > 0 for r in report["rows"])
    assert len(list((out / "lm_eval").glob("results_*.json"))) == 2 and (out / "tradeoff.png").is_file()
