"""The one thing pyproject.toml cannot say: the packages, found under the folders ``package-dir`` maps.

kernels/, eval/ and recipes/ sit at the top of the repository but install as ``hybrid.kernels``,
``hybrid.eval`` and ``hybrid.recipes``; setuptools' declarative ``packages.find`` would find them as
top-level ``kernels`` / ``eval``. Everything else (metadata, extras, package data) is in pyproject.toml.
"""

from setuptools import find_packages, setup

PACKAGE_DIR = {"hybrid": "hybrid", "hybrid.kernels": "kernels", "hybrid.eval": "eval", "hybrid.recipes": "recipes"}


def packages() -> list[str]:
    found = []
    for name, folder in PACKAGE_DIR.items():
        found.append(name)
        # sub-packages of a mapped folder that is itself mapped elsewhere (hybrid's own) are found once
        found += [f"{name}.{sub}" for sub in find_packages(folder) if f"{name}.{sub}" not in PACKAGE_DIR]
    return sorted(set(found))


setup(packages=packages())
