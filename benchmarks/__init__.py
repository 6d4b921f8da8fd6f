"""Benchmark scripts (not installed into hybrid): run from the repo root as ``python -m benchmarks.NAME``."""
