"""The native library's prebuilt variants, one per x86-64 instruction-set level, compiled when the package is built
(setup.py) and picked at import by the CPU's feature flags (:mod:`hybrid.kernels.native`), as ggml-cpu builds all
its variants and picks one at load. Standard library only: setup.py loads this file by its path, before torch or
the package can be imported.

Each ``.c`` file (:data:`SOURCES`, one per op family) is compiled on its own and the objects linked into the
variant's library. A library's file name carries a hash of every ``.c`` and ``.h`` file, the generated op-table
header and the flags, so a library built from other sources (a source checkout whose files changed since ``pip
install -e .``) is never loaded as if it were current.

    python kernels/native/variants.py --inplace          # this CPU's best variant, into kernels/native/_lib
    python kernels/native/variants.py --inplace --all    # every variant (what the wheel ships)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIB_DIR = "_lib"  # beside this file, in the source tree and in the installed package alike
# The library's translation units, one file per op family; each #includes native.h (and simd.h, gemv.h, products.h
# as it needs), is compiled on its own (in parallel) and the objects are linked into one shared library. A new
# family file is added here (tests/test_native_build.py fails on a .c file this list lacks).
SOURCES = ("pool.c", "convert.c", "amx.c", "int4.c", "ssd.c", "scan.c", "gated_delta.c", "conv.c", "attention.c",
           "sublayer.c", "int8_activation.c", "linear_attention.c", "program.c")
# written into the build directory by program_ops.py at every build (never edited by hand): the decode program's op
# codes and field slots, #included by program.c
GENERATED = "program_ops.h"
# -fno-unsafe-math-optimizations under -ffast-math: no approximate reciprocals / rsqrt and no reassociated
# auto-vectorised sums, so the ops round where torch's do on every CPU (kernels/native/build.py says more).
# -fvisibility=hidden: only the entry points native.h marks HL_API are exported (what Python's ctypes declares).
COMPILE = ("-O3", "-ffast-math", "-fno-unsafe-math-optimizations", "-fPIC", "-fvisibility=hidden")
# linked without -ffast-math: GCC (before 13) would link crtfastmath.o into the library, whose constructor sets
# flush-to-zero in the thread that loads it, and torch's own ops there then flushed denormals.
LINK = ("-shared",)
LIBS = ("-lm", "-lpthread")
VARIANTS_ENV = "HYBRID_NATIVE_VARIANTS"  # at build time: a comma list of variant names to build, or "none"


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]
    needs: frozenset[str]  # /proc/cpuinfo flags a CPU must have to run it
    note: str


# each level's flags include the level below's: a CPU that runs a variant runs every variant after it
_V3 = frozenset({"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
VARIANTS = (  # best first
    Variant("avx512-bf16", ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi", "-mamx-tile",
                            "-mamx-bf16", "-mamx-int8"),
            _V4 | {"avx512_bf16", "avx512_vnni", "avx512vbmi"},
            "AVX-512 with BF16 dot products and VNNI (Cooper Lake, Sapphire Rapids and later, Zen 4 and later); the "
            "AMX tile unit where the CPU has it and Linux grants it (checked at run time)"),
    Variant("x86-64-v4", ("-march=x86-64-v4",), _V4, "AVX-512 F/BW/CD/DQ/VL (Skylake-SP, Ice Lake)"),
    Variant("x86-64-v3", ("-march=x86-64-v3",), _V3, "AVX2 and FMA (Haswell, Zen 1 and later)"),
)
BY_NAME = {v.name: v for v in VARIANTS}


def headers(src_dir: Path = HERE) -> list[str]:
    """The hand-written headers beside the sources (every one a source may #include)."""
    return sorted(p.name for p in src_dir.glob("*.h"))


def generated(src_dir: Path = HERE) -> dict[str, str]:
    """The headers a build writes beside its objects: {name: text} (program_ops.py's op table)."""
    return {GENERATED: _program_ops(src_dir).header()}


def source_files(src_dir: Path = HERE) -> dict[str, str]:
    """Everything a build compiles, by file name: the .c files, the headers, the generated header."""
    files = {name: (src_dir / name).read_text() for name in (*SOURCES, *headers(src_dir))}
    return {**files, **generated(src_dir)}


def _program_ops(src_dir: Path):
    """program_ops.py beside the sources, loaded by its path (no package import: setup.py runs this before torch)."""
    import importlib.util

    path = src_dir / "program_ops.py"
    spec = importlib.util.spec_from_file_location(f"_hybrid_program_ops_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses looks the module up)
    spec.loader.exec_module(module)
    return module


def key(variant: Variant, src_dir: Path = HERE) -> str:
    """A hash of every source and header and everything the variant is compiled with: part of its file name."""
    return digest(source_files(src_dir), (variant.name, *variant.flags, *COMPILE, *LINK, *LIBS))


def digest(files: dict[str, str], flags: tuple[str, ...]) -> str:
    text = "\0".join([*(f"{name}\0{files[name]}" for name in sorted(files)), *flags])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def library_path(variant: Variant, src_dir: Path = HERE, lib_dir: Path | None = None) -> Path:
    return (lib_dir or src_dir / LIB_DIR) / f"hybrid_decode-{variant.name}-{key(variant, src_dir)}.so"


def cpu_flags() -> frozenset[str] | None:
    """This CPU's feature flags from /proc/cpuinfo (Linux), or None where unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def runnable(flags: frozenset[str]) -> list[Variant]:
    """The variants a CPU with these flags runs, best first."""
    return [v for v in VARIANTS if v.needs <= flags]


def why_not_buildable() -> str | None:
    """None where the variants compile here, else why not (one line)."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return (f"the native kernels are written for x86-64 (AVX2 / AVX-512); this is {platform.machine()}, so none "
                "is built and torch's kernels run")
    if sys.platform not in ("linux", "darwin"):
        return f"the native kernels build on Linux and macOS; this is {sys.platform}"
    if compiler() is None:
        return "no C compiler (cc / gcc / clang, or $CC) on PATH"
    return None


def compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc.split()[0])
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


