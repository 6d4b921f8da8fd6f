"""Keep freed host memory for reuse instead of handing it back to the kernel (glibc malloc).

torch's CPU tensors come from ``malloc``. glibc serves every block above its mmap threshold (128 KiB,
raised on the fly up to at most 32 MiB) with a fresh ``mmap`` and gives it back with ``munmap`` on free, so
each large temporary of a forward pass (an in_proj output, an MLP activation, a chunk of attention scores)
is new memory that the kernel zero-fills page by page on first touch. Measured here (hybrid-1to7-small, one
8K-token forward, 1 thread, ``python -m hybrid.eval.host_memory_bench --lengths 8192 --threads 1``): 731K page
faults and 2.5 s of system time in a 26 s forward; with freed memory kept, 61K faults, 0.2 s, the forward 1.06x
faster and the resident set 230 MB larger (its high-water mark). At 2K: 63K faults, 0.27 s against 3K, 0.02 s.
llama.cpp never pays this (ggml plans its compute buffers once); jemalloc / tcmalloc under ``LD_PRELOAD``
avoid it too, but cannot be switched on from inside a running Python process, while ``mallopt`` can.

:func:`keep_freed_memory` turns mmap off for allocations (``M_MMAP_MAX = 0``: every block comes from the
heap) and stops trimming the heap's top (``M_TRIM_THRESHOLD``), so a freed block is reused, already mapped,
by the next allocation of its size. The cost: the process keeps its high-water mark of memory (it no longer
shrinks after a large prompt) — what a server or a benchmark wants, and what a library should not impose on
its host. So the ``hybrid`` CLI and the benchmarks (which own their process) call it; library users opt in.
``HYBRID_KEEP_FREED_MEMORY=0`` in the environment turns it off everywhere it is called.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_GLIBC_MMAP_MAX = 65536  # glibc's default M_MMAP_MAX
_GLIBC_TRIM = 128 * 1024  # glibc's default M_TRIM_THRESHOLD
_GLIBC_MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # the largest mmap threshold glibc accepts on 64-bit hosts
_KEEP_TRIM = 2**31 - 1  # mallopt takes an int: trim only a free top above 2 GiB
ENV = "HYBRID_KEEP_FREED_MEMORY"

_libc = None
_state = {"keep": False}


def _glibc():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.gnu_get_libc_version.restype = ctypes.c_char_p
            lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
            lib.malloc_trim.argtypes = [ctypes.c_size_t]
            _libc = lib
        except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to tune
            _libc = False
    return _libc or None


def available() -> str | None:
    """None where :func:`keep_freed_memory` can work (glibc), else why not."""
    if _glibc() is not None:
        return None
    return "the C library is not glibc (no mallopt): freed memory is up to the allocator in use"


def disabled_by_env() -> bool:
    """Whether ``HYBRID_KEEP_FREED_MEMORY`` says no (0, false, no, off)."""
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")


def keep_freed_memory(enabled: bool = True, *, respect_env: bool = True) -> bool:
    """Keep freed memory mapped for reuse (``enabled``), or go back to glibc's behaviour at its most
    conservative: mmap for blocks above 32 MiB (the top of its dynamic threshold), the heap trimmed and what
    is free now handed back. Returns whether freed memory is kept now. A no-op off glibc, and (with
    ``respect_env``) when ``HYBRID_KEEP_FREED_MEMORY=0``."""
    lib = _glibc()
    if lib is None or (enabled and respect_env and disabled_by_env()):
        return _state["keep"]
    if enabled:
        ok = lib.mallopt(_M_MMAP_MAX, 0) and lib.mallopt(_M_TRIM_THRESHOLD, _KEEP_TRIM)
    else:
        ok = (lib.mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX) and lib.mallopt(_M_TRIM_THRESHOLD, _GLIBC_TRIM)
              and lib.mallopt(_M_MMAP_THRESHOLD, _GLIBC_MMAP_THRESHOLD_MAX))
        lib.malloc_trim(0)
    if not ok:
        raise RuntimeError("mallopt refused a setting; glibc's malloc tunables are not what this module expects")
    _state["keep"] = enabled
    return enabled


def keeping() -> bool:
    """Whether this process keeps freed memory (set through this module)."""
    return _state["keep"]
