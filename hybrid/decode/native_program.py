"""The native decode backends: the decode program (:mod:`hybrid.decode.program`, kernels/native/program.c) built
from every layer's own ``lower_decode``.

- ``native_program``: the whole step (embedding gather, every sub-layer, final norm, LM head) as one C call, from
  the runner's kept decode inputs (no packed batch built); greedy steps may run several at a time, their argmax
  in C (:meth:`NativeProgramBackend.run_steps`). Needs every layer and the head lowered.
- ``native_sublayers``: the packed forward with each lowered block as its own ops and the rest (a layer kind with
  no lowering, a cache format the ops do not take) its eager forward.

Both run on the CPU only, without autograd, up to ``kernels.native.MAX_ROWS`` rows, not while a SnapKV policy
observes the step's queries, and not when the native kernels are switched off (``HYBRID_BACKEND=torch``,
``HYBRID_NATIVE=0``, no library for this CPU): their ``supports()`` says which.
"""

from __future__ import annotations

import os

import torch

from ..engine.packed_batch import build_batch
from ..kernels import dispatch, native
from .backend import DecodeBackend, DecodeShape
from .program import program, run_packed, run_sublayer

OP = "decode_program"  # the dispatch op that carries HYBRID_BACKEND / use_backend for the native program


def _off() -> str | None:
    return None


dispatch.register(OP, "torch", _off)
dispatch.register(OP, "native", _off, native.available)


def native_switch() -> str | None:
    """Why the native program is switched off here (one line naming the switch), None when it is on."""
    backend, _ = dispatch.choose(OP, "cpu")
    if backend == "native":
        return None
    why = dispatch.why_not(OP, "native", "cpu")
    if why:
        return f"native kernels off: {why}"
    forced = os.environ.get("HYBRID_BACKEND")  # (else a hybrid.kernels.use_backend block forces it)
    how = f"HYBRID_BACKEND={forced}" if forced and forced != "native" else "hybrid.kernels.use_backend"
    return f"native kernels off: {how} forces the {backend} kernels"


def _common(shape: DecodeShape) -> str | None:
    if shape.device != "cpu":
        return f"the native program runs on the CPU; this engine is on {shape.device}"
    if shape.native_off is not None:
        return shape.native_off
    if shape.grad:
        return "autograd is on (decode under torch.no_grad or torch.inference_mode)"
    if shape.observed:
        return "a SnapKV pruning policy observes this step's queries (the eager attention captures them)"
    if not 0 < shape.rows <= native.MAX_ROWS:
        return f"{shape.rows} rows: the program takes 1..{native.MAX_ROWS} (torch's GEMMs take larger batches)"
    return None


def _uncovered(model, prog) -> list[str]:
    """'layers i, j (kind): why' for the blocks the program does not cover (one line per kind and reason, in layer
    order), then the LM head's line if any."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, why in enumerate(prog.why[:len(model.layers)]):
        if why is not None:
            groups.setdefault((model.layers[i].kind, why), []).append(i)
    out = [f"layer{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))} ({kind}): {why}"
           for (kind, why), idx in groups.items()]
    return out + list(prog.why[len(model.layers):])


class NativeProgramBackend(DecodeBackend):
    name = "native_program"
    multi_step = True

    def supports(self, model, cache, shape) -> str | None:
        why = _common(shape)
        if why is not None:
            return why
        missing = _uncovered(model, program(model, cache))
        if missing:
            more = f" (and {len(missing) - 2} more)" if len(missing) > 2 else ""
            return "not every layer lowers to the program: " + "; ".join(missing[:2]) + more
        return None

    def _kept_inputs(self, runner, chunks):
        """The whole-step program and the runner's kept inputs, these rows written into them; None where the
        program is gone (a cache view rebuilt since the choice, e.g. a pruning policy set)."""
        prog = program(runner.model, runner.cache)
        if prog.whole is None:
            return None
        inputs = runner.kept_inputs()
        inputs.fill(runner.manager, chunks)
        return prog, inputs

    def run(self, runner, chunks):
        kept = self._kept_inputs(runner, chunks)
        if kept is None:
            return None
        prog, inputs = kept
        tokens, positions, kv_slots, seq_lens, tables, state_slots = inputs.views()
        return prog.run(runner.model, tokens, positions, inputs.max_position, kv_slots, seq_lens, tables,
                        state_slots)

    def run_steps(self, runner, chunks, steps: int):
        kept = self._kept_inputs(runner, chunks)
        if kept is None:
            return None
        prog, inputs = kept
        block_size = runner.manager.block_size if runner.manager.kv.enabled else 0
        tokens, positions, kv_slots, seq_lens, tables, state_slots = inputs.views()
        return prog.run_steps(runner.model, steps, block_size, tokens, positions, inputs.max_position, kv_slots,
                              seq_lens, tables, state_slots)


class NativeSublayersBackend(DecodeBackend):
    name = "native_sublayers"

    def supports(self, model, cache, shape) -> str | None:
        why = _common(shape)
        if why is not None:
            return why
        prog = program(model, cache)
        if all(ops is None for ops in prog.blocks):
            return "no layer lowers to the program: " + "; ".join(_uncovered(model, prog)[:2])
        return None

    def run(self, runner, chunks):
        return forward_sublayers(runner.model, build_batch(runner.manager, chunks), runner.cache)


def forward_sublayers(model, batch, cache) -> torch.Tensor:
    """``model.forward_packed`` of a decode-only batch with each block the program covers as its own ops."""
    prog = program(model, cache)
    return model.forward_packed(batch, cache, block_step=lambda block, x, b, c: run_sublayer(prog, block, x, b, c))


def forward_packed(model, batch, cache) -> torch.Tensor:
    """A packed batch's last-token logits the fastest way the native program allows (for callers that build their
    own batches, e.g. a speculative draft model): a decode-only CPU batch as the whole program where it covers the
    model, else with the covered blocks' ops; anything else the model's forward. A copy, never a borrowed view."""
    d = batch.decode
    shape = DecodeShape(rows=0 if d is None else d.num_seqs, device=batch.tokens.device.type,
                        grad=torch.is_grad_enabled(), observed=batch.observe is not None, native_off=native_switch())
    if batch.prefill is None and d is not None and _common(shape) is None and not torch.compiler.is_compiling():
        prog = program(model, cache)
        if prog.whole is not None:
            logits = run_packed(prog, model, batch)
            if logits is not None:
                return logits
        if any(ops is not None for ops in prog.blocks):
            return forward_sublayers(model, batch, cache)
    return model.forward_packed(batch, cache)
