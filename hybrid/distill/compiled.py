"""The trained mixers' forward and backward through ``torch.compile`` (Inductor) while they train.

On a CPU a replacement mixer's training step is bound by its elementwise chains, not its matmuls: the conv
taps, the SSD's decay and gating products, the gated norm, each one more pass over [batch, tokens, width]
work tensors in eager mode and one more autograd node to walk back. Inductor fuses those chains, forward and
backward, into generated C++ loops (the matmuls stay oneDNN calls), and keeps their intermediates in fp32
where eager mode rounds every op's bf16 output: a compiled bf16 mixer's output and gradients are as close to
the fp32 mixer's as the eager ones or closer (``tests/test_distill_compiled.py``).

Only calls with autograd on take the compiled forward: evaluation under ``no_grad`` (held-out losses,
perplexity, generation) runs the eager one, whose inference paths (the SSD's in-place chunk walk, the
native decode ops) dynamo would unroll or refuse. Shapes are static: training batches have one shape, so
a stage compiles once, in its untimed first step, and each module instance of a class reuses that code. With a
cold Inductor cache that compile is tens of seconds per mixer class and dtype on 2 cores (Inductor's Python-side
lowering, mostly; Mamba-2's chunk walk, kept out of the graphs, splits its forward into several). Inductor
needs a C++ compiler for CPU code; without one the stage trains eagerly and says why.

``HYBRID_DISTILL_COMPILE=0`` (or ``compile=False`` in the API, ``--no-compile`` on the CLI) trains eagerly.
"""

from __future__ import annotations

import os

import torch

ENV = "HYBRID_DISTILL_COMPILE"


def compile_reason(requested: bool | None = None) -> str | None:
    """None when the trained mixers will be compiled, else why not (one line). ``requested``: the caller's
    choice (None: the environment's, default on)."""
    from ..kernels import inductor_backend

    if requested is None:
        env = os.environ.get(ENV, "1").strip().lower()
        if env not in ("0", "1", "false", "true", "no", "yes", ""):
            raise ValueError(f"{ENV}={os.environ[ENV]!r}: use 1 (compile the trained mixers) or 0 (train eagerly)")
        requested = env not in ("0", "false", "no")
    if not requested:
        return "eager: compilation turned off"
    why = inductor_backend.probe()
    return None if why is None else f"eager: {why}"


def compile_for_training(modules, requested: bool | None = None) -> str:
    """Route each module's forward, when autograd is on, through one ``torch.compile`` of it (static shapes);
    with autograd off the eager forward runs. Returns the stage's precision-note suffix: "compiled mixers" or
    the reason it trains eagerly."""
    why = compile_reason(requested)
    if why is not None:
        return why
    for module in modules:
        if getattr(module, "_hybrid_training_compiled", False):
            continue
        eager = module.forward
        fast = torch.compile(eager, dynamic=False)

        def forward(*args, _eager=eager, _fast=fast, **kwargs):
            return _fast(*args, **kwargs) if torch.is_grad_enabled() else _eager(*args, **kwargs)

        module.forward = forward
        module._hybrid_training_compiled = True
    return "compiled mixers"


def restore_eager(modules) -> None:
    """Undo :func:`compile_for_training` (the module's class forward again)."""
    for module in modules:
        if getattr(module, "_hybrid_training_compiled", False):
            del module.forward
            module._hybrid_training_compiled = False
