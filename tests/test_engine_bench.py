"""Smoke run of the engine benchmark at tiny sizes (the real run is on a quiet machine, see the README)."""

import json

import pytest
import torch

from benchmarks.decode import copy_bandwidth, decode_step_bytes, main
from hybrid import HybridLM, recipes


def test_engine_bench_runs_and_reports_every_table(tmp_path, capsys):
    n = torch.get_num_threads()
    try:
        main(["--recipes", "llama-tiny", "hybrid-1to7-tiny", "--contexts", "16", "--decode-contexts", "8",
              "--batches", "1", "3", "--modes", "eager", "--decode-steps", "2", "--warmup", "1", "--repeats", "1",
              "--hf", "llama-tiny", "--hf-batches", "1", "2", "--hf-context", "8", "--hf-new-tokens", "4",
              "--threads", "1", "--memory-recipes", "llama-small", "hybrid-1to7-small",
              "--json", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "decode.png")])
    finally:
        torch.set_num_threads(n)
    out = capsys.readouterr().out
    for table in ("## prefill", "## decode", "## batch-1 decode step, split", "## cache memory", "transformers"):
        assert table in out
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [(r["model"], r["batch"]) for r in rows["decode"]] == [
        ("llama-tiny", 1), ("llama-tiny", 3), ("hybrid-1to7-tiny", 1), ("hybrid-1to7-tiny", 3)]
    for r in rows["decode"]:
        assert r["ms_min"] <= r["ms_med"] <= r["ms_max"] and r["decode_tok/s"] > 0 and 0 < r["floor/step"]
    assert all(r["prefill_tok/s"] > 0 for r in rows["prefill"])
    assert {r["model"] for r in rows["split"]} == {"llama-tiny", "hybrid-1to7-tiny"}
    mem = {r["model"]: r for r in rows["memory"]}
    assert list(mem) == ["llama-small", "hybrid-1to7-small", "attn-only-8-small"]
    llama, hyb, attn8 = mem.values()
    assert llama["KV_bytes/token(bf16)"] == 12 * hyb["KV_bytes/token(bf16)"]  # 12 attention layers vs 1
    assert attn8["KV_bytes/token(bf16)"] == 8 * hyb["KV_bytes/token(bf16)"]  # same 8 blocks, all attention
    assert hyb["seqs_of_4096_in_4GiB"] > 3 * attn8["seqs_of_4096_in_4GiB"]
    hf = {r["batch"]: r for r in rows["transformers"]}
    assert hf[1]["same_greedy_tokens"] is True and hf[2]["transformers_tok/s"] > 0
    assert rows["decode"][0]["x_hf_batch1"] > 0
    assert (tmp_path / "decode.png").stat().st_size > 0


def test_decode_floor_counts_weights_kv_and_state():
    model = HybridLM(recipes.get("hybrid-1to7-tiny"))
    spec = model.cache_spec()
    one, two = decode_step_bytes(model, 1, 100), decode_step_bytes(model, 2, 100)
    per_seq = 100 * spec.kv_bytes_per_token + 2 * spec.state_bytes_per_sequence + model.config.d_model * 4
    assert two - one == per_seq
    assert copy_bandwidth(mib=8, repeats=2) > 1e8


def test_interleaved_rounds_pair_each_llama_bench_run_with_one_of_ours(monkeypatch):
    """--rounds: llama-bench and our decode alternate per recipe; each round's ratio is ours over that round's
    llama.cpp rate (a stand-in llama-bench whose rate doubles each call: the ratios must follow it)."""
    import argparse

    import benchmarks.decode as bench

    calls = []

    def fake_bench(path, gguf, threads):
        calls.append(gguf)
        return {"tok/s": 100.0 * 2 ** (len(calls) - 1)}

    monkeypatch.setattr(bench, "llama_bench_decode", fake_bench)
    reads = []

    def fake_read(mib, repeats):  # each round's bandwidth: 1, 2, 4 GB/s
        reads.append(mib)
        return 1e9 * 2 ** (len(reads) - 1), "fake"

    monkeypatch.setattr(bench, "read_bandwidth", fake_read)
    torch.manual_seed(0)
    models = {"llama-tiny": HybridLM(recipes.get("llama-tiny")).eval()}
    args = argparse.Namespace(rounds=3, llama_bench="llama-bench", decode_contexts=[8], decode_steps=2, warmup=1,
                              multi_step=1)
    rows = bench.interleaved_rounds(args, [{"model": "llama-tiny", "gguf": "a.gguf"},
                                           {"model": "not-timed", "gguf": "b.gguf"}], models, 1)
    assert calls == ["a.gguf"] * 3 and len(rows) == 1
    row = rows[0]
    ours = [float(v) for v in row["ours tok/s"].split()]
    assert row["rounds"] == 3 and row["llama.cpp tok/s"] == "100 200 400" and min(ours) > 0
    ratios = sorted(o / t for o, t in zip(ours, (100.0, 200.0, 400.0), strict=True))
    got = (row["ratio_min"], row["ratio_med"], row["ratio_max"])
    assert got == pytest.approx(tuple(ratios), rel=2e-3)  # (the printed rates are rounded to 0.1 tok/s)
    # each round's floor from that round's bandwidth: floor/step = step bytes / bandwidth * tokens per second
    assert len(reads) == 3
    step_bytes = decode_step_bytes(models["llama-tiny"], 1, 8)
    theirs = [step_bytes / (1e9 * 2 ** i) * 100.0 * 2 ** i for i in range(3)]
    assert [float(v) for v in row["floor/step llama.cpp"].split()] == pytest.approx(theirs, abs=6e-3)
    mine = [step_bytes / (1e9 * 2 ** i) * o for i, o in enumerate(ours)]
    assert [float(v) for v in row["floor/step ours"].split()] == pytest.approx(mine, rel=2e-3, abs=6e-3)
    assert row["floor/step_med ours"] == pytest.approx(sorted(mine)[1], rel=2e-3, abs=1e-3)
