#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on its embedded default: the `small` recipes'
# size, FLOPs/token and cache bytes, then their prefill speed on this machine at 2048 tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/hybrid info --recipe all-small
.venv/bin/hybrid bench --recipe all-small --lengths 2048 "$@"
