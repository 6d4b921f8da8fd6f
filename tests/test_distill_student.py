"""Students assembled from a teacher and its replacements (hybrid.distill.student) are ordinary models."""

from __future__ import annotations

import pytest
import torch
from distill_helpers import tiny_teacher

from hybrid import Engine, SamplingParams, from_pretrained, save_pretrained
from hybrid.distill.align import choose_attention_layers
from hybrid.distill.init import attention_positions, replacement_from_attention
from hybrid.distill.student import build_student


def _replacements(teacher, mixer):
    torch.manual_seed(3)
    reps = {}
    for n, pos in enumerate(attention_positions(teacher.config)):
        m = replacement_from_attention(teacher.config, teacher.layers[pos].mixer, mixer)
        with torch.no_grad():  # move off the init so a wrong layer would show
            for p in m.parameters():
                p.add_(0.05 * torch.randn_like(p))
        reps[n] = m.state_dict()
    return reps


@torch.no_grad()
def test_student_keeping_every_attention_layer_is_the_teacher():
    teacher = tiny_teacher()
    student = build_student(teacher, _replacements(teacher, "mamba2"), keep=range(4), mixer="mamba2")
    ids = torch.randint(0, 97, (2, 19))
    assert student.config.pattern == teacher.config.pattern
    assert torch.equal(student(ids), teacher(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_students_own_their_weights(dtype):
    """Several students come from one set of replacements (one per attention share) and each trains in place: a
    student's weights are never the replacements' or the teacher's tensors, in the replacements' own dtype too
    (fp32 training once trained every later share's student from the previous one's result)."""
    teacher = tiny_teacher().to(dtype)
    reps = {n: {k: v.to(dtype) for k, v in sd.items()} for n, sd in _replacements(teacher, "mamba2").items()}
    theirs = {id(v.untyped_storage()) for sd in reps.values() for v in sd.values()}
    theirs |= {id(p.untyped_storage()) for p in teacher.parameters()}
    before = {(n, k): v.clone() for n, sd in reps.items() for k, v in sd.items()}
    student = build_student(teacher, reps, keep=[], mixer="mamba2")
    assert not theirs & {id(p.untyped_storage()) for p in student.parameters()}
    with torch.no_grad():
        for p in student.parameters():
            p.add_(1.0)
    assert all(torch.equal(reps[n][k], v) for (n, k), v in before.items())


@torch.no_grad()
def _greedy(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("mixer,keep", [("mamba2", []), ("gdn", []), ("mamba2", [2])])
def test_student_runs_through_the_engine_and_saves(tmp_path, mixer, keep):
    teacher = tiny_teacher()
    student = build_student(teacher, _replacements(teacher, mixer), keep=keep, mixer=mixer)
    symbol = {"mamba2": "M", "gdn": "G"}[mixer]
    assert student.config.pattern == "".join("*-" if n in keep else f"{symbol}-" for n in range(4))
    prompts = [[5, 9, 11, 3, 7, 1, 2], [40], list(range(20, 39))]
    engine = Engine(student, num_blocks=32, block_size=4, max_batch_tokens=8)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    engine.run()
    for rid, p in zip(ids, prompts, strict=True):
        assert engine.requests[rid].output == _greedy(student, p, 6)
    save_pretrained(student, tmp_path / "s")
    back = from_pretrained(tmp_path / "s")
    assert back.config == student.config
    x = torch.randint(0, 97, (2, 13))
    with torch.no_grad():
        assert torch.equal(back(x), student(x))


def test_choose_attention_layers():
    losses = [0.1, 0.9, 0.3, 0.8, 0.2, 0.05]
    assert choose_attention_layers(losses, 0.5, "worst") == [1, 2, 3]
    assert choose_attention_layers(losses, 1 / 3, "even") == [1, 4]
    assert choose_attention_layers(losses, 0.0, "worst") == []
    assert choose_attention_layers(losses, 1.0, "even") == list(range(6))
    with pytest.raises(ValueError, match="worst"):
        choose_attention_layers(losses, 0.5, "best")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        choose_attention_layers(losses, 1.5)
