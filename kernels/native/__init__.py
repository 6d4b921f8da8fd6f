"""Our own C kernels for a CPU, called through ctypes: the ``native`` dispatch backend. The C sources (one file per
op family, :data:`variants.SOURCES`: the products, the state steps, paged attention, the decode program, the thread
pool; each its own translation unit, sharing native.h and the headers beside it) make one library; the decode
step's matrix-vector products run at the memory bandwidth.

The library is compiled when the package is built (setup.py), once per x86-64 level (:mod:`.variants`:
``x86-64-v3`` AVX2, ``x86-64-v4`` AVX-512, ``avx512-bf16`` AVX-512 BF16/VNNI/AMX), into ``_lib/`` beside this
file; the import loads the best one this CPU runs (its /proc/cpuinfo flags). Nothing is compiled on the user's
machine, but in a source checkout whose C files changed since the install (the library of these sources missing):
there the chosen variant is compiled once, in place. ``HYBRID_NATIVE_BUILD=native`` compiles with
``-march=native`` for this CPU at first use instead (:mod:`.build`, a per-machine cache: for those who build
from source); ``HYBRID_NATIVE_VARIANT=<name>`` loads that variant; ``HYBRID_NATIVE=0`` turns the backend off.
Where no library loads (another architecture, no variant built) torch's kernels run, :func:`available` says why,
a warning says so once, and ``hybrid doctor`` shows it."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from . import variants
from .build import FLAGS, build

ENV = "HYBRID_NATIVE"
BUILD_ENV = "HYBRID_NATIVE_BUILD"  # "native": compile with -march=native at first use (source builds)
VARIANT_ENV = "HYBRID_NATIVE_VARIANT"  # load this variant (x86-64-v3, x86-64-v4, avx512-bf16), not the best
# microseconds a worker spins after a call before it sleeps on its futex. Measured on the 2-vCPU machine of this
# project (llama-d512 fp32 decode step, median): no spin 14.5 ms, 50 us 17.1 ms, 20 ms 20.0 ms: a spinning
# worker slowed the Python between the products more than its wake-ups cost; a dedicated machine may prefer
# some (HYBRID_NATIVE_SPIN_US).
SPIN_ENV = "HYBRID_NATIVE_SPIN_US"


def spin_us(raw: str | None) -> int | None:
    """``HYBRID_NATIVE_SPIN_US`` as microseconds >= 0 (unset: 0), or None when it is not one."""
    try:
        value = int(raw if raw is not None else "0")
    except ValueError:
        return None
    return value if value >= 0 else None


# read at import: a bad value must not break `import hybrid` (the CLI refuses it in one line before a command runs)
SPIN = spin_us(os.environ.get(SPIN_ENV))
if SPIN is None:
    warnings.warn(f"{SPIN_ENV}={os.environ.get(SPIN_ENV)!r} is not a whole number of microseconds >= 0; using 0",
                  stacklevel=2)
    SPIN = 0
MAX_ROWS = 64  # input rows one product takes (decode batches up to this; larger ones go through torch's GEMM)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}


def _disabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off")


_loaded = [None]  # what the library is: a variant's name, or "-march=native"


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    if _disabled():
        return None, f"{ENV}=0"
    if os.environ.get(BUILD_ENV, "").strip().lower() == "native":
        lib, why = build("hybrid_decode", FLAGS)
        _loaded[0] = "-march=native (HYBRID_NATIVE_BUILD=native)" if lib is not None else None
    else:
        lib, why = _prebuilt()
    if lib is None:
        warnings.warn(f"hybrid-lm: the native CPU kernels are not in use ({why}); torch's kernels run instead, "
                      "several times slower at decode (`hybrid doctor` shows this)", RuntimeWarning, stacklevel=3)
        return None, why
    return _declare(lib), None


def _source_tree() -> bool:
    """Whether this is the repository's own kernels/native (an editable install), not an installed package."""
    return (Path(__file__).resolve().parents[2] / "pyproject.toml").is_file()


def _cpu_flags() -> frozenset[str]:
    """/proc/cpuinfo's flags; where there is none, the variant torch's own dispatch picked here."""
    flags = variants.cpu_flags()
    if flags is not None:
        return flags
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    cap = torch.backends.cpu.get_cpu_capability()
    return variants.BY_NAME["x86-64-v4"].needs if "AVX512" in cap else \
        variants.BY_NAME["x86-64-v3"].needs if cap == "AVX2" else frozenset()


