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


def disabled_by_env(name: str = ENV) -> bool:
    """Whether the environment variable ``name`` (default ``HYBRID_KEEP_FREED_MEMORY``) says no (0, false, no,
    off)."""
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")


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


# ---- weights on 2 MiB pages ----------------------------------------------------------------------------------
# A decode step reads every weight once, 4 KiB page after 4 KiB page: llama-d512's bf16 step walks ~19,000 pages,
# more than the core's TLBs hold, so each page costs a page walk (on a VM a two-level one). On 2 MiB pages the
# same step walks ~40. Measured on the 2-vCPU Zen 4 VM (scratch A/B, the native batch-1 products of llama-d512's
# shapes, 20 alternating rounds in one process): bf16 31.1 -> 33.5 GB/s, fp32 30.1 -> 32.4 GB/s median. torch's
# allocator asks for huge pages only under THP_MEM_ALLOC_ENABLE=1, read once when the process starts and applied
# to every large tensor: a library cannot switch it for its own weights, so they move into a mapping of their own.
_HUGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14
HUGE_ENV = "HYBRID_HUGE_PAGES"


def _madvise():
    lib = _glibc()
    if lib is None or not hasattr(lib, "madvise"):
        return None
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
    return lib.madvise


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode (always / madvise / never), or why it is unknown."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unknown (no /sys/kernel/mm/transparent_hugepage)"


def huge_pages_unavailable() -> str | None:
    """None where :func:`huge_page_weights` can ask the kernel for 2 MiB pages, else why not."""
    if disabled_by_env(HUGE_ENV):
        return f"{HUGE_ENV}=0"
    mode = transparent_huge_pages()
    if mode not in ("always", "madvise"):
        return f"the kernel's transparent huge pages are {mode}"
    if _madvise() is None:
        return "madvise not reachable (not glibc)"
    return None


def _huge_arena(nbytes: int):
    """(a private anonymous mapping, the offset in it of ``nbytes`` the kernel was asked to back with 2 MiB pages
    from a 2 MiB boundary), or None where madvise refused."""
    import mmap

    # private: a shared anonymous mapping is shmem, whose huge pages follow shmem_enabled (usually never)
    span = -(-nbytes // _HUGE) * _HUGE  # whole huge pages (the last one's tail unused)
    arena = mmap.mmap(-1, span + _HUGE, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0))
    view = ctypes.c_char.from_buffer(arena)
    base = ctypes.addressof(view)
    del view  # (a live ctypes view would keep the mapping from ever being released)
    start = -base % _HUGE
    if _madvise()(base + start, span, _MADV_HUGEPAGE) != 0:
        arena.close()
        return None
    return arena, start


def huge_page_empty(numel: int, dtype):
    """An uninitialised 1-D CPU tensor of ``numel`` values on a mapping of its own backed by 2 MiB pages (a plain
    ``torch.empty`` where huge pages cannot be had): a buffer born there, where :func:`huge_page_weights` would
    copy one (the read-bandwidth probes' 512-1024 MiB)."""
    import torch

    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    got = _huge_arena(nbytes) if huge_pages_unavailable() is None else None
    if got is None:
        return torch.empty(numel, dtype=dtype)
    arena, start = got
    return torch.frombuffer(arena, dtype=dtype, count=numel, offset=start)  # keeps `arena` alive


def huge_page_weights(params) -> int:
    """Move each of ``params`` (plain contiguous CPU tensors: nn.Parameters or tensors whose ``.data`` may be set;
    others are skipped) into one anonymous mapping the kernel is asked to back with 2 MiB pages, each at a 4 KiB
    boundary; the values are unchanged (a copy), the old storage is freed once nothing else holds it. Returns the
    bytes moved: 0 where huge pages cannot be had (THP off, not Linux / glibc, ``HYBRID_HUGE_PAGES=0``)."""
    import torch

    if huge_pages_unavailable() is not None:
        return 0
    # plain tensors only: a tensor subclass (torchao's quantised weights) keeps its own inner tensors
    unique = [p for p in {id(p): p for p in params}.values() if type(p.data) is torch.Tensor]
    storages: dict[int, int] = {}
    for p in unique:
        ptr = p.data.untyped_storage().data_ptr()
        storages[ptr] = storages.get(ptr, 0) + 1
    todo = []
    for p in unique:
        t = p.data
        # whole storages only, held by one of params: a view into a larger tensor, or a storage two parameters
        # share, stays where it is (moving it would split what is shared)
        if (t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0
                or t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size()
                or storages[t.untyped_storage().data_ptr()] != 1):
            continue
        todo.append(p)
    if not todo:
        return 0
    offsets, total = [], 0
    for p in todo:
        offsets.append(total)
        total += -(-p.data.numel() * p.data.element_size() // 4096) * 4096
    got = _huge_arena(total)
    if got is None:
        return 0
    arena, start = got
    # each moved tensor of the kind it replaces: a normal tensor stays one even when this runs under inference mode
    # (the engine's step does; a model trained after it decoded must still save its weights for backward), and an
    # inference tensor (a model copied under inference mode) stays one (swapping a normal tensor in under it breaks
    # its version counter: "Inference tensors do not track version counter" at its next use)
    with torch.no_grad():
        for p, off in zip(todo, offsets, strict=True):
            t = p.data
            with torch.inference_mode(t.is_inference()):
                # frombuffer keeps `arena` alive for as long as any of these tensors lives
                moved = torch.frombuffer(arena, dtype=t.dtype, count=t.numel(), offset=start + off).view(t.shape)
                moved.copy_(t)
                p.data = moved
    return total


def huge_pages_note() -> str:
    """What ``hybrid doctor`` says about the decode weights' pages."""
    why = huge_pages_unavailable()
    if why is not None:
        return f"no ({why}): 4 KiB pages"
    return (f"yes, where the kernel has 2 MiB pages free (transparent huge pages: {transparent_huge_pages()}; "
            f"{HUGE_ENV}=0 turns it off)")
