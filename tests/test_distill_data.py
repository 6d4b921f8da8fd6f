"""The distillation data: teacher-written tokens, cached, held out, batched per rank, guarded against MMLU."""

import csv

import pytest
import torch

from hybrid import ByteTokenizer, HybridLM, recipes
from hybrid.distill import data
from hybrid.distill.data import MMLUGuard, TokenSource, build_token_source, token_batches

QUESTION = "Which of the following best describes the function of the mitochondria in a typical animal cell today?"


@pytest.fixture(scope="module")
def teacher():
    torch.manual_seed(0)
    return HybridLM(recipes.get("llama-tiny")).eval()  # byte vocabulary (256): it never samples the EOS, 257


@pytest.fixture
def mmlu_dir(tmp_path):
    (tmp_path / "mmlu" / "test").mkdir(parents=True)
    with open(tmp_path / "mmlu" / "test" / "biology_test.csv", "w", newline="") as f:
        csv.writer(f).writerow([QUESTION, "a", "b", "c", "d", "A"])
    return tmp_path / "mmlu"


def _source(n: int, seed: int = 3) -> TokenSource:
    return TokenSource(torch.arange(n, dtype=torch.int32), torch.arange(n, n + 100, dtype=torch.int32), {"seed": seed})


def test_build_is_cached_deterministic_and_held_out(teacher, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MAX_NEW_TOKENS", 24)
    monkeypatch.setattr(data, "MIN_HELDOUT_TOKENS", 64)
    text = tmp_path / "notes.txt"
    text.write_text("A paragraph of my own notes.\n\nAnother one.")
    kw = dict(cache_dir=tmp_path / "cache", n_tokens=400, text_files=[text], seed=1, progress=False)
    a = build_token_source(teacher, ByteTokenizer(), **kw)
    assert len(a) == 400 and a.tokens.dtype == torch.int32
    assert a.meta["samples"] > 0 and a.meta["files"] == 1 and a.meta["chat_template"] is False
    assert (a.tokens == ByteTokenizer.eos_token_id).any()  # documents are joined with EOS
    held = a.heldout(64)
    assert held.dtype == torch.int64 and held.numel() == 64
    with pytest.raises(ValueError, match="held-out tokens"):
        a.heldout(10**6)
    # the second call reads the cache: same folder, same tokens, nothing generated
    monkeypatch.setattr(data, "generate_documents", lambda *a, **k: pytest.fail("generated again"))
    b = build_token_source(teacher, ByteTokenizer(), **kw)
    assert b.path == a.path and torch.equal(a.tokens, b.tokens) and torch.equal(a.heldout_tokens, b.heldout_tokens)
    # another seed is another cache entry
    monkeypatch.undo()
    monkeypatch.setattr(data, "MAX_NEW_TOKENS", 24)
    monkeypatch.setattr(data, "MIN_HELDOUT_TOKENS", 64)
    c = build_token_source(teacher, ByteTokenizer(), **{**kw, "seed": 2})
    assert c.path != a.path


def test_heldout_documents_are_not_training_documents(teacher, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "MAX_NEW_TOKENS", 24)
    monkeypatch.setattr(data, "MIN_HELDOUT_TOKENS", 64)
    s = build_token_source(teacher, ByteTokenizer(), cache_dir=tmp_path, n_tokens=300, seed=0, progress=False)
    eos = ByteTokenizer.eos_token_id

    def docs(t):
        out, cur = set(), []
        for x in t.tolist():
            if x == eos:
                out.add(tuple(cur))
                cur = []
            else:
                cur.append(x)
        return out  # complete documents only (the stream's cut tail is left out)

    assert docs(s.heldout_tokens) and not docs(s.heldout_tokens) & docs(s.tokens)


def test_guard_drops_generated_samples_and_file_paragraphs(teacher, tmp_path, mmlu_dir, monkeypatch):
    guard = MMLUGuard(mmlu_dir)
    assert guard.contaminated("Intro. " + QUESTION.upper().replace(" ", "  ") + " Outro.")
    assert not guard.contaminated("The mitochondria is the powerhouse of the cell.")
    monkeypatch.setattr(data, "MAX_NEW_TOKENS", 8)
    monkeypatch.setattr(data, "MIN_HELDOUT_TOKENS", 32)
    # every third instruction quotes the question: the teacher's document (prompt + answer) carries it
    real = data.instructions
    monkeypatch.setattr(data, "instructions", lambda n, seed: [x + (" " + QUESTION if i % 3 == 0 else "")
                                                                for i, x in enumerate(real(n, seed))])
    leaky = tmp_path / "leaky.txt"
    leaky.write_text(f"Clean paragraph.\n\nQuiz: {QUESTION}\n\nAnother clean one.")
    s = build_token_source(teacher, ByteTokenizer(), cache_dir=tmp_path / "c", n_tokens=600, text_files=[leaky],
                           mmlu_dir=mmlu_dir, progress=False)
    assert s.meta["dropped_by_guard"] > 0 and s.meta["paragraphs_dropped_by_guard"] == 1
    text = ByteTokenizer().decode(torch.cat([s.tokens, s.heldout_tokens]).tolist())
    assert "mitochondria" not in text
    docs, counts = data.file_documents([leaky], ByteTokenizer(), guard)
    assert ByteTokenizer().decode(docs[0]) == "Clean paragraph.\n\nAnother clean one." and counts[
        "paragraphs_dropped_by_guard"] == 1


def test_batches_deterministic_disjoint_across_ranks_and_resumable():
    src = _source(64 * 40)
    batches = [token_batches(src, seq_len=64, batch_size=3, rank=r, world_size=2) for r in range(2)]
    steps = [[next(b) for _ in range(14)] for b in batches]  # 6 steps per epoch: crosses two epoch boundaries
    for r in range(2):
        again = token_batches(src, seq_len=64, batch_size=3, rank=r, world_size=2)
        assert all(torch.equal(x, next(again)) for x in steps[r])
        resumed = token_batches(src, seq_len=64, batch_size=3, rank=r, world_size=2, start=9)
        assert all(torch.equal(x, next(resumed)) for x in steps[r][9:])
    for s in range(14):
        a, b = steps[0][s], steps[1][s]
        assert a.shape == (3, 64) and a.dtype == torch.int64
        starts = {int(x[0]) for x in torch.cat([a, b])}
        assert len(starts) == 6 and all(x % 64 == 0 for x in starts)  # whole windows, none shared in a step
        assert all(torch.equal(w, torch.arange(w[0], w[0] + 64)) for w in torch.cat([a, b]))
    epoch0 = {int(x[0]) for s in range(6) for b in (steps[0][s], steps[1][s]) for x in b}
    assert len(epoch0) == 36  # an epoch never repeats a window
    assert [int(x[0]) for x in steps[0][0]] != [int(x[0]) for x in steps[0][6]]  # each epoch its own order


def test_batches_refuse_too_little_data():
    with pytest.raises(ValueError, match="fewer than one step"):
        next(token_batches(_source(100), seq_len=64, batch_size=2))
    with pytest.raises(ValueError, match="rank"):
        next(token_batches(_source(1000), seq_len=64, batch_size=2, rank=2, world_size=2))
