"""Test hooks on an engine's decode steps: record each decode step's logits from the whole-step native program, or
turn that program off (the blocks then run their own ops, or the eager layers) and record the model's logits.

A CPU decode step reaches the whole-step program either from the model runner's kept inputs or from
``fused_decode.step`` of a packed batch; both go through ``fused_decode.whole_program`` and
``DecodeProgram.run``, which is where these hooks sit."""

from __future__ import annotations

import torch
from hybrid.kernels import native

import hybrid.model as model_mod
from hybrid.engine.runner import ModelRunner
from hybrid.layers import fused_decode


def _decode_steps(monkeypatch) -> list[bool]:
    """A one-item flag, True while the engine runs a decode-only step (every chunk one token)."""
    decoding = [False]
    real = ModelRunner.execute

    def execute(self, chunks, **kw):
        decoding[0] = all(len(c.tokens) == 1 for c in chunks)
        return real(self, chunks, **kw)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    return decoding


def whole_step_logits(monkeypatch) -> list[torch.Tensor]:
    """Each decode step's logits (copies) from the whole-step program; a decode step that does not run it fails
    the test, with the program's coverage. (Greedy steps would otherwise take their argmax in C without handing
    the logits back: ``Engine``'s greedy steps; here they run ``DecodeProgram.run`` and sample in Python.)"""
    got: list[torch.Tensor] = []
    real_execute, real_run = ModelRunner.execute, fused_decode.DecodeProgram.run

    def run(self, *a, **kw):
        out = real_run(self, *a, **kw)
        assert out is not None, "the whole-step program refused a decode step"
        got.append(out.clone())
        return out

    def execute(self, chunks, **kw):
        before = len(got)
        out = real_execute(self, chunks, **kw)
        if all(len(c.tokens) == 1 for c in chunks):
            assert len(got) == before + 1, fused_decode.coverage(self.model, self.cache)
        return out

    monkeypatch.setattr(fused_decode.DecodeProgram, "run", run)
    monkeypatch.setattr(ModelRunner, "execute", execute)
    monkeypatch.setattr(ModelRunner, "can_run_steps", lambda self: False)
    return got


def no_whole_step(monkeypatch) -> None:
    """No decode step runs the whole-step program (the per-block programs are still built, by the real
    ``whole_program``, and used)."""
    real = fused_decode.whole_program
    monkeypatch.setattr(fused_decode, "whole_program", lambda model, cache: real(model, cache) and None)


def eager_step_logits(monkeypatch, *, sublayers: bool = False) -> list[torch.Tensor]:
    """Each decode step's logits from the model's own head, with no whole-step program; ``sublayers=False`` also
    turns the per-block native ops off (every sub-layer its layer's forward)."""
    no_whole_step(monkeypatch)
    if not sublayers:
        monkeypatch.setattr(fused_decode, "sublayer", lambda block, x, batch, cache: None)
    decoding = _decode_steps(monkeypatch)
    got: list[torch.Tensor] = []
    plain = model_mod.HybridLM.logits

    def logits(self, h):
        out = plain(self, h)
        if decoding[0]:
            got.append(out.clone())
        return out

    monkeypatch.setattr(model_mod.HybridLM, "logits", logits)
    return got


def avx2_build():
    """The package's AVX2 variant (x86-64-v3, what a CPU without AVX-512 loads), checked to be that build; None on a
    CPU without AVX-512, where the library under test is that build already."""
    if "AVX-512" not in native.cpu_paths():
        return None
    lib = native.load_variant("x86-64-v3")
    assert lib.hl_cpu_paths() == 1  # AVX2 only
    return lib
