"""Benchmark scripts (not installed into hybrid): run from the repo root as ``python -m benchmarks.NAME``."""

import sys
from pathlib import Path

# Run from the repo root, the root is first on sys.path, and there its kernels/ (installed as hybrid.kernels)
# shadows the Hugging Face `kernels` package that transformers 5 imports. Keep the root, but last (as
# tests/conftest.py does): `benchmarks` is still found, `kernels` is the installed one.
_ROOT = Path(__file__).resolve().parents[1]
_at_root = [p for p in sys.path if Path(p or ".").resolve() == _ROOT]
sys.path[:] = [p for p in sys.path if p not in _at_root] + _at_root
