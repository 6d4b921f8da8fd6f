"""The speculative benchmark runs end to end (a few training steps, one k, one batch) and writes its table."""

import json

from benchmarks import speculative as spec_bench


def test_spec_bench_smoke(tmp_path):
    spec_bench.main(["--threads", "1", "--length", "4", "--target-steps", "2", "--draft-steps", "2", "--batches", "1",
                     "--ks", "2", "--repeats", "1", "--output", str(tmp_path)])
    report = json.loads((tmp_path / "spec_bench.json").read_text())
    assert [r["draft"] for r in report["rows"]] == ["draft k=2", "self k=2", "ngram k=2"]
    assert report["rows"][1]["accept"] == 1.0  # draft = target: every draft accepted
    assert {"closed form ms", "step ops ms"} <= set(report["verify_paths"][0])
    assert (tmp_path / "target" / "config.json").exists() and (tmp_path / "spec_bench.md").exists()
