"""The real-family tradeoff report: orchestration with a fake distiller, resumption, and the files it writes."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from hybrid.eval import real_tradeoff
from hybrid.eval.real_tradeoff import BUDGETS, FAMILY, member_name
from hybrid.eval.real_tradeoff_report import flat_row, summary_table, write_report
from test_eval_mmlu_local import ROWS, write_csv

from hybrid import HybridLM, recipes, save_pretrained

TINY = dataclasses.replace(BUDGETS["default"], name="test", data_tokens=3000, seq_len=64, batch_size=2,
                           mmlu_subjects=("anatomy",), mmlu_limit=2, heldout_tokens=256, recall_queries=3,
                           recall_contexts=1, recall_lengths=(1024,), prefill_lengths=(128, 256),
                           decode_context=32, decode_steps=3)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = dataclasses.replace(recipes.get("llama-tiny"), vocab_size=320)  # the byte tokenizer's EOS (257) fits
    folder = tmp_path_factory.mktemp("teacher")
    save_pretrained(HybridLM(cfg).eval(), folder)
    return folder


def fake_distill(calls):
    """Stands in for distill_family: every student is the teacher's folder (so every member measures alike)."""

    def distill(teacher, out_dir, *, shares, mixer, batches, align_tokens, kl_tokens, progress, threads, peak_flops):
        assert peak_flops["fp32"] > 0 and all(v > 0 for v in peak_flops.values())  # the stages' "of_peak" needs it
        first = next(iter(batches(0)))
        assert first.shape == (TINY.batch_size, TINY.seq_len) and first.dtype == torch.int64
        calls.append((mixer, tuple(shares), align_tokens, kl_tokens))
        budget = {"align": {"tokens": align_tokens, "seconds": 1.0},
                  "kl": {f"{s:g}": {"tokens": kl_tokens, "seconds": 2.0} for s in shares}}
        return SimpleNamespace(students={s: teacher for s in shares}, budget=budget,
                               kept_layers={s: [] for s in shares}, align_losses=[0.1, 0.2])

    return distill


def test_run_measures_every_member_writes_files_and_resumes(teacher_dir, tmp_path, monkeypatch):
    write_csv(tmp_path / "mmlu", "anatomy", ROWS)
    monkeypatch.setattr("hybrid.distill.data.MAX_NEW_TOKENS", 32)
    monkeypatch.setattr("hybrid.distill.data.MIN_HELDOUT_TOKENS", 256)
    calls = []
    family = ((1.0, "attention"), (0.5, "mamba2"), (0.0, "mamba2"), (0.0, "gdn"))  # the real FAMILY's kinds, fewer
    kw = dict(output=tmp_path / "out", budget=TINY, mmlu_dir=tmp_path / "mmlu", family=family, threads=1,
              progress=False)
    result, paths = real_tradeoff.run(teacher_dir, distill=fake_distill(calls), **kw)
    assert sorted(calls) == [("gdn", (0.0,), TINY.align_tokens, TINY.kl_tokens),
                             ("mamba2", (0.0, 0.5), TINY.align_tokens, TINY.kl_tokens)]
    assert [m["model"] for m in result["members"]] == ["teacher", "mamba2-attn1_2", "mamba2-attn0", "gdn-attn0"]
    t = result["members"][0]
    assert t["mmlu_cloze"]["questions"] == 2 and set(t["mmlu_cloze"]) >= {"acc", "acc_norm", "acc_ci95"}
    assert t["mmlu_mc"]["questions"] == 2
    assert t["heldout"]["top1_agreement"] == 1.0  # the teacher agrees with itself
    assert set(t["recall"]) == {"1024"} and t["recall"]["1024"]["n"] == 3
    assert [r["seq_len"] for r in t["prefill"]] == [128, 256] and t["decode"]["decode_tok/s"] > 0
    assert t["memory"]["seq_len"] == 32768 and t["memory"]["cache_bytes"] > 0
    for kind in ("md", "csv", "json", "png"):
        assert paths[kind].is_file() and paths[kind].stat().st_size > 0
    md = paths["md"].read_text()
    assert md.count("| teacher ") == 1 and "mamba2-attn1_2" in md
    assert "distill mamba2: kl attn=0.5" in md and "data (teacher writes)" in md
    assert json.loads(paths["json"].read_text())["settings"]["budget"]["name"] == "test"

    # a rerun reuses every measured member (and the cached data): nothing is measured again
    monkeypatch.setattr("hybrid.eval.real_tradeoff_measure.mmlu", lambda *a, **k: pytest.fail("measured again"))
    monkeypatch.setattr("hybrid.eval.real_tradeoff_measure.speed", lambda *a, **k: pytest.fail("timed again"))
    again, _ = real_tradeoff.run(teacher_dir, distill=fake_distill([]), **kw)
    assert again["settings"]["stages"]["measure_accuracy"]["members_reused"] == 4
    assert [m["mmlu_cloze"] for m in again["members"]] == [m["mmlu_cloze"] for m in result["members"]]


