"""Build the native library with ``-march=native`` once per machine and load it with ctypes (the opt-in of those
who build from source, ``HYBRID_NATIVE_BUILD=native``; tests build variants with extra flags the same way).

The library lands in ``$HYBRID_CACHE_DIR`` (default ``~/.cache/hybrid-lm``) under a name keyed by the sources and
headers, the flags, the compiler's version and the CPU's feature flags (``-march=native`` code must never reach a
CPU without those instructions), compiled file by file as the prebuilt variants are (:func:`variants.compile_library`)
and written atomically so two processes building the same key lose nothing. A second process on the same machine
loads it in milliseconds: nothing is compiled per model or per shape.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from pathlib import Path

from . import variants

# -fno-unsafe-math-optimizations under -ffast-math: no approximate reciprocals / rsqrt (vrcp14/vrsqrt14 plus a Newton
# step, chosen for -march=native on AVX512 CPUs) and no reassociated auto-vectorised sums, so the ops round where
# torch's do on every CPU (the bf16 GLA sub-layer differed from eager in 5 of 192 outputs on a Xeon with AVX512);
# the products' inner loops are explicit vectors and keep their speed. The link (variants.LINK) is without
# -ffast-math: given it, GCC (before 13) links crtfastmath.o into a shared library, whose constructor sets
# flush-to-zero and denormals-are-zero in the thread that loads it, and torch's own ops there then flushed denormals
# (1e-39 * 1.0 gave 0) once our library was loaded.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-unsafe-math-optimizations", "-fPIC", "-fvisibility=hidden")


def compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    return Path(os.environ.get("HYBRID_CACHE_DIR") or Path.home() / ".cache" / "hybrid-lm")


def cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's feature flags."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def build(name: str, flags: tuple[str, ...] = FLAGS) -> tuple[ctypes.CDLL | None, str | None]:
    """The library (kernels/native's sources) compiled with ``flags``, loaded: (the library, None), or (None, why
    it could not be built or loaded)."""
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc / gcc) on PATH"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = variants.digest(variants.source_files(), (*flags, *variants.LINK, *variants.LIBS, version,
                                                        cpu_identity()))
        lib_path = cache_dir() / f"{name}_{key}.so"
        if not lib_path.is_file():
            variants.compile_library(cc, flags, lib_path, what=name)
        return ctypes.CDLL(str(lib_path)), None
    except variants.BuildError as e:
        return None, str(e)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building or loading {name} failed: {e}"
