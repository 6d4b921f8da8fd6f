"""The package as a user installs it: build the wheel from a copy of the sources, install it (``--no-deps``) into
a fresh venv that sees this venv's dependencies but not the repository, and from a folder outside the repository
import every module of it and run the ``hybrid`` command. (The rest of the suite runs the editable checkout, which
would hide a sub-package missing from the wheel or a file the code reads that is not shipped.) The wheel and its venv
are built once per run by the `installed` fixture (tests/conftest.py)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

IMPORT_ALL = """
import importlib, pkgutil, sys
import hybrid
assert "{root}" not in hybrid.__file__, hybrid.__file__
names = [m.name for m in pkgutil.walk_packages(hybrid.__path__, "hybrid.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
from hybrid.eval.tasks import TASKS_DIR
assert (TASKS_DIR / "_mmlu_local.yaml").is_file() and (TASKS_DIR / "_default_template_yaml").is_file()
assert (TASKS_DIR / "_cloze_template_yaml").is_file() and (TASKS_DIR / "_mmlu_local_cloze.yaml").is_file()
print(len(names), hybrid.__file__)
"""


def run(cmd, env, cwd):
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_wheel_imports_every_module_outside_the_repository(installed):
    env_dir, env, outside = installed
    out = run([str(env_dir / "bin" / "python"), "-c", IMPORT_ALL.format(root=ROOT)], env, outside)
    assert out.returncode == 0, out.stderr[-3000:]
    count, where = out.stdout.split()
    assert int(count) > 80 and where.startswith(str(env_dir)), out.stdout


def test_the_installed_command_runs(installed):
    env_dir, env, outside = installed
    hybrid = str(env_dir / "bin" / "hybrid")
    out = run([hybrid, "--help"], env, outside)
    assert out.returncode == 0 and "doctor" in out.stdout, out.stderr[-2000:]
    out = run([hybrid, "--version"], env, outside)
    assert out.returncode == 0 and out.stdout.startswith("hybrid-lm "), out.stderr[-2000:]
    out = run([hybrid, "doctor"], env, outside)
    assert out.returncode == 0 and "selective_scan" in out.stdout, out.stderr[-2000:]
    # the native decode kernels ship prebuilt in the wheel and load from there
    native = [line for line in out.stdout.splitlines() if line.startswith("native CPU decode kernels")]
    assert native and native[0].endswith("in use"), out.stdout[-2000:]
    # no MMLU beside an installed package: one line naming the ways to give it, not a search in site-packages
    env = {k: v for k, v in env.items() if k != "HYBRID_MMLU_DIR"}
    out = run([hybrid, "eval", "--recipe", "llama-tiny", "--limit", "1"], env, outside)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "--mmlu-dir" in out.stderr


# ---- the native kernels' prebuilt variants (kernels/native/variants.py) ------------------------------------------
NATIVE_PRODUCT = """
import os, sys, time
t0 = time.perf_counter()
import torch
from hybrid import kernels
from hybrid.kernels import dispatch, native
assert native.available() is None, native.available()
assert dispatch.choose("linear", "cpu")[0] == "native"
x, w, b = torch.randn(3, 200), torch.randn(77, 200), torch.randn(77)
torch.testing.assert_close(kernels.linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-4)
print(native.variant(), native.__file__, round(time.perf_counter() - t0, 2))
"""


def _no_compiler_env(env, tmp):
    """No compiler reachable (PATH without cc / gcc, CC a failing command) and an empty per-machine cache, where the
    -march=native build would have put its library."""
    bare = tmp / "bare-bin"
    bare.mkdir(exist_ok=True)
    cache = tmp / "empty-cache"
    cache.mkdir(exist_ok=True)
    return {**env, "PATH": str(bare), "CC": "/bin/false", "HYBRID_CACHE_DIR": str(cache)}, cache


def _native_dir(env_dir):
    (d,) = env_dir.glob("lib/python*/site-packages/hybrid/kernels/native")
    return d


def test_the_wheel_ships_every_native_variant(installed):
    import zipfile

    from hybrid.kernels.native import variants

    env_dir, _, _ = installed
    (wheel,) = (env_dir.parent / "dist").glob("hybrid_lm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for v in variants.VARIANTS:
        want = f"hybrid/kernels/native/_lib/{variants.library_path(v).name}"  # built from these very sources
        assert want in names, (want, [n for n in names if "_lib" in n])


def test_the_installed_native_kernels_run_with_no_compiler(installed, tmp_path):
    """From a folder outside the repository, with no compiler on PATH: the best variant this CPU runs loads and
    computes a product as torch does; each variant it can run does (the AVX2 one on an AVX-512 machine among
    them); nothing is compiled (the cache stays empty)."""
    from hybrid.kernels.native import variants

    env_dir, env, outside = installed
    env, cache = _no_compiler_env(env, tmp_path)
    py = str(env_dir / "bin" / "python")
    runs = variants.runnable(variants.cpu_flags() or frozenset())
    if not runs:
        pytest.skip("this CPU runs none of the x86-64 variants")
    out = run([py, "-c", NATIVE_PRODUCT], env, outside)
    assert out.returncode == 0, out.stderr[-3000:]
    name, where, seconds = out.stdout.split()
    assert name == runs[0].name and where.startswith(str(env_dir)), out.stdout
    print(f"import and first product: {seconds} s")
    for v in runs[1:]:
        out = run([py, "-c", NATIVE_PRODUCT], {**env, "HYBRID_NATIVE_VARIANT": v.name}, outside)
        assert out.returncode == 0 and out.stdout.split()[0] == v.name, out.stderr[-3000:]
    assert not any(cache.iterdir()), list(cache.iterdir())
    assert "compiling" not in out.stderr


def test_without_a_loadable_variant_the_fallback_says_so_once(installed, tmp_path):
    """The installed package with its libraries gone (a build that could not compile them): torch's kernels run, a
    warning says why once however often the library is asked for, and `hybrid doctor` names it."""
    env_dir, env, outside = installed
    env, _ = _no_compiler_env(env, tmp_path)
    lib = _native_dir(env_dir) / "_lib"
    hidden = lib.with_name("_lib_hidden")
    lib.rename(hidden)
    try:
        code = ("import warnings; warnings.simplefilter('always')\n"
                "from hybrid.kernels import native\n"
                "a, b = native.available(), native.available()\n"
                "assert a == b and a is not None\n"
                "print(a)")
        out = run([str(env_dir / "bin" / "python"), "-c", code], env, outside)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "has no" in out.stdout and "_lib" in out.stdout, out.stdout
        warned = [line for line in out.stderr.splitlines() if "native CPU kernels are not in use" in line]
        assert len(warned) == 1, out.stderr[-3000:]
        doctor = run([str(env_dir / "bin" / "hybrid"), "doctor"], env, outside)
        line = [x for x in doctor.stdout.splitlines() if x.startswith("native CPU decode kernels")]
        assert line and "not in use (the installed package has no" in line[0], doctor.stdout[-2000:]
    finally:
        hidden.rename(lib)
