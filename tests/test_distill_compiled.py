"""The trained mixers through torch.compile (hybrid.distill.compiled): the same gradients as eager mode, the eager
forward whenever autograd is off, the modules as they were after a stage, and a switch that turns it off.

The rest of the suite trains eagerly (conftest sets HYBRID_DISTILL_COMPILE=0: a compile costs seconds per test);
these tests compile on purpose."""

from __future__ import annotations

import copy

import pytest
import torch
from distill_helpers import tiny_teacher, token_stream
from hybrid.kernels import inductor_backend

from hybrid.distill import compiled
from hybrid.distill.init import attention_positions, replacement_from_attention
from hybrid.distill.kl import distill_kl
from hybrid.distill.student import build_student

needs_inductor = pytest.mark.skipif(inductor_backend.probe() is not None, reason=str(inductor_backend.probe()))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _grads(module, u):
    u = u.clone().requires_grad_()
    y = module(u)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return {"y": y.detach(), "u": u.grad, **{n: p.grad for n, p in module.named_parameters()}}


@needs_inductor
@pytest.mark.parametrize(("mixer", "bf16"), [("mamba2", True), ("gdn", False)])
def test_compiled_mixer_trains_like_the_eager_one(mixer, bf16):
    """fp32: the compiled forward and every gradient equal eager mode's to fp32 rounding. bf16: no further from
    the fp32 result than eager bf16 is (the fused chains keep fp32 intermediates; eager rounds each op). A cold
    compile of a mixer costs tens of seconds of CPU, so bf16 is compiled for the default mixer alone: keeping
    fp32 intermediates is a property of Inductor's code generation, not of the mixer; fp32 checks both mixers'
    compiled graphs."""
    torch.manual_seed(0)
    teacher = tiny_teacher()
    rep = replacement_from_attention(teacher.config, teacher.layers[attention_positions(teacher.config)[0]].mixer,
                                     mixer)
    u = torch.randn(2, 96, teacher.config.d_model)
    eager32 = _grads(rep, u)
    fast = copy.deepcopy(rep)
    assert compiled.compile_for_training([fast], True) == "compiled mixers"
    fast32 = _grads(fast, u)
    for k, want in eager32.items():
        assert _rel(fast32[k], want) < 1e-4, k
    if not bf16:
        return

    ref, eager16, fast16 = rep, copy.deepcopy(rep).bfloat16(), copy.deepcopy(rep).bfloat16()
    compiled.compile_for_training([fast16], True)
    got_eager, got_fast = _grads(eager16, u.bfloat16()), _grads(fast16, u.bfloat16())
    for k, want in eager32.items():
        assert torch.isfinite(got_fast[k]).all(), k
        assert _rel(got_fast[k], want) <= 1.5 * _rel(got_eager[k], want) + 1e-3, k
    assert ref is rep


def test_eager_forward_runs_without_autograd_and_the_module_is_restored(monkeypatch):
    """The compiled callable serves only calls with autograd on; restore_eager gives the class forward back."""
    calls = []

    def fake_compile(fn, **kw):
        def run(*a, **k):
            calls.append(kw)
            return fn(*a, **k)
        return run

    monkeypatch.setattr(compiled, "compile_reason", lambda requested=None: None)
    monkeypatch.setattr(compiled.torch, "compile", fake_compile)
    teacher = tiny_teacher()
    rep = replacement_from_attention(teacher.config, teacher.layers[attention_positions(teacher.config)[0]].mixer,
                                     "mamba2")
    u = torch.randn(1, 8, teacher.config.d_model)
    with torch.no_grad():
        want = rep(u)
    compiled.compile_for_training([rep])
    compiled.compile_for_training([rep])  # twice: wrapped once
    with torch.no_grad():
        assert torch.equal(rep(u), want) and calls == []
    assert torch.allclose(rep(u).detach(), want, rtol=1e-5, atol=1e-6) and calls == [{"dynamic": False}]
    compiled.restore_eager([rep])
    assert "forward" not in vars(rep)
    rep(u)
    assert len(calls) == 1


def test_switch_and_reasons(monkeypatch):
    monkeypatch.setenv(compiled.ENV, "0")
    assert compiled.compile_reason() == "eager: compilation turned off"
    assert compiled.compile_for_training([torch.nn.Linear(2, 2)]) == "eager: compilation turned off"
    monkeypatch.setenv(compiled.ENV, "sometimes")
    with pytest.raises(ValueError, match="HYBRID_DISTILL_COMPILE='sometimes': use 1"):
        compiled.compile_reason()
    assert compiled.compile_reason(False) == "eager: compilation turned off"
    monkeypatch.setattr(inductor_backend, "probe", lambda: "no C++ compiler (g++, c++ or clang++) on PATH")
    assert compiled.compile_reason(True) == "eager: no C++ compiler (g++, c++ or clang++) on PATH"


def test_kl_stage_compiled_follows_the_eager_run(tmp_path, monkeypatch):
    """Three KL steps in fp32, compiled and eager, from the same student: the same losses to fp32 rounding, and
    the student's mixers are plain modules again afterwards (they save, copy and run in the engine as before).
    The stage's wiring is what this checks: its graphs go through AOT autograd without Inductor's code generation
    (``aot_eager``; Inductor's own forward and backward of these mixers are the test above's), which saves a cold
    C++ compile of every graph (~40 s on 2 cores)."""
    real = torch.compile
    monkeypatch.setattr(compiled, "compile_reason", lambda requested=None: None if requested is not False else "off")
    calls = []
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kw: calls.append(fn) or real(fn, **kw,
                                                                                            backend="aot_eager"))
    teacher = tiny_teacher()
    reps = {n: replacement_from_attention(teacher.config, teacher.layers[p].mixer, "mamba2").state_dict()
            for n, p in enumerate(attention_positions(teacher.config))}
    runs = []
    for on in (False, True):
        student = build_student(teacher, reps, (), "mamba2")
        rec, _ = distill_kl(student, teacher, tmp_path / f"{on}.pt", batches=token_stream(), start=1, steps=3,
                            lr=3e-3, progress=False, checkpoint_every=10 ** 9, compile=on)
        assert not any("forward" in vars(layer.mixer) for layer in student.layers)
        runs.append([h["loss"] for h in rec["history"]])
    eager, fast = runs
    assert len(calls) == len(attention_positions(teacher.config))  # each replaced mixer, compiled run only
    assert all(abs(a - b) <= 1e-4 * abs(a) for a, b in zip(eager, fast, strict=True)), runs
