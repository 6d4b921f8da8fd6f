"""The native library's build (kernels/native/variants.py): each .c file is a translation unit of its own that
compiles with only its #includes, on every variant; the library exports exactly the entry points Python's ctypes
declares (the rest hidden); every source and header is in the library's hash."""

from __future__ import annotations

import re
import shutil
import subprocess
import types
from pathlib import Path

import pytest
from hybrid.kernels import native
from hybrid.kernels.native import variants

ROOT = Path(__file__).resolve().parents[1]


class _Recorder:
    """Stands in for a ctypes library: records the functions _declare gives a signature."""

    def __init__(self):
        self.names: set[str] = set()

    def __getattr__(self, name):
        self.names.add(name)
        return types.SimpleNamespace()


def _declared() -> set[str]:
    rec = _Recorder()
    native._declare(rec)
    return rec.names


def test_every_c_file_is_built():
    """A family file beside the others but missing from SOURCES would be compiled by nothing (or fail at link)."""
    on_disk = sorted(p.name for p in variants.HERE.glob("*.c"))
    assert sorted(variants.SOURCES) == on_disk


def test_python_declares_every_function_it_calls():
    """Every ``.hl_*`` the package calls on the library is one _declare gives a signature (so the exported set
    checked below is the whole of what Python loads)."""
    declared = _declared()
    assert len(declared) >= 20 and all(n.startswith("hl_") for n in declared)
    for folder in ("kernels", "hybrid", "eval", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in re.findall(r"\.(hl_\w+)", path.read_text()):
                assert name in declared, f"{path.relative_to(ROOT)} calls {name}, which native._declare lacks"


def _flags_for(name: str) -> tuple[str, ...]:
    return (*variants.COMPILE, *variants.BY_NAME[name].flags)


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm (binutils) on PATH")
@pytest.mark.parametrize("name", [v.name for v in variants.VARIANTS])
def test_a_variant_exports_exactly_what_python_loads(name):
    """``nm -D`` of the variant's library (built in place, as the suite's other tests load it): its defined dynamic
    symbols are exactly the functions native._declare declares; every helper is hidden."""
    path = variants.library_path(variants.BY_NAME[name])
    if not path.is_file():
        if variants.why_not_buildable() is not None:
            pytest.skip(f"no {name} library and {variants.why_not_buildable()}")
        variants.compile_variant(variants.BY_NAME[name], path.parent)
    out = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    exported = {line.split()[-1] for line in out.stdout.splitlines() if line.split()[1:2] in (["T"], ["W"])}
    others = {line.split()[-1] for line in out.stdout.splitlines() if line.split()[1:2] not in (["T"], ["W"])}
    assert exported == _declared(), (sorted(exported - _declared()), sorted(_declared() - exported))
    assert not others, f"data or other symbols exported: {sorted(others)}"


@pytest.mark.skipif(variants.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("name", [v.name for v in variants.VARIANTS])
def test_each_c_file_compiles_alone(name, tmp_path):
    """Each .c file with nothing but its own #includes (native.h and the headers beside it, the generated
    program_ops.h from the build directory): one gcc run, each file its own translation unit. Syntax and types
    only (-fsyntax-only); -Werror for a function called without a declaration (a missing include)."""
    for header, text in variants.generated().items():
        (tmp_path / header).write_text(text)
    cmd = [variants.compiler(), *_flags_for(name), "-Werror=implicit-function-declaration", f"-I{tmp_path}",
           "-fsyntax-only", *(str(variants.HERE / f) for f in variants.SOURCES)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_the_library_hash_covers_every_header(tmp_path):
    """An edited header (or the op table) renames the library: a stale build is never loaded for edited sources."""
    for f in (*variants.SOURCES, *variants.headers(), "program_ops.py"):
        shutil.copy(variants.HERE / f, tmp_path / f)
    v = variants.BY_NAME["x86-64-v3"]
    before = variants.library_path(v, tmp_path)
    assert before.name == variants.library_path(v).name
    assert {"native.h", "simd.h", "gemv.h", "products.h"} <= set(variants.headers(tmp_path))
    seen = {before.name}
    for header in variants.headers(tmp_path):
        with open(tmp_path / header, "a") as f:
            f.write("\n/* an edit */\n")
        name = variants.library_path(v, tmp_path).name
        assert name not in seen, header
        seen.add(name)
    with open(tmp_path / "program_ops.py", "a") as f:
        f.write("\nOPS = OPS[:-1]\n")  # the generated header changes with the table
    assert variants.library_path(v, tmp_path).name not in seen


def test_a_failed_compile_names_the_file_and_variant(tmp_path):
    """A broken source: BuildError saying which variant failed and the compiler's message (not a traceback)."""
    if variants.why_not_buildable() is not None:
        pytest.skip(variants.why_not_buildable())
    for f in (*variants.SOURCES, *variants.headers(), "program_ops.py"):
        shutil.copy(variants.HERE / f, tmp_path / f)
    (tmp_path / variants.SOURCES[0]).write_text('#include "native.h"\nint broken( {\n')
    with pytest.raises(variants.BuildError, match=rf"compiling {variants.SOURCES[0]} failed for the x86-64-v3 variant"):
        variants.compile_variant(variants.BY_NAME["x86-64-v3"], tmp_path / "lib", tmp_path, jobs=1)
