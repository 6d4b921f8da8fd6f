"""The one place that decides which implementation runs each op.

Every op module registers its implementations here under a backend name (``torch``, ``triton``,
``cuda``) with a probe that says whether the backend can run at all (and why not). The choice
is made once per (op, device type, override) and cached; ``HYBRID_BACKEND=torch|triton|cuda``
forces one backend for every op that implements it (an op that does not keeps its default order,
and ``hybrid doctor`` shows which), and :func:`use_backend` does so for a block of code. A forced
backend that is implemented but cannot run here (package missing, tensors on CPU) is an error.

Some backends accept only part of an op's inputs (flash-attn's paged KV wants blocks of 256
tokens, mamba-ssm's packed scan takes no per-sequence initial states). Such a backend registers a
``supports(*args, **kwargs)`` check; :func:`choose` stays a cached lookup, and only those backends
pay a per-call check that hands an unsupported call to the next usable backend in the order (or,
when that backend was forced, raises saying why).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

BACKENDS = ("cuda", "triton", "inductor", "native", "torch")
# Preferred order per device type; CPU runs the pure-torch paths (Triton on CPU is only the
# interpreter, which is for tests, and must be asked for explicitly). ``inductor`` (a torch.compile'd
# fusion of a torch path: the SSD / selective scans, kernels/inductor_backend.py, and the int8 state step,
# kernels/int8_state_step.py) compiles per shape, so it too runs only when asked for.
# ``native`` (our C kernels, kernels/native/: built once per machine with the system compiler) runs first on a CPU
# for the ops that have it, each with a per-call check that hands other inputs to torch.
DEFAULT_ORDER = {"cuda": ("cuda", "triton", "torch"), "cpu": ("native", "torch")}


class BackendError(RuntimeError):
    """No registered backend can run the requested op here."""


@dataclass(frozen=True)
class Impl:
    fn: Callable
    probe: Callable[[], str | None]  # returns None when usable, else the reason it is not
    # per call: None when this backend can run these arguments, else why not; None means "any"
    supports: Callable[..., str | None] | None = None


_registry: dict[str, dict[str, Impl]] = {}
_cache: dict[tuple[str, str, str | None], tuple[str, Callable]] = {}
_local = threading.local()


def _always() -> str | None:
    return None


def register(op: str, backend: str, fn: Callable, probe: Callable[[], str | None] = _always,
             supports: Callable[..., str | None] | None = None) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _registry.setdefault(op, {})[backend] = Impl(fn, probe, supports)
    _cache.clear()


def ops() -> list[str]:
    return sorted(_registry)


def _override() -> str | None:
    forced = getattr(_local, "forced", None) or os.environ.get("HYBRID_BACKEND") or None
    if forced is not None and forced not in BACKENDS:
        raise BackendError(f"HYBRID_BACKEND={forced!r} is not a backend; use one of {BACKENDS}")
    return forced


def choose(op: str, device_type: str) -> tuple[str, Callable]:
    """Return ``(backend_name, fn)`` for ``op`` on ``device_type`` ("cpu", "cuda", ...)."""
    forced = _override()
    key = (op, device_type, forced)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    impls = _registry.get(op)
    if not impls:
        raise BackendError(f"no implementation registered for op {op!r}; known ops: {ops()}")
    default = DEFAULT_ORDER.get(device_type, ("torch",))
    if forced and forced in impls:
        order = (forced,)  # asked for and implemented: use it or fail saying why, never fall back silently
    elif forced:
        order = tuple(b for b in default if b != forced)  # this op has no such backend: `hybrid doctor` shows it
    else:
        order = default
    usable, reasons = [], []
    for name in order:
        impl = impls.get(name)
        if impl is None:
            reasons.append(f"{name}: not implemented for {op}")
            continue
        why_not = _why_not(name, impl, device_type)
        if why_not is None:
            usable.append((name, impl))
            if impl.supports is None:
                break  # takes every call: later backends are never reached
        else:
            reasons.append(f"{name}: {why_not}")
    if not usable:
        raise BackendError(f"no usable backend for {op!r} on {device_type}: " + "; ".join(reasons))
    _cache[key] = (usable[0][0], _with_fallbacks(op, usable, forced))
    return _cache[key]


def _why_not(name: str, impl: Impl, device_type: str) -> str | None:
    why_not = impl.probe()
    if why_not is None and name == "cuda" and device_type != "cuda":
        why_not = f"tensors are on {device_type}, the cuda backend needs a GPU"
    if why_not is None and name == "triton":
        from .triton_support import device_reason

        why_not = device_reason(device_type)
    return why_not


def implements(op: str, backend: str) -> bool:
    """Whether ``backend`` has an implementation of ``op`` registered (usable here or not)."""
    return backend in _registry.get(op, {})


def why_not(op: str, backend: str, device_type: str) -> str | None:
    """None when ``backend`` can run ``op`` on ``device_type`` (per-call checks aside), else why not."""
    impl = _registry.get(op, {}).get(backend)
    return f"{backend}: not implemented for {op}" if impl is None else _why_not(backend, impl, device_type)


def _with_fallbacks(op: str, usable: list[tuple[str, Impl]], forced: str | None) -> Callable:
    """The first backend's fn, wrapped in its per-call check when it has one."""
    (name, impl), rest = usable[0], usable[1:]
    if impl.supports is None:
        return impl.fn
    fallback = _with_fallbacks(op, rest, forced) if rest else None
    # a backend whose supports() validates everything its fn would (the native ops: supports_* runs the op's own
    # argument check) may name the call to make once it passed, without validating again (kernels/native/ops.py)
    after_supports = getattr(impl.fn, "after_supports", impl.fn)

    def checked(*args, **kwargs):
        why_not = impl.supports(*args, **kwargs)
        if why_not is None:
            return after_supports(*args, **kwargs)
        if fallback is None:
            how = f"HYBRID_BACKEND={forced} forces it" if forced else "no other backend is usable here"
            raise BackendError(f"{op}: the {name} backend cannot run this call ({why_not}) and {how}")
        return fallback(*args, **kwargs)

    checked.__name__ = f"{op}[{name}, checked]"
    return checked


def explain(device_type: str) -> list[tuple[str, str, str]]:
    """``(op, chosen backend or '-', reasons)`` for every op, for ``hybrid doctor``."""
    rows = []
    for op in ops():
        notes = []
        for name in BACKENDS:
            impl = _registry[op].get(name)
            if impl is None:
                if name not in ("inductor", "native"):  # a few ops have these: not a gap in the others
                    notes.append(f"{name}: not implemented")
                continue
            why_not = _why_not(name, impl, device_type)
            note = "ok" if why_not is None else why_not
            if impl.supports is not None and impl.supports.__doc__:
                note += f" (per call: {impl.supports.__doc__.strip()})"
            notes.append(f"{name}: {note}")
        try:
            chosen, _ = choose(op, device_type)
        except BackendError:
            chosen = "-"
        rows.append((op, chosen, "; ".join(notes)))
    return rows


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force ``name`` for every op inside the block (this thread only); ``None`` restores defaults."""
    if name is not None and name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; use one of {BACKENDS}")
    prev = getattr(_local, "forced", None)
    _local.forced = name
    try:
        yield
    finally:
        _local.forced = prev


def device_type(t: torch.Tensor) -> str:
    return t.device.type