class BuildError(RuntimeError):
    pass


def compile_library(cc: str, flags: tuple[str, ...], out: Path, src_dir: Path = HERE, what: str = "the library",
                    jobs: int | None = None) -> Path:
    """Compile each of :data:`SOURCES` on its own with ``flags`` (``jobs`` compiler processes at once; default: one
    per CPU), link the objects into ``out`` (atomically: two builds of the same file lose nothing). Returns ``out``;
    BuildError with the compiler's message when a step fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp = Path(tmp)
        for name, text in generated(src_dir).items():
            (tmp / name).write_text(text)

        def run(cmd: list[str], step: str) -> None:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if res.returncode != 0:
                raise BuildError(f"{step} failed for {what} ({' '.join(f for f in flags if f.startswith('-m'))}): "
                                 f"{res.stderr.strip()[-600:]}")

        objects = [tmp / f"{Path(name).stem}.o" for name in SOURCES]
        workers = max(1, min(len(SOURCES), jobs or os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as ex:
            # (-I tmp: the generated header; the sources' own headers are found beside them)
            futures = [ex.submit(run, [cc, *flags, f"-I{tmp}", "-c", str(src_dir / name), "-o", str(obj)],
                                 f"compiling {name}") for name, obj in zip(SOURCES, objects, strict=True)]
            try:
                for f in futures:
                    f.result()
            except BuildError:
                ex.shutdown(cancel_futures=True)  # the first error is the one to read: no more files
                raise
        so = tmp / "library.so"
        run([cc, *LINK, *map(str, objects), "-o", str(so), *LIBS], "linking")
        os.replace(so, out)
    return out


def compile_variant(variant: Variant, lib_dir: Path, src_dir: Path = HERE, jobs: int | None = None) -> Path:
    """Compile one variant into ``lib_dir``. Returns its path; BuildError with the compiler's message when it
    fails."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (cc / gcc / clang, or $CC) on PATH")
    return compile_library(cc, (*COMPILE, *variant.flags), library_path(variant, src_dir, lib_dir), src_dir,
                           f"the {variant.name} variant", jobs)


def remove_stale(lib_dir: Path, src_dir: Path = HERE) -> None:
    """Libraries of earlier sources (other hashes) in ``lib_dir``: removed; every variant's current one kept."""
    keep = {library_path(v, src_dir, lib_dir).name for v in VARIANTS}
    for p in lib_dir.glob("hybrid_decode-*.so"):
        if p.name not in keep:
            p.unlink(missing_ok=True)


def requested() -> list[Variant]:
    """The variants a package build compiles: all, or those named in $HYBRID_NATIVE_VARIANTS ("none": none)."""
    names = os.environ.get(VARIANTS_ENV, "").strip()
    if not names:
        return list(VARIANTS)
    if names.lower() == "none":
        return []
    unknown = [n for n in names.split(",") if n.strip() not in BY_NAME]
    if unknown:
        raise BuildError(f"{VARIANTS_ENV}={names}: unknown variant(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(BY_NAME)} or 'none'")
    return [BY_NAME[n.strip()] for n in names.split(",")]


def build_all(lib_dir: Path, variants: list[Variant], src_dir: Path = HERE, log=print,
              reuse_from: Path | None = None) -> list[Path]:
    """Compile ``variants`` into ``lib_dir`` one after another (each one's files in parallel) and remove older
    builds. A library of the same name in ``reuse_from`` (the source tree's ``_lib``, which an editable install
    fills) was built from these very sources and flags (:func:`key` is part of the name), and is copied instead."""
    built = []
    for v in variants:
        target = library_path(v, src_dir, lib_dir)
        ready = reuse_from / target.name if reuse_from is not None else None
        if ready is not None and ready.is_file() and ready.resolve() != target.resolve():
            lib_dir.mkdir(parents=True, exist_ok=True)
            built.append(Path(shutil.copy2(ready, target)))
            log(f"hybrid-lm: reused the {v.name} native library built from the same sources ({built[-1].name})")
            continue
        built.append(compile_variant(v, lib_dir, src_dir))
        log(f"hybrid-lm: built the {v.name} native library ({built[-1].name})")
    remove_stale(lib_dir, src_dir)
    return built


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inplace", action="store_true", required=True,
                    help=f"build into {HERE / LIB_DIR} (the source tree's own, what an editable install loads)")
    ap.add_argument("--all", action="store_true", help="every variant, not only the best this CPU runs")
    args = ap.parse_args(argv)
    why = why_not_buildable()
    if why is not None:
        print(f"hybrid-lm: {why}", file=sys.stderr)
        return 1
    flags = cpu_flags()
    chosen = list(VARIANTS) if args.all or flags is None else runnable(flags)[:1]
    if not chosen:
        print("hybrid-lm: this CPU runs none of the variants (it lacks AVX2)", file=sys.stderr)
        return 1
    build_all(HERE / LIB_DIR, chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
