#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on its embedded default: `hybrid tradeoff`, which
# trains a 4-mixer Mamba-2/attention family (mixers only; attention share 0, 1/4, 1/2, 3/4, 1; two seeds
# each) on multi-query associative recall (16-64 pairs) on this CPU, times the same patterns (with MLPs) at
# the `small` width through the
# engine at 2K/8K (and 32K for shares 0 and 1), and writes out/tradeoff/tradeoff.{md,csv,json,png}.
# Extra args go to the command (e.g. --lock /tmp/bench.lock on a shared machine, --threads N).
set -euo pipefail
cd "$(dirname "$0")/.."
# Where PYTHONDONTWRITEBYTECODE is set (as on this project's build machines) Python caches no compiled module, and
# every process compiles every module it imports again: torch's ~3k take seconds of each interpreter's start-up.
# Unset, each is compiled once, at its first import, into the .venv and the source tree's __pycache__ (ignored).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
.venv/bin/hybrid tradeoff "$@"
