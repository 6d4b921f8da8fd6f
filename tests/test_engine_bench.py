"""Smoke run of the engine benchmark at tiny sizes (the real run is the lead's, on a quiet machine)."""

import json

import torch
from hybrid.eval.engine_bench import main


def test_engine_bench_runs_and_reports_every_table(tmp_path, capsys):
    n = torch.get_num_threads()
    try:
        main(["--recipes", "llama-tiny", "hybrid-1to7-tiny", "--contexts", "16", "--batches", "1", "3",
              "--decode-context", "8", "--decode-steps", "2", "--repeats", "1", "--hf-prompt", "8",
              "--hf-new-tokens", "4", "--threads", "1", "--memory-recipes", "llama-small", "hybrid-1to7-small",
              "--json", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "decode.png")])
    finally:
        torch.set_num_threads(n)
    out = capsys.readouterr().out
    assert "## prefill" in out and "## decode" in out and "## cache memory" in out and "transformers" in out
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert [r["batch"] for r in rows["decode"]] == [1, 3, 1, 3]
    assert all(r["prefill_tok/s"] > 0 for r in rows["prefill"])
    mem = {r["model"]: r for r in rows["memory"]}
    assert list(mem) == ["llama-small", "hybrid-1to7-small", "attn-only-8-small"]
    llama, hyb, attn8 = mem.values()
    assert llama["KV_bytes/token(bf16)"] == 12 * hyb["KV_bytes/token(bf16)"]  # 12 attention layers vs 1
    assert attn8["KV_bytes/token(bf16)"] == 8 * hyb["KV_bytes/token(bf16)"]  # same 8 blocks, all attention
    assert hyb["seqs_of_4096_in_4GiB"] > 3 * attn8["seqs_of_4096_in_4GiB"]
    assert rows["transformers"][0]["same_greedy_tokens"] is True
    assert (tmp_path / "decode.png").stat().st_size > 0
