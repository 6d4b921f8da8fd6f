"""kernels/native/variants.py: which prebuilt variant a CPU gets, the sources' hash in a library's name, the
non-Linux build of the pool (no futex), and the refusal to build where the kernels cannot run. The built wheel's
variants, loaded with no compiler, are tests/test_wheel.py's."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from hybrid.kernels import native
from hybrid.kernels.native import variants


def test_a_cpu_gets_the_best_variant_it_runs():
    v3, v4, bf16 = (variants.BY_NAME[n] for n in ("x86-64-v3", "x86-64-v4", "avx512-bf16"))
    assert variants.runnable(bf16.needs | {"amx_tile"}) == [bf16, v4, v3]
    assert variants.runnable(v4.needs) == [v4, v3]  # Skylake-SP: AVX-512 without BF16
    assert variants.runnable(v3.needs) == [v3]
    assert variants.runnable(v3.needs - {"fma"}) == []  # no FMA: none (torch's kernels, with a warning)
    assert variants.runnable(frozenset({"neon", "asimd"})) == []


def test_this_machine_loads_the_best_variant_it_runs():
    flags = variants.cpu_flags()
    if native.available() is not None or flags is None or not variants.runnable(flags):
        pytest.skip(f"native kernels: {native.available()}")
    assert native.variant() in (variants.runnable(flags)[0].name, "-march=native (HYBRID_NATIVE_BUILD=native)")


def test_a_library_name_changes_with_its_sources(tmp_path):
    for f in (*variants.SOURCES, *variants.headers(), "program_ops.py"):
        shutil.copy(variants.HERE / f, tmp_path / f)
    v = variants.BY_NAME["x86-64-v3"]
    before = variants.library_path(v, tmp_path)
    assert before.name == variants.library_path(v).name and before.parent == tmp_path / variants.LIB_DIR
    with open(tmp_path / "program.c", "a") as f:
        f.write("\n/* an edit */\n")
    assert variants.library_path(v, tmp_path) != before  # a stale library is never loaded for edited sources
    assert variants.library_path(variants.BY_NAME["x86-64-v4"], tmp_path).name != variants.library_path(
        v, tmp_path).name


def test_a_wheel_build_reuses_only_a_library_of_the_same_key(tmp_path, monkeypatch):
    """build_all copies a library from reuse_from whose name (with the sources' key) it would build; any other
    variant, or a library of other sources there, is compiled."""
    src = tmp_path / "src"
    src.mkdir()
    for f in (*variants.SOURCES, *variants.headers(), "program_ops.py"):
        shutil.copy(variants.HERE / f, src / f)
    v3, v4 = variants.BY_NAME["x86-64-v3"], variants.BY_NAME["x86-64-v4"]
    ready = tmp_path / "tree_lib"
    ready.mkdir()
    (ready / variants.library_path(v3, src).name).write_bytes(b"v3 as the editable install built it")
    (ready / variants.library_path(v4, src).name.replace(variants.key(v4, src), "0" * 16)).write_bytes(b"stale")
    compiled = []

    def compile_variant(v, lib_dir, src_dir):
        compiled.append(v.name)
        lib_dir.mkdir(parents=True, exist_ok=True)
        variants.library_path(v, src_dir, lib_dir).write_bytes(b"compiled")
        return variants.library_path(v, src_dir, lib_dir)

    monkeypatch.setattr(variants, "compile_variant", compile_variant)
    out = tmp_path / "wheel_lib"
    built = variants.build_all(out, [v3, v4], src, log=lambda m: None, reuse_from=ready)
    assert compiled == ["x86-64-v4"]
    assert built[0].read_bytes() == b"v3 as the editable install built it" and built[1].read_bytes() == b"compiled"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in built)


@pytest.mark.skipif(variants.compiler() is None, reason="no C compiler")
@pytest.mark.parametrize("name", [v.name for v in variants.VARIANTS])
def test_each_variant_compiles_without_linux(name, tmp_path):
    """The sources with __linux__ undefined (what macOS sees: no futex, no arch_prctl for AMX) compile for each
    variant: the pool's sleep falls back to a yield there. Syntax and types only (-fsyntax-only: seconds), each
    file its own translation unit."""
    for header, text in variants.generated().items():
        (tmp_path / header).write_text(text)
    cmd = [variants.compiler(), *variants.COMPILE, *variants.BY_NAME[name].flags, "-U__linux__", "-fsyntax-only",
           f"-I{tmp_path}", *(str(variants.HERE / f) for f in variants.SOURCES)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "futex" not in res.stderr


def test_no_build_on_another_architecture(monkeypatch):
    monkeypatch.setattr(variants.platform, "machine", lambda: "aarch64")
    why = variants.why_not_buildable()
    assert why is not None and "x86-64" in why and "aarch64" in why


def test_variants_to_build_are_checked(monkeypatch):
    monkeypatch.setenv(variants.VARIANTS_ENV, "x86-64-v3,avx512-bf16")
    assert [v.name for v in variants.requested()] == ["x86-64-v3", "avx512-bf16"]
    monkeypatch.setenv(variants.VARIANTS_ENV, "none")
    assert variants.requested() == []
    monkeypatch.setenv(variants.VARIANTS_ENV, "x86-64-v9")
    with pytest.raises(variants.BuildError, match="unknown variant.*x86-64-v9"):
        variants.requested()


def test_a_forced_variant_this_cpu_cannot_run_is_refused(monkeypatch):
    """HYBRID_NATIVE_VARIANT naming a variant the CPU lacks, or none at all: (None, why), never a crash."""
    monkeypatch.setenv(native.VARIANT_ENV, "x86-64-v9")
    lib, why = native._prebuilt()
    assert lib is None and "names no variant" in why
    monkeypatch.setattr(native, "_cpu_flags", lambda: variants.BY_NAME["x86-64-v3"].needs)
    monkeypatch.setenv(native.VARIANT_ENV, "avx512-bf16")
    lib, why = native._prebuilt()
    assert lib is None and "lacks its instructions" in why
