"""``hybrid distill`` end to end on a tiny teacher (byte tokenizer, local text), and its one-line refusals."""

from __future__ import annotations

import json

import torch
from cli_helpers import one_line_exit
from distill_helpers import tiny_teacher

from hybrid import HybridConfig, HybridLM, from_pretrained, save_pretrained
from hybrid.cli import main
from hybrid.distill.pipeline import FamilyManifest

TEXT = "The quick brown fox jumps over the lazy dog. " * 40


def _args(teacher, out, text, *extra):
    return ["distill", str(teacher), "--share", "0", "0.5", "1", "--out", str(out), "--data", str(text),
            "--teacher-tokens", "0", "--align-tokens", "96", "--kl-tokens", "64", "--seq-len", "16", "--batch", "2",
            "--no-peak", "--dtype", "float32", "--threads", "1", *extra]


def test_distill_cli_makes_a_family_and_a_rerun_reuses_it(tmp_path, capsys):
    teacher = tiny_teacher(vocab=260)  # the byte tokenizer's 259 ids
    save_pretrained(teacher, tmp_path / "teacher")
    (tmp_path / "text.txt").write_text(TEXT)
    main(_args(tmp_path / "teacher", tmp_path / "out", tmp_path / "text.txt"))
    m = FamilyManifest.from_json(tmp_path / "out" / "manifest.json")
    assert sorted(m.students) == [0.0, 0.5, 1.0] and m.students[1.0] == tmp_path / "teacher"
    assert m.kept_layers[0.5] == sorted(m.kept_layers[0.5]) and len(m.kept_layers[0.5]) == 2
    assert len(m.align_losses) == 4 and m.budget["align"]["tokens"] == 3 * 32 and m.budget["kl"]["0"]["tokens"] == 64
    assert m.budget["training"].endswith("eager: compilation turned off")  # the suite trains eagerly (conftest)
    for share in (0.0, 0.5):
        s = from_pretrained(m.students[share])
        assert s.config.pattern.count("*") == len(m.kept_layers[share])
        assert m.kl[share]["kl_after"] < m.kl[share]["kl_before"]
    out = capsys.readouterr().out
    assert "share 0.5" in out and "manifest" in out
    first = (tmp_path / "out" / "kl" / "mamba2-share0.5.json").read_text()
    main(_args(tmp_path / "teacher", tmp_path / "out", tmp_path / "text.txt"))  # everything done: reused
    assert (tmp_path / "out" / "kl" / "mamba2-share0.5.json").read_text() == first
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["align_losses"] == m.align_losses


def test_distill_cli_frozen_attention_keeps_the_teachers_layers(tmp_path):
    """--kl-attention freeze: the student's kept attention layers are the teacher's weights, bit for bit, while
    its replacements and their alignment train (--align-clip per-layer taken)."""
    teacher = tiny_teacher(vocab=260)
    save_pretrained(teacher, tmp_path / "teacher")
    (tmp_path / "text.txt").write_text(TEXT)
    main(["distill", str(tmp_path / "teacher"), "--share", "0.5", "--out", str(tmp_path / "out"), "--data",
          str(tmp_path / "text.txt"), "--teacher-tokens", "0", "--align-tokens", "96", "--kl-tokens", "64",
          "--seq-len", "16", "--batch", "2", "--no-peak", "--dtype", "float32", "--threads", "1",
          "--kl-attention", "freeze", "--align-clip", "per-layer"])
    m = FamilyManifest.from_json(tmp_path / "out" / "manifest.json")
    student = from_pretrained(m.students[0.5])
    t_state, s_state = teacher.state_dict(), student.state_dict()
    kinds = student.config.layer_kinds
    attn = [i for i, k in enumerate(kinds) if k == "attention"]
    assert len(attn) == 2
    for i in attn:
        for k, v in t_state.items():
            if k.startswith(f"layers.{i}."):
                assert torch.equal(s_state[k], v), k
    assert m.kl[0.5]["kl_after"] < m.kl[0.5]["kl_before"]


def test_distill_cli_refuses_a_teacher_that_is_not_a_transformer(tmp_path, capsys):
    torch.manual_seed(0)
    hybrid_model = HybridLM(HybridConfig(vocab_size=260, d_model=32, pattern="M-*-"))
    save_pretrained(hybrid_model, tmp_path / "hybrid")
    (tmp_path / "text.txt").write_text(TEXT)
    err = one_line_exit(capsys, _args(tmp_path / "hybrid", tmp_path / "out", tmp_path / "text.txt"))
    assert "Llama-family" in err and "'M-*-'" in err


def test_distill_cli_wants_data(tmp_path, capsys):
    save_pretrained(tiny_teacher(vocab=260), tmp_path / "teacher")
    err = one_line_exit(capsys, ["distill", str(tmp_path / "teacher"), "--share", "0.5", "--out", str(tmp_path / "o"),
                             "--teacher-tokens", "0", "--no-peak"])
    assert "--data" in err
