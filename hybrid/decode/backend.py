"""The decode-backend interface: what a backend must say about a decode-only step before it is asked to run one.

A decode-only step (every row one new token) can run as the eager torch layers, as the native decode program
(kernels/native/program.c, whole or one sub-layer at a time) or as a ``torch.compile``-d decode forward. Each
backend answers :meth:`DecodeBackend.supports` with None (it takes this model, cache and batch shape) or one line
saying why not, that a user can act on (an env switch names the switch). The model runner asks them in order once
per :class:`DecodeShape` and keeps the first that says yes (:func:`choose`); ``hybrid doctor --model`` and
``repr(engine)`` print every verdict (:func:`verdicts`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeShape:
    """What a decode step's backend choice depends on beyond the model and cache (the runner's cache key):
    ``rows`` decoding sequences on ``device``; ``compile`` (the engine was built with ``compile=True``),
    ``observed`` (a SnapKV pruning policy captures this step's queries), ``grad`` (autograd is on), ``native_off``
    (why the native kernels are switched off here, None when they are on: an env switch or a missing library)."""

    rows: int
    device: str
    compile: bool = False
    observed: bool = False
    grad: bool = False
    native_off: str | None = None


class DecodeBackend:
    """One way to run a decode-only step. ``name`` is what reports print; ``multi_step``: :meth:`run_steps` can run
    several greedy steps in one call."""

    name = "?"
    multi_step = False

    def supports(self, model, cache, shape: DecodeShape) -> str | None:
        """None when this backend runs decode steps of ``shape`` for ``model`` over ``cache``, else why not."""
        raise NotImplementedError

    def run(self, runner, chunks):
        """The step's last-token logits [rows, vocab] (possibly a view of a buffer the next step overwrites: the
        engine samples them first), or None when this backend refuses this step after all (the runner then asks
        the next backend that supports the shape)."""
        raise NotImplementedError

    def run_steps(self, runner, chunks, steps: int):
        """``steps`` greedy steps in one call: each row's argmax ids [steps][rows]; None where it cannot."""
        return None


def verdicts(backends, model, cache, shape: DecodeShape) -> list[tuple[str, str | None]]:
    """(name, None or why not) of every backend, in the order they are asked."""
    return [(b.name, b.supports(model, cache, shape)) for b in backends]


def choose(backends, model, cache, shape: DecodeShape) -> DecodeBackend:
    """The first backend that supports ``shape`` (the last, eager, supports every one)."""
    for b in backends:
        if b.supports(model, cache, shape) is None:
            return b
    raise RuntimeError(f"no decode backend takes {shape}: "
                       + "; ".join(f"{n}: {why}" for n, why in verdicts(backends, model, cache, shape)))


def describe(backends, model, cache, shape: DecodeShape) -> str:
    """One line: the chosen backend, then every other's verdict."""
    chosen = choose(backends, model, cache, shape).name
    parts = [f"{name}: " + ("chosen" if name == chosen else "yes" if why is None else f"no ({why})")
             for name, why in verdicts(backends, model, cache, shape)]
    return f"{chosen} [{'; '.join(parts)}]"
