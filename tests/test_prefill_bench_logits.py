"""`hybrid bench --logits last|all`: the row says which, and the FLOPs count the LM head only where it ran."""

import json

import pytest
from hybrid.eval import timing as prefill_bench

from hybrid import HybridLM, recipes
from hybrid.cli import main


def test_last_position_flops_drop_the_lm_head_of_the_other_positions():
    model = HybridLM(recipes.get("mamba2-tiny"))
    L, cfg = 40, model.config
    every = prefill_bench.prefill_flops(model, L, 2, "all")
    assert every == model.flops_per_token(L) * L * 2
    head = 2.0 * cfg.vocab_size * cfg.d_model
    assert prefill_bench.prefill_flops(model, L, 2, "last") == pytest.approx(every - head * (L - 1) * 2)
    with pytest.raises(ValueError, match="logits must be one of"):
        prefill_bench.prefill_flops(model, L, 1, "first")


def test_bench_rows_say_which_logits_they_timed(tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["bench", "--recipe", "llama-tiny", "--lengths", "16", "--repeats", "1", "--warmup", "0", "--threads", "1",
          "--no-peak", "--output", str(out)])
    report = json.loads(out.read_text())
    assert report["logits"] == "last" and report["rows"][0]["logits"] == "last"
    assert "last-position logits only" in capsys.readouterr().out
    main(["bench", "--recipe", "llama-tiny", "--lengths", "16", "--repeats", "1", "--warmup", "0", "--threads", "1",
          "--no-peak", "--logits", "all", "--output", str(out)])
    assert json.loads(out.read_text())["rows"][0]["logits"] == "all"
    with pytest.raises(SystemExit):
        main(["bench", "--recipe", "llama-tiny", "--logits", "first"])
