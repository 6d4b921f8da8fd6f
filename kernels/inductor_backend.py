"""The opt-in ``inductor`` backend: the SSD scan's elementwise chains fused by ``torch.compile`` (Inductor).

On a CPU the torch paths of the scans are bound by memory traffic: each elementwise op is one more pass
over work tensors that outgrow the caches. Inductor fuses those chains into generated C++/OpenMP loops
(matmuls and scans stay library calls), so a tensor that eager mode writes and reads back is never
materialised. Compiling costs seconds per shape (one per block shape: the ops pad their blocks to a few
fixed sizes), so the backend is never picked by default: ``HYBRID_BACKEND=inductor`` or
``kernels.use_backend("inductor")`` asks for it, for prefill. It is forward-only: with autograd on, the
ops take their torch path.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable

import torch


@functools.cache
def probe() -> str | None:
    """None when Inductor can compile here (it needs a C++ compiler for CPU code), else why not."""
    try:
        import torch._inductor  # noqa: F401
    except Exception as e:  # a broken install fails while importing
        return f"torch._inductor does not import ({type(e).__name__}: {e})"
    if not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++, c++ or clang++) on PATH, which Inductor needs for CPU code"
    return None


def compiled(fn: Callable) -> Callable:
    """``fn`` compiled once, lazily on its first call, for fixed shapes (each new shape compiles anew)."""
    holder: list[Callable] = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not holder:
            holder.append(torch.compile(fn, dynamic=False, fullgraph=True))
        return holder[0](*args, **kwargs)

    return call
