#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. Extra arguments go to pytest (`-n 0`: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# -P: not the repo root on sys.path. Its top-level kernels/ (installed as hybrid.kernels) would shadow the Hugging
# Face `kernels` package that transformers imports when it is installed (tests/conftest.py does the same for
# pytest-xdist's workers). One worker per core (the tests run single-threaded), each test file on one worker
# (tests/conftest.py: its module fixtures are built once) except the docs examples, one worker per page.
exec .venv/bin/python -P -m pytest -q -n auto --dist loadgroup "$@"
