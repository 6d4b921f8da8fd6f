#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. Extra arguments go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
# Where PYTHONDONTWRITEBYTECODE is set (as on this project's build machines) Python caches no compiled module, and
# every process compiles every module it imports again: torch's ~3k take seconds of each interpreter's start-up.
# Unset, each is compiled once, at its first import, into the .venv and the source tree's __pycache__ (ignored).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
# -P: not the repo root on sys.path. Its top-level kernels/ (installed as hybrid.kernels) would shadow the Hugging
# Face `kernels` package that transformers imports when it is installed (tests/conftest.py does the same for
# pytest-xdist's workers). One worker per core (the tests run single-threaded), each test file on one worker
# (tests/conftest.py: its module fixtures are built once) except the docs examples, one worker per page.
exec .venv/bin/python -P -m pytest -q -n auto --dist loadgroup "$@"
