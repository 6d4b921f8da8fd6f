#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# -P: not the repo root on sys.path. Its top-level kernels/ (installed as hybrid.kernels) would shadow the
# Hugging Face `kernels` package that transformers imports when it is installed.
exec .venv/bin/python -P -m pytest -q "$@"