def test_no_speed_scores_only_and_a_later_run_times_the_same_members(teacher_dir, tmp_path, monkeypatch):
    write_csv(tmp_path / "mmlu", "anatomy", ROWS)
    monkeypatch.setattr("hybrid.distill.data.MAX_NEW_TOKENS", 32)
    monkeypatch.setattr("hybrid.distill.data.MIN_HELDOUT_TOKENS", 256)
    family = ((1.0, "attention"), (0.0, "mamba2"))
    kw = dict(output=tmp_path / "out", budget=TINY, mmlu_dir=tmp_path / "mmlu", family=family, threads=1,
              progress=False)
    monkeypatch.setattr("hybrid.eval.real_tradeoff_measure.speed", lambda *a, **k: pytest.fail("timed"))
    first, paths = real_tradeoff.run(teacher_dir, distill=fake_distill([]), speed=False, **kw)
    assert paths == {} and not (tmp_path / "out" / "tradeoff.md").exists()
    assert all("mmlu_cloze" in m and "prefill" not in m for m in first["members"])
    monkeypatch.undo()
    monkeypatch.setattr("hybrid.distill.data.MAX_NEW_TOKENS", 32)
    monkeypatch.setattr("hybrid.distill.data.MIN_HELDOUT_TOKENS", 256)
    monkeypatch.setattr("hybrid.eval.real_tradeoff_measure.mmlu", lambda *a, **k: pytest.fail("scored again"))
    second, paths = real_tradeoff.run(teacher_dir, distill=fake_distill([]), **kw)
    assert second["settings"]["stages"]["measure_accuracy"]["members_reused"] == 2
    assert all(m["prefill"] for m in second["members"]) and paths["md"].is_file()


def test_family_is_the_issues():
    assert sorted(s for s, m in FAMILY if m == "mamba2") == [0.0, 0.125, 0.25, 0.5]
    assert sorted(s for s, m in FAMILY if m == "gdn") == [0.0, 0.25] and (1.0, "attention") in FAMILY
    assert [member_name(s, m) for s, m in FAMILY][:2] == ["teacher", "mamba2-attn1_2"]


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_every_budget_can_feed_its_held_out_stage(name):
    BUDGETS[name].check()  # a preset asking more held-out text than its data holds out failed after 75 minutes


def test_an_unfeedable_budget_is_refused_before_any_work(tmp_path):
    bad = dataclasses.replace(TINY, heldout_tokens=5000)
    with pytest.raises(ValueError, match="held-out tokens but its 3000 data tokens hold out 4096"):
        real_tradeoff.run(tmp_path, output=tmp_path / "o", budget=bad)


def test_bad_teacher_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        real_tradeoff.run(tmp_path, output=tmp_path / "o", budget=TINY)


def _fake_member(name, share, mixer, acc, prefill_ms):
    return {"model": name, "attn_share": share, "mixer": mixer, "params": 100,
            "mmlu_cloze": {"acc": acc, "acc_ci95": [acc - 0.03, acc + 0.03], "acc_norm": acc + 0.01,
                           "acc_norm_ci95": [acc - 0.02, acc + 0.04], "questions": 600},
            "heldout": {"ppl": 5.0 / (share + 0.5), "top1_agreement": 0.5 + share / 2},
            "recall": {"1024": {"exact": share, "token_acc": 0.5}, "4096": {"exact": share / 2, "token_acc": 0.25}},
            "prefill": [{"seq_len": 2048, "prefill_ms": prefill_ms}, {"seq_len": 8192, "prefill_ms": 4 * prefill_ms}],
            "decode": {"decode_tok/s": 50.0 / (share + 0.5)},
            "memory": {"seq_len": 32768, "cache_bytes": int(share * 2**30)}}


def test_report_from_fake_members(tmp_path):
    members = [_fake_member("teacher", 1.0, "attention", 0.288, 1000.0),
               _fake_member(member_name(0.25, "mamba2"), 0.25, "mamba2", 0.26, 400.0),
               _fake_member(member_name(0.0, "gdn"), 0.0, "gdn", 0.25, 250.0)]
    settings = {"date": "2026-12-07T00:00:00", "threads": 2, "teacher": "/x/smollm2", "machine": {"cpu": "cpu"},
                "budget": dataclasses.asdict(BUDGETS["default"]), "stages": {}, "wall_s": 10.0}
    paths = write_report({"settings": settings, "members": members}, tmp_path)
    table = summary_table(members, [2048, 8192])
    assert table[0]["cloze acc % [95% CI]"] == "28.8 [25.8, 31.8]"
    assert table[1]["prefill 2K s"] == "0.40 (2.50x)" and table[2]["prefill 8K s"] == "1.00 (4.00x)"
    assert table[1]["attn"] == "1/4" and table[2]["recall@4K % (digits %)"] == "0.0 (25.0)"
    row = flat_row(members[1], [2048, 8192, 32768])
    assert row["prefill_32768_ms"] is None and row["bytes_at_32K"] == 2**28 and row["mmlu_cloze_acc"] == 0.26
    csv_text = paths["csv"].read_text().splitlines()
    assert len(csv_text) == 4 and csv_text[0].startswith("model,attn_share,mixer")
    assert paths["png"].stat().st_size > 10_000


def test_cli_names_a_bad_teacher_in_one_line(capsys, tmp_path):
    from hybrid.cli import main

    with pytest.raises(SystemExit) as e:
        main(["tradeoff", "--teacher", str(tmp_path / "nope")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--teacher" in err and "config.json" in err
