"""The KL stage (hybrid.distill.kl) and the alignment pass (hybrid.distill.align): the chunked loss is the plain
one, training lowers the held-out KL, and a run stopped and rerun ends where an uninterrupted run ends."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from distill_helpers import tiny_teacher, token_stream

from hybrid.distill.align import align_layers, load_replacements
from hybrid.distill.init import attention_positions, replacement_from_attention
from hybrid.distill.kl import (
    TRAIN_ATTENTION,
    chunked_kl_backward,
    distill_kl,
    final_hidden,
    kl_divergence,
    trained_parameters,
)
from hybrid.distill.student import build_student


def _student(teacher, keep=(1,), mixer="mamba2"):
    reps = {n: replacement_from_attention(teacher.config, teacher.layers[p].mixer, mixer).state_dict()
            for n, p in enumerate(attention_positions(teacher.config))}
    return build_student(teacher, reps, keep, mixer)


def test_chunked_kl_equals_the_whole_vocab_kl_and_its_gradient():
    teacher = tiny_teacher()
    student = _student(teacher)
    params = trained_parameters(student, train_attention=False)
    ids = token_stream()(0).__next__()
    with torch.no_grad():
        ht = final_hidden(teacher, ids)
    kl = chunked_kl_backward(student, teacher, final_hidden(student, ids), ht, chunk=7)  # chunks cut rows
    chunked = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    lp_t = F.log_softmax(teacher(ids).float(), -1).detach()
    whole = F.kl_div(F.log_softmax(student(ids).float(), -1), lp_t, log_target=True, reduction="sum") / ids.numel()
    whole.backward()
    whole_kl = float(whole.detach())
    assert abs(kl - whole_kl) <= 1e-6 * whole_kl
    for g, p in zip(chunked, params, strict=True):  # fp32 sums in another order: relative 1e-5 of the largest
        assert torch.allclose(g, p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item())
    # frozen attention: the replacements train and nothing else (the kept attention layer 1, at block 2)
    trained = {n for n, p in student.named_parameters() if p.requires_grad}
    replacements = {n for n, p in student.named_parameters()
                    if n.startswith("layers.") and student.layers[int(n.split(".")[1])].kind not in ("mlp", "attention")
                    and ".mixer." in n}
    assert trained == replacements and "embed.weight" not in trained and any("layers.0.mixer" in n for n in trained)
    assert not any(n.startswith("layers.2.") for n in trained)
    # by default (TRAIN_ATTENTION, chosen by measurement) the kept attention layers' mixers too
    assert TRAIN_ATTENTION
    trained_parameters(student, train_all=False)
    assert {n for n, p in student.named_parameters() if p.requires_grad} == replacements | {
        n for n, _ in student.named_parameters() if n.startswith("layers.2.mixer.")}


def test_kl_training_lowers_the_held_out_kl(tmp_path):
    """'Monotonically' here: the KL on a held-out batch (stream batch 0, never trained on) after budgets of 0, 6,
    18 and 40 steps, each a run from the same start, strictly decreases."""
    teacher = tiny_teacher()
    batches = token_stream()
    held_out = next(batches(0))
    kls = []
    for steps in (0, 6, 18, 40):
        torch.manual_seed(0)
        student = _student(teacher, keep=())
        if steps:
            distill_kl(student, teacher, tmp_path / f"{steps}.pt", batches=batches, start=1, steps=steps,
                       lr=3e-3, progress=False, checkpoint_every=10 ** 9)
        kls.append(kl_divergence(student, teacher, held_out))
    assert all(a > b for a, b in zip(kls[:-1], kls[1:], strict=True)), kls
    # and by more than noise: 40 steps took 1.02 -> 0.83 when written (all four layers replaced, lr 3e-3)
    assert kls[-1] < 0.85 * kls[0], kls


def _interrupt_after(batches, k):
    """The stream, but stopping the run (as a KeyboardInterrupt would) after ``k`` batches."""
    def stream(start):
        for i, b in enumerate(batches(start)):
            if i == k:
                raise KeyboardInterrupt
            yield b
    return stream


def test_kl_resume_equals_an_uninterrupted_run(tmp_path):
    teacher = tiny_teacher()
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    batches = token_stream()
    full = _student(teacher, keep=(1, 3))  # kept attention layers train too: copies of the teacher's
    rec_full, _ = distill_kl(full, teacher, tmp_path / "full.pt", batches=batches, start=1, steps=9, lr=3e-3,
                             progress=False, checkpoint_every=2, train_attention=True)
    cut = _student(teacher, keep=(1, 3))
    try:
        distill_kl(cut, teacher, tmp_path / "cut.pt", batches=_interrupt_after(batches, 5), start=1, steps=9,
                   lr=3e-3, progress=False, checkpoint_every=2, train_attention=True)
        raise AssertionError("the run was to be interrupted")
    except KeyboardInterrupt:
        pass
    # a fresh process: the model as built, the rest from the checkpoint (step 4)
    resumed = _student(teacher, keep=(1, 3))
    rec, _ = distill_kl(resumed, teacher, tmp_path / "cut.pt", batches=batches, start=1, steps=9, lr=3e-3,
                        progress=False, checkpoint_every=2, train_attention=True)
    assert [h["loss"] for h in rec["history"]] == [h["loss"] for h in rec_full["history"]]
    for (n, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert not torch.equal(full.layers[2].mixer.q_proj.weight, before["layers.2.mixer.q_proj.weight"])
    for k, v in teacher.state_dict().items():  # the teacher is never trained
        assert torch.equal(v, before[k]), k


def test_align_resume_equals_an_uninterrupted_run(tmp_path):
    teacher = tiny_teacher()
    batches = token_stream()
    held = next(batches(0))
    full = align_layers(teacher, tmp_path / "full", mixer="gdn", batches=batches, held_out=held, start=1, steps=7,
                        progress=False, checkpoint_every=1)
    try:
        align_layers(teacher, tmp_path / "cut", mixer="gdn", batches=_interrupt_after(batches, 4), held_out=held,
                     start=1, steps=7, progress=False, checkpoint_every=1)
        raise AssertionError("the run was to be interrupted")
    except KeyboardInterrupt:
        pass
    resumed = align_layers(teacher, tmp_path / "cut", mixer="gdn", batches=batches, held_out=held, start=1,
                           steps=7, progress=False, checkpoint_every=1)
    assert resumed["loss_history"] == full["loss_history"]
    assert resumed["losses"] == full["losses"]
    a, b = (load_replacements(teacher.config, tmp_path / d, "gdn") for d in ("full", "cut"))
    for n in a:
        for k in a[n]:
            assert torch.equal(a[n][k], b[n][k]), (n, k)
    # alignment lowered every layer's held-out loss from the attention-derived start
    assert all(f < i for f, i in zip(full["losses"], full["initial_losses"], strict=True)), full
