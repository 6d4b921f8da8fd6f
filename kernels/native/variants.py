"""The native library's prebuilt variants, one per x86-64 instruction-set level, compiled when the package is built
(setup.py) and picked at import by the CPU's feature flags (:mod:`hybrid.kernels.native`), as ggml-cpu builds all
its variants and picks one at load. Standard library only: setup.py loads this file by its path, before torch or
the package can be imported.

A library's file name carries a hash of the C sources and its flags, so a library built from other sources (a
source checkout whose ``.c`` files changed since ``pip install -e .``) is never loaded as if it were current.

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
# the decode kernels, one file per op family (decode.c until it was split: the same text, in this order). No file
# #includes another: the library is one translation unit, so the ops stay static and program.c calls them directly.
# native.h comes first: the includes, the dtype codes and the vector types every part uses.
DECODE = ("native.h", "pool.c", "convert.c", "gemv.c", "amx.c", "int4.c", "ssd.c", "scan.c", "gated_delta.c", "conv.c",
          "attention.c", "sublayer.c", "int8_activation.c")
SOURCES = (*DECODE, "linear_attention.c", "program.c")  # one translation unit, in this order
# -fno-unsafe-math-optimizations under -ffast-math: no approximate reciprocals / rsqrt and no reassociated
# auto-vectorised sums, so the ops round where torch's do on every CPU (kernels/native/build.py says more).
COMPILE = ("-O3", "-ffast-math", "-fno-unsafe-math-optimizations", "-fPIC")
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


def source_text(src_dir: Path = HERE) -> str:
    """The translation unit: the decode program's op table (program_ops.py's generated header), then the sources."""
    decode = "".join((src_dir / f).read_text() for f in DECODE)
    return "\n".join([_program_ops(src_dir).header(), decode,
                      *((src_dir / f).read_text() for f in SOURCES[len(DECODE):])])


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
    """A hash of the sources and everything the variant is compiled with: part of its file name."""
    text = "\0".join([source_text(src_dir), variant.name, *variant.flags, *COMPILE, *LINK, *LIBS])
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


def compile_variant(variant: Variant, lib_dir: Path, src_dir: Path = HERE) -> Path:
    """Compile one variant into ``lib_dir`` (atomically: two builds of the same file lose nothing). Returns its
    path; BuildError with the compiler's message when it fails."""
    cc = compiler()
    if cc is None:
        raise BuildError("no C compiler (cc / gcc / clang, or $CC) on PATH")
    out = library_path(variant, src_dir, lib_dir)
    lib_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib_dir) as tmp:
        src, obj, so = (Path(tmp) / f"hybrid_decode{ext}" for ext in (".c", ".o", ".so"))
        src.write_text(source_text(src_dir))
        for cmd in ([cc, *COMPILE, *variant.flags, "-c", str(src), "-o", str(obj)],
                    [cc, *LINK, str(obj), "-o", str(so), *LIBS]):
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if res.returncode != 0:
                raise BuildError(f"{' '.join(cmd[:1] + list(variant.flags))} failed for the {variant.name} variant: "
                                 f"{res.stderr.strip()[-600:]}")
        os.replace(so, out)
    return out


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


def build_all(lib_dir: Path, variants: list[Variant], src_dir: Path = HERE, log=print) -> list[Path]:
    """Compile ``variants`` into ``lib_dir`` side by side (one compiler process each) and remove older builds."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(variants), os.cpu_count() or 1))) as ex:
        futures = {ex.submit(compile_variant, v, lib_dir, src_dir): v for v in variants}
        built = []
        for f in concurrent.futures.as_completed(futures):
            built.append(f.result())
            log(f"hybrid-lm: built the {futures[f].name} native library ({built[-1].name})")
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
