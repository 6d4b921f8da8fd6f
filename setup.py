"""What pyproject.toml cannot say: the packages, found under the folders ``package-dir`` maps, and the native
kernels' build.

kernels/, eval/ and recipes/ sit at the top of the repository but install as ``hybrid.kernels``,
``hybrid.eval`` and ``hybrid.recipes``; setuptools' declarative ``packages.find`` would find them as
top-level ``kernels`` / ``eval``. Everything else (metadata, extras, package data) is in pyproject.toml.

The native CPU kernels (kernels/native/*.c) are compiled here, once per x86-64 level (kernels/native/variants.py:
x86-64-v3, x86-64-v4, avx512-bf16), into the package's ``hybrid/kernels/native/_lib`` (a wheel) or the source
tree's ``kernels/native/_lib`` (``pip install -e .``); the import picks the one the CPU runs. Where they cannot be
built (not x86-64, no compiler) the build says so and goes on: the package then runs torch's kernels, and says so
when imported. ``HYBRID_NATIVE_VARIANTS=x86-64-v3,...`` (or ``none``) chooses which variants are built;
``HYBRID_NATIVE_REQUIRED=1`` makes a failure to build them fail the build. A wheel built from a tree where
``pip install -e .`` already compiled them copies the libraries whose key (a hash of the sources and flags, in the
file name) matches, rather than compiling them again.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PACKAGE_DIR = {"hybrid": "hybrid", "hybrid.kernels": "kernels", "hybrid.eval": "eval", "hybrid.recipes": "recipes"}
ROOT = Path(__file__).resolve().parent


def packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_DIR.items():
        found.append(name)
        # sub-packages of a mapped folder that is itself mapped elsewhere (hybrid's own) are found once
        found += [f"{name}.{sub}" for sub in find_packages(folder) if f"{name}.{sub}" not in PACKAGE_DIR]
    return sorted(set(found))


def _variants():
    """kernels/native/variants.py, loaded by its path (the package imports torch, which a build may not have)."""
    spec = importlib.util.spec_from_file_location("_hybrid_native_variants", ROOT / "kernels/native/variants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses looks the module up)
    spec.loader.exec_module(module)
    return module


class build_py_with_native(build_py):
    """build_py, then the native libraries: into the build tree (a wheel), or in place (an editable install)."""

    def run(self):
        super().run()
        v = _variants()
        editable = getattr(self, "editable_mode", False)
        lib_dir = (ROOT / "kernels/native" if editable else Path(self.build_lib) / "hybrid/kernels/native") / v.LIB_DIR
        why = v.why_not_buildable()
        try:
            chosen = v.requested()
            if why is None and chosen:
                # a wheel built from a tree an editable install compiled copies its libraries of the same key
                v.build_all(lib_dir, chosen, ROOT / "kernels/native", log=lambda m: print(m, file=sys.stderr),
                            reuse_from=None if editable else ROOT / "kernels/native" / v.LIB_DIR)
                return
        except v.BuildError as e:
            why = str(e)
        if why is None:
            why = f"{v.VARIANTS_ENV}=none"
        if os.environ.get("HYBRID_NATIVE_REQUIRED", "").strip() not in ("", "0"):
            raise SystemExit(f"hybrid-lm: the native kernels were not built: {why}")
        print(f"hybrid-lm: WARNING: the native CPU kernels were not built ({why}); this install runs torch's "
              "kernels (several times slower at decode)", file=sys.stderr)


setup(packages=packages(), cmdclass={"build_py": build_py_with_native})
