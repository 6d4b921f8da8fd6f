#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on its embedded default: `hybrid tradeoff`, which
# trains a same-width family of Mamba-2/attention models (attention share 0, 1/8, 1/4, 1/2, 1) on
# multi-query associative recall on this CPU, times their prefill at 512/2K/8K tokens, and writes
# out/tradeoff/tradeoff.{json,csv,md,png} (about 10 minutes on 2 cores). Extra args go to the command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/hybrid tradeoff "$@"