def _prebuilt() -> tuple[ctypes.CDLL | None, str | None]:
    """The best prebuilt variant this CPU runs (or $HYBRID_NATIVE_VARIANT's), loaded; else (None, why)."""
    forced = os.environ.get(VARIANT_ENV, "").strip()
    runs = variants.runnable(_cpu_flags())
    if forced:
        if forced not in variants.BY_NAME:
            return None, f"{VARIANT_ENV}={forced} names no variant; choose one of {', '.join(variants.BY_NAME)}"
        if variants.BY_NAME[forced] not in runs:
            return None, f"{VARIANT_ENV}={forced}: this CPU lacks its instructions ({variants.BY_NAME[forced].note})"
        runs = [variants.BY_NAME[forced]]
    if not runs:
        return None, (f"no native variant runs on this CPU ({platform.machine()}): they are built for x86-64 with "
                      "AVX2 or later")
    try:
        return load_variant(runs[0].name, threads=None), None
    except (OSError, RuntimeError) as e:
        return None, str(e)


def load_variant(name: str, threads: int | None = 2) -> ctypes.CDLL:
    """The prebuilt library of variant ``name`` (:data:`variants.VARIANTS`), its functions declared, its pool on
    ``threads`` threads (None: left to :func:`library`); in a source checkout whose sources it was not built from,
    compiled in place first. RuntimeError saying what is missing where it cannot be loaded. Tests load the
    variants this CPU can run beside the library in use."""
    v = variants.BY_NAME[name]
    path = variants.library_path(v)
    if not path.is_file():
        if not _source_tree():
            raise RuntimeError(f"the installed package has no {name} native library ({path.name} in {path.parent}): "
                               "reinstall hybrid-lm from a wheel built with its native variants, or set "
                               f"{BUILD_ENV}=native to compile one for this CPU (needs a C compiler)")
        why = variants.why_not_buildable()
        if why is not None:
            raise RuntimeError(f"no {name} native library built for these sources in {path.parent} and {why}: "
                               "run `pip install -e .` where a compiler is")
        print(f"hybrid-lm: compiling the {name} native library for the edited C sources in {path.parent} "
              "(once; `pip install -e .` builds them at install)", file=sys.stderr)
        try:
            variants.compile_variant(v, path.parent)
        except variants.BuildError as e:
            raise RuntimeError(str(e)) from None
        variants.remove_stale(path.parent)
    lib = _declare(ctypes.CDLL(str(path)))
    if threads is not None:
        lib.hl_set_threads(threads, 0)
    else:
        _loaded[0] = name
    return lib


def variant() -> str | None:
    """Which library runs the native kernels: a variant's name (:data:`variants.VARIANTS`), the -march=native
    build, or None where none is loaded."""
    _library()
    return _loaded[0]


