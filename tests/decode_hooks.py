"""Test hooks on an engine's decode steps: record each decode step's logits from the whole-step native program, or
turn that backend off (the blocks then run their own ops, or the eager layers) and record the model's logits.

The model runner picks a decode step's backend from each backend's ``supports()`` (hybrid/decode/): these hooks
make a backend say no, or sit on ``DecodeProgram.run``, which the whole-step backend runs."""

from __future__ import annotations

import torch
from hybrid.kernels import native

import hybrid.model as model_mod
from hybrid.decode import program as decode_program
from hybrid.decode.native_program import NativeProgramBackend, NativeSublayersBackend
from hybrid.engine.runner import ModelRunner


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
    real_execute, real_run = ModelRunner.execute, decode_program.DecodeProgram.run

    def run(self, *a, **kw):
        out = real_run(self, *a, **kw)
        assert out is not None, "the whole-step program refused a decode step"
        got.append(out.clone())
        return out

    def execute(self, chunks, **kw):
        before = len(got)
        out = real_execute(self, chunks, **kw)
        if all(len(c.tokens) == 1 for c in chunks):
            assert len(got) == before + 1, self.decode_report(len(chunks))
        return out

    monkeypatch.setattr(decode_program.DecodeProgram, "run", run)
    monkeypatch.setattr(ModelRunner, "execute", execute)
    monkeypatch.setattr(ModelRunner, "can_run_steps", lambda self: False)
    return got


def no_whole_step(monkeypatch) -> None:
    """No decode step runs the whole-step program (the per-block programs are still built and used: the
    ``native_sublayers`` backend)."""
    monkeypatch.setattr(NativeProgramBackend, "supports", lambda self, model, cache, shape: "off in this test")


def eager_step_logits(monkeypatch, *, sublayers: bool = False) -> list[torch.Tensor]:
    """Each decode step's logits from the model's own head, with no whole-step program; ``sublayers=False`` also
    turns the per-block native ops off (every sub-layer its layer's forward)."""
    no_whole_step(monkeypatch)
    if not sublayers:
        monkeypatch.setattr(NativeSublayersBackend, "supports", lambda self, model, cache, shape: "off in this test")
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


def no_native_steps(monkeypatch) -> None:
    """Every decode step runs the eager layers (neither the whole-step program nor the per-block ops): a test
    that calls :func:`sublayer_ops` itself beside them."""
    no_whole_step(monkeypatch)
    monkeypatch.setattr(NativeSublayersBackend, "supports", lambda self, model, cache, shape: "off in this test")


def sublayer_ops(model, block, x, batch, cache):
    """What the native program's ops of ``block`` give for these decode rows (None: not covered)."""
    return decode_program.run_sublayer(decode_program.program(model, cache), block, x, batch, cache)
