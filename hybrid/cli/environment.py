"""The ``HYBRID_*`` environment variables the command reads, checked before a command runs: a value the library
would misread or fail on deep inside (``HYBRID_BACKEND=cuda`` on a CPU machine fails at the first attention
op) becomes one line naming the variable and what to set instead (see :mod:`.errors`).

Backends: a forced backend (``HYBRID_BACKEND``, ``hybrid eval --backend``) is used for *every* op that implements
it, or the op fails (kernels/dispatch.py never falls back silently), so it is usable on a device only when every
op that implements it can run it there."""

from __future__ import annotations

import os

from .errors import CLIError

SWITCHES = ("HYBRID_NATIVE", "HYBRID_KEEP_FREED_MEMORY", "HYBRID_HUGE_PAGES")
SWITCH_VALUES = ("1", "0", "true", "false", "yes", "no", "on", "off")


def backend_problem(name: str, device: str) -> str | None:
    """None when the kernel backend ``name`` can run every op that implements it on ``device`` (``cpu``,
    ``cuda:0``, ...), else why not (the first op's reason, as ``hybrid doctor`` gives it)."""
    import torch

    from ..kernels import dispatch

    if name not in dispatch.BACKENDS:
        return f"{name!r} is not a kernel backend; use one of {', '.join(dispatch.BACKENDS)}"
    device_type = torch.device(device).type
    for op in dispatch.ops():
        why = dispatch.why_not(op, name, device_type) if dispatch.implements(op, name) else None
        if why is not None:
            return f"the {name} backend cannot run {op} on {device_type} ({why})"
    return None


def check_backend(flag: str, name: str | None, device: str) -> None:
    """One line naming ``flag`` (``--backend`` or ``HYBRID_BACKEND``) when ``name`` cannot run on ``device``."""
    if not name:
        return
    why = backend_problem(name, device)
    if why is not None:
        raise CLIError(f"{flag}={name}: {why}; leave it out for the best available backend (`hybrid doctor` lists "
                       f"each op's backends here)")


def check_environment(device: str = "cpu", *, backend_usable: bool = True) -> None:
    """Every ``HYBRID_*`` variable the library reads, against what it accepts, for a command running on
    ``device``; one line naming the first that is wrong. ``backend_usable=False`` checks only that
    HYBRID_BACKEND names a backend (``hybrid doctor``, which reports why a backend cannot run here)."""
    for name in SWITCHES:
        value = os.environ.get(name)
        if value is not None and value.strip().lower() not in SWITCH_VALUES:
            raise CLIError(f"{name}={value!r} is not a switch; set it to 1 or 0 (or unset it)")
    from ..kernels.native import SPIN_ENV, spin_us

    if spin_us(os.environ.get(SPIN_ENV)) is None:
        raise CLIError(f"{SPIN_ENV}={os.environ[SPIN_ENV]!r} is not a whole number of microseconds >= 0; set it to "
                       f"e.g. 50 (or unset it)")
    cache = os.environ.get("HYBRID_CACHE_DIR")
    if cache and os.path.exists(cache) and not os.path.isdir(cache):
        raise CLIError(f"HYBRID_CACHE_DIR={cache!r} is a file, not a folder; point it at a folder (or unset it)")
    forced = os.environ.get("HYBRID_BACKEND")
    if backend_usable:
        check_backend("HYBRID_BACKEND", forced, device)
    elif forced:
        from ..kernels.dispatch import BACKENDS

        if forced not in BACKENDS:
            raise CLIError(f"HYBRID_BACKEND={forced!r} is not a kernel backend; use one of {', '.join(BACKENDS)} "
                           f"(or unset it)")
