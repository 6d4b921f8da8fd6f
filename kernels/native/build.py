"""Build a C source file of this package into a shared library once per machine and load it with ctypes.

The library lands in ``$HYBRID_CACHE_DIR`` (default ``~/.cache/hybrid-lm``) under a name keyed by the source,
the flags, the compiler's version and the CPU's feature flags (``-march=native`` code must never reach a CPU
without those instructions), written atomically so two processes building the same key lose nothing. A
second process on the same machine loads it in milliseconds: nothing is compiled per model or per shape.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# -fno-unsafe-math-optimizations under -ffast-math: no approximate reciprocals / rsqrt (vrcp14/vrsqrt14 plus a Newton
# step, chosen for -march=native on AVX512 CPUs) and no reassociated auto-vectorised sums, so the ops round where
# torch's do on every CPU (the bf16 GLA sub-layer differed from eager in 5 of 192 outputs on a Xeon with AVX512);
# the products' inner loops are explicit vectors and keep their speed.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-unsafe-math-optimizations", "-fPIC", "-shared")
# Compiled and linked in two steps, the link without -ffast-math: given it, GCC (before 13) links crtfastmath.o
# into a shared library, whose constructor sets flush-to-zero and denormals-are-zero in the thread that loads it,
# and torch's own ops there then flushed denormals (1e-39 * 1.0 gave 0) once our library was loaded.
_LINK = ("-shared",)


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


def build(name: str, source: str, flags: tuple[str, ...] = FLAGS, libs: tuple[str, ...] = ("-lm",)
          ) -> tuple[ctypes.CDLL | None, str | None]:
    """(the loaded library, None), or (None, why it could not be built or loaded)."""
    cc = compiler()
    if cc is None:
        return None, "no C compiler (cc / gcc) on PATH"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([source, " ".join(flags), " ".join(_LINK), " ".join(libs), version,
                                        cpu_identity()]).encode()).hexdigest()[:16]
        lib_path = cache_dir() / f"{name}_{key}.so"
        if not lib_path.is_file():
            lib_path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib_path.parent) as tmp:
                src, obj, out = (Path(tmp) / f"{name}{ext}" for ext in (".c", ".o", ".so"))
                src.write_text(source)
                compile_flags = [f for f in flags if f not in _LINK]
                for cmd in ([cc, *compile_flags, "-c", str(src), "-o", str(obj)],
                            [cc, *_LINK, str(obj), "-o", str(out), *libs]):
                    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
                    if res.returncode != 0:
                        return None, f"{cc} failed: {res.stderr.strip()[-300:]}"
                os.replace(out, lib_path)
        return ctypes.CDLL(str(lib_path)), None
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building or loading {name} failed: {e}"
