#!/usr/bin/env bash
# The project's checks on a CUDA machine, in one go (247 s on an H200 with a 16-core host, its one run as a whole so
# far: benchmarks/results/h200-amx-second-run/):
# what the first device session ran by hand (benchmarks/results/h200-amx-first-run/), so that the next one spends its
# device time on the results. Run from the repository root, with the machine's own torch / triton:
#
#     bash benchmarks/gpu_check.sh [OUT]          # OUT: where the logs and tables go (default $OUT, else /tmp/gpu_check)
#
# The packages the machine lacks travel as wheels in .whl/ (installed into /tmp/site when the folder is there):
# pydantic, pydantic-core, annotated-types, typing-inspection, pyzmq, gguf, xgrammar, redis, msgspec, and for the
# CPU engine tests pytest-asyncio, jsonschema, jsonschema-specifications, referencing, rpds-py. The C++ CPU kernels
# travel built (kernels/cpu/lib: the manifest must match the sources).
#
#   A (in parallel)  the Triton kernels' tests compiled (slow shapes too); the engine's CUDA tests (test_cuda.py and
#                    test_parity.py's cuda cases); on a host with AMX, the C++ kernels' tests (the real AMX tiles)
#   B (one at a time, alone on the GPU)  the Triton kernel benchmark (bandwidth against the copy bandwidth, SDPA
#                    beside it); offline throughput against transformers on a random model of SmolLM2's shapes;
#                    on a host with AMX, the C++ kernels' benchmark
# Every part has its own time limit, so one that hangs leaves the others' results. OUT gets at most 7 files (the device
# tool brings back 8): info.txt, tests.log, triton_bench.log, kernels_<gpu>.json, throughput.log, throughput.md,
# cpu_bench.log.
set -u
OUT=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
unset TRITON_INTERPRET                      # compiled kernels: the interpreter is the CPU's way of testing them
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$OUT/info.txt" 2>&1 || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{ date; nvidia-smi; lscpu | grep -E "Model name|^CPU\(s\)"; grep -o -w -E "amx_tile|avx512_bf16|avx512_vnni" /proc/cpuinfo | sort -u
  python3 -c "import sys, torch, triton, transformers; print(sys.version, torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__)"
} >> "$OUT/info.txt" 2>&1
AMX=$(grep -c -w amx_tile /proc/cpuinfo)
T0=$SECONDS
summary() { grep -E "FAILED|ERROR|passed|failed|Fatal|crashed|^E " | tail -60; }

( timeout 200 python3 -m pytest -q -p no:cacheprovider -m "" -n 6 tests/kernels --ignore=tests/kernels/cpu -rfE 2>&1 | summary
  echo "rc=${PIPESTATUS[0]} t=$((SECONDS - T0))" ) > "$OUT/part_triton.log" &
( timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py tests/engine/test_parity.py -k "cuda" -rfE \
      2>&1 | summary
  echo "rc=${PIPESTATUS[0]} t=$((SECONDS - T0))" ) > "$OUT/part_engine.log" &
if [ "$AMX" -gt 0 ]; then
    ( OMP_NUM_THREADS=2 timeout 200 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/cpu -rfE 2>&1 | summary
      echo "rc=${PIPESTATUS[0]} t=$((SECONDS - T0))" ) > "$OUT/part_cpu.log" &
fi
timeout 90 python3 -c "
import sys; from pathlib import Path
from tests.helpers.random_checkpoint import build_checkpoint, demo_corpus
build_checkpoint(Path('/tmp/smollm2_shaped'), 'llama', hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                 intermediate_size=1536, vocab_size=8192, seed=0, max_position_embeddings=8192, tie_word_embeddings=True,
                 corpus=demo_corpus(4000, seed=0))" > "$OUT/throughput.log" 2>&1
wait
for part in triton engine cpu; do
    [ -f "$OUT/part_$part.log" ] && { echo "== $part"; cat "$OUT/part_$part.log"; rm "$OUT/part_$part.log"; }
done > "$OUT/tests.log"
echo "phase A t=$((SECONDS - T0))" >> "$OUT/info.txt"

timeout 150 python3 benchmarks/offline/kernels.py > "$OUT/triton_bench.log" 2>&1
echo "rc=$? t=$((SECONDS - T0))" >> "$OUT/triton_bench.log"
cp benchmarks/results/kernels_nvidia*.json "$OUT/" 2>/dev/null
timeout 150 python3 -m benchmarks.offline.throughput --device cuda --dtype bfloat16 --model /tmp/smollm2_shaped \
    --num-prompts 64 --scale 0.25 --max-num-seqs 64 --hf-batch 64 --out /tmp/throughput >> "$OUT/throughput.log" 2>&1
echo "rc=$? t=$((SECONDS - T0))" >> "$OUT/throughput.log"
cp /tmp/throughput/*.md "$OUT/throughput.md" 2>/dev/null
if [ "$AMX" -gt 0 ]; then
    timeout 90 python3 benchmarks/offline/kernels.py --device cpu --quick --threads 8 > "$OUT/cpu_bench.log" 2>&1
    echo "rc=$? t=$((SECONDS - T0))" >> "$OUT/cpu_bench.log"
fi
echo "done t=$((SECONDS - T0))" >> "$OUT/info.txt"