def build_variant(name: str, extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    """The library built with ``extra_flags`` too (e.g. ``-mno-avx512f``: what a CPU without AVX-512 runs), its
    functions declared as the library's are, its pool on 2 threads: for tests of code paths this CPU would not
    take. RuntimeError when it does not build."""
    lib, why = build(f"hybrid_decode_{name}", (*FLAGS, *extra_flags))
    if lib is None:
        raise RuntimeError(f"the {name} build of the native kernels failed: {why}")
    _declare(lib).hl_set_threads(2, 0)
    return lib


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib``'s functions with their ctypes signatures (one list for the library and any variant build)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.hl_set_threads.argtypes, lib.hl_set_threads.restype = [i32, i64], i32
    lib.hl_set_stream_prefetch.argtypes, lib.hl_set_stream_prefetch.restype = [i32], i32
    lib.hl_gemv.argtypes = [p, i32, p, p, i32, p, i32, p, p, i32, i64, i64, i64]
    lib.hl_gemv.restype = i32
    lib.hl_gemv_int4.argtypes = [p, p, i32, i64, p, i32, p, i32, p, p, i32, i64, i64, i64, i32]
    lib.hl_gemv_int4.restype = i32
    lib.hl_gemv_q.argtypes, lib.hl_gemv_q.restype = [i32, p, p, p, i32, p, i32, p, p, i32, i64, i64, i64], i32
    lib.hl_ssd_step.argtypes = [p, i32, p, p, i32, i64, p, i64, p, p, i64, p, i64, p, i32, p, i64, i64, i64, i64, i64]
    lib.hl_conv_step.argtypes = [p, i32, p, p, i32, i64, p, i32, p, i32, i32, p, i64, i64, i64]
    lib.hl_paged_decode.argtypes = [p, i32, p, p, i32, p, p, i64, p, i64, i64, i64, i64, i64, i64, ctypes.c_float]
    f32 = ctypes.c_float
    lib.hl_gdn_step.argtypes = [p, i32, p, p, p, i64, p, i32, i64, p, p, i64, f32, p, i64, i64, i64, i64, i64]
    lib.hl_rmsnorm.argtypes = [p, i32, p, i32, f32, p, i64, i64]
    lib.hl_gated_up.argtypes = [p, p, p, p, p, p, i32, i32, p, i32, p, i32, i64, i64, i64]
    lib.hl_qkv_rope.argtypes = [p, p, p, p, p, p, p, p, p, i32, i32, p, i32, p, p, p, i32, p, p, p, i64, i64, i64,
                                i64, i64, i64]
    lib.hl_program_run.argtypes, lib.hl_program_run.restype = [p, i64, p, p], i64
    lib.hl_stream_read.argtypes, lib.hl_stream_read.restype = [p, i64], i64
    lib.hl_program_solo_runs.argtypes, lib.hl_program_solo_runs.restype = [], i64
    lib.hl_program_steps.argtypes, lib.hl_program_steps.restype = [p, i64, p, p, i64, i64, p, i32, i64, p], i64
    lib.hl_program_abi.argtypes, lib.hl_program_abi.restype = [], i64
    lib.hl_cpu_paths.argtypes, lib.hl_cpu_paths.restype = [], i32
    lib.hl_argmax.argtypes, lib.hl_argmax.restype = [p, i32, i64, i64, p], None
    lib.hl_gated_rmsnorm.argtypes = [p, p, i64, i32, p, i32, f32, i64, i32, p, i64, i64]
    lib.hl_mamba2_dt.argtypes = [p, i32, i64, p, i32, p, i32, f32, f32, i32, p, p, i64, i64]
    lib.hl_gla_step.argtypes = [p, i32, p, p, i64, p, i64, p, i64, i32, p, i64, f32, p, i64, i64, i64, i64, i64]
    lib.hl_gla_step.restype = i32
    lib.hl_l2norm_heads.argtypes = [p, i64, i32, p, i64, i64, i64, i64, f32]
    lib.hl_gdn_gates.argtypes = [p, i64, p, i64, i32, p, i32, p, i32, p, p, i64, i64]
    lib.hl_gla_decay.argtypes = [p, i32, p, i64, f32, f32, i32]
    lib.hl_gdn_ut_solve.argtypes = [p, p, i64, i64, i64]
    lib.hl_gdn_chunk_prep.argtypes = [p, p, p, p, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64]
    lib.hl_selective_scan.argtypes = [p, i32, i64, p, i32, i64, p, p, i32, i64, p, i32, i64, p, p, p, i32, i64, p, i64,
                                      i64, i64]
    for fn in (lib.hl_l2norm_heads, lib.hl_gdn_gates, lib.hl_gla_decay, lib.hl_gdn_ut_solve):
        fn.restype = None
    for fn in (lib.hl_ssd_step, lib.hl_gdn_step, lib.hl_conv_step, lib.hl_paged_decode, lib.hl_gated_up,
               lib.hl_qkv_rope, lib.hl_gdn_chunk_prep, lib.hl_selective_scan):
        fn.restype = i32
    for fn in (lib.hl_rmsnorm, lib.hl_gated_rmsnorm, lib.hl_mamba2_dt):
        fn.restype = None
    return lib


@functools.cache
def l3_bytes() -> int:
    """The last-level cache of CPU 0 in bytes (Linux sysfs), 0 where unknown."""
    sizes = {}
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, kind, size = ((d / f).read_text().strip() for f in ("level", "type", "size"))
        except OSError:
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        if kind in ("Unified", "Data") and size.rstrip("KMG").isdigit():
            sizes[int(level)] = int(size.rstrip("KMG")) * mult
    return sizes[max(sizes)] if sizes else 0


def streams_from_memory(weight_bytes: int) -> bool:
    """Whether a decode step's weights (``weight_bytes`` read every step) come from DRAM each step, so the
    products should prefetch them ahead (pool.c's STREAM_PREFETCH), rather than staying in the last-level cache
    between steps (up to a quarter of it: the K/V, states and everything else share it, and a VM's L3 is the host
    socket's, shared with other guests). Unknown cache size: from memory. Half of it was the bound before; on the
    2-vCPU Xeon (a 300 MiB L3, the host busy) the prefetch won or tied at every size between a quarter and a half,
    one thread, alternating in one process: SmolLM2-135M int8dq (129 MiB, its head quantised) 8.5 / 10.8 ms
    min / median with it against 14.0 / 16.2 without, llama-d512 bf16 (74 MiB) 3.0 / 3.2 against 3.4 / 5.2,
    mamba2-d512 fp32 (115 MiB) 4.8 / 5.2 against 5.0 / 5.3."""
    l3 = l3_bytes()
    return l3 == 0 or weight_bytes > l3 // 4


_stream = [None]


def set_stream_prefetch(on: bool) -> None:
    """The products' weight prefetch on or off (pool.c's P_stream; process-wide, so the decode
    program sets it for its model before each step; a call only when it changes)."""
    if _stream[0] is not on:
        library().hl_set_stream_prefetch(int(on))
        _stream[0] = on


def available() -> str | None:
    """None when the native kernels can run here, else why not."""
    return _library()[1]


_PATHS = ((1, "AVX2"), (2, "AVX-512"), (4, "AVX512-BF16 vdpbf16ps"), (8, "AVX512-VNNI vpdpbusd"),
          (16, "AMX tile unit (batched bf16 products)"))


def cpu_paths() -> list[str]:
    """The instruction paths the native library was built with on this CPU (the AMX tile unit only where Linux
    granted it and HYBRID_NO_AMX is not set); empty when the library is not available."""
    lib, why = _library()
    if why is not None:
        return []
    bits = lib.hl_cpu_paths()
    return [name for bit, name in _PATHS if bits & bit]


_threads = [0]
_owned = [0]  # torch's thread count while a decode step holds it (torch itself runs on one meanwhile)


_using = [None]  # a library using_library() put in place of the loaded one


@contextlib.contextmanager
def using_library(lib: ctypes.CDLL):
    """The ops (torch.ops.hybrid.*, kernels/native/ops.py) call ``lib`` inside the block (this process): tests run
    the public ops on every variant this CPU runs (:func:`load_variant`), the AVX2 one on an AVX-512 machine too.
    ``lib``'s pool keeps the threads it was loaded with."""
    prev, _using[0] = _using[0], lib
    try:
        yield lib
    finally:
        _using[0] = prev


def library() -> ctypes.CDLL:
    """The loaded library, its pool sized to torch's intra-op thread count (re-sized when that changes), or to
    the count :func:`owns_threads` took over; inside :func:`using_library`, that block's library."""
    if _using[0] is not None:
        return _using[0]
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the native kernels are unavailable: {why}")
    n = _owned[0] or torch.get_num_threads()
    if n != _threads[0]:
        _threads[0] = lib.hl_set_threads(n, SPIN)
    return lib


@contextlib.contextmanager
def owns_threads():
    """For a block of native-heavy work (a fused decode step): the native pool takes torch's intra-op threads
    and torch runs its few small ops on one. Two thread teams on the same cores, each spinning after its work,
    took turns at them (llama-d512 fp32, 2 threads: 16.9 ms a step, 13.2 with OMP_WAIT_POLICY=passive, 14.4
    on one thread alone)."""
    from .. import dispatch

    n = torch.get_num_threads()
    # only when the native kernels run (HYBRID_BACKEND=torch: torch keeps its threads)
    if n == 1 or _owned[0] or dispatch.choose("linear", "cpu")[0] != "native":
        yield
        return
    _owned[0] = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _owned[0] = 0


def read_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes per second of a streaming read of a ``mib`` MiB buffer (far larger than any L3) by the native pool on
    torch's intra-op threads, the way the decode products read their weights (on 2 MiB pages where the decode
    program puts them: kernels.host_memory.huge_page_weights): the best of ``repeats``."""
    from ..host_memory import huge_page_empty

    buf = huge_page_empty(mib * 2**20 // 8, torch.int64).fill_(1)
    with owns_threads():
        lib = library()  # the pool sized to the threads it now holds
        lib.hl_stream_read(buf.data_ptr(), buf.numel() * 8)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            lib.hl_stream_read(buf.data_ptr(), buf.numel() * 8)
            best = min(best, time.perf_counter() - t0)
    return buf.numel() * 8 / best


def solo_runs() -> int:
    """Decode programs run on the calling thread alone since the library loaded: after a step that spent a quarter of
    its time waiting for workers another process kept off their cores, the next 32 (4 for steps of more than 8
    rows) run without them (kernels/native/program.c)."""
    return int(library().hl_program_solo_runs())


def argmax_supports(logits: torch.Tensor) -> bool:
    """Whether :func:`argmax` takes these logits: contiguous fp32/bf16 rows [n, V] on the CPU, the native backend
    chosen (``HYBRID_BACKEND=torch`` keeps torch's)."""
    from .. import dispatch

    return (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.is_contiguous() and logits.shape[1] > 0 and not torch.compiler.is_compiling()
            and dispatch.choose("linear", "cpu")[0] == "native")


def argmax(logits: torch.Tensor) -> list[int]:
    """``logits.argmax(-1).tolist()`` for contiguous fp32/bf16 rows (torch's takes ~74 us a 32000-wide row)."""
    n, V = logits.shape
    out = (ctypes.c_int64 * n)()
    library().hl_argmax(logits.data_ptr(), DTYPE_CODES[logits.dtype], n, V, out)
    return list(out)
