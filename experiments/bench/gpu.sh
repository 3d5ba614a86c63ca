#!/usr/bin/env bash
# The benchmarks on one CUDA device, in one go (sized for about 10 minutes).
#
#   PYTHON=/path/to/python bash experiments/bench/gpu.sh [out_dir]
#
# Needs a CUDA build of torch in $PYTHON's environment (the project pins the
# CPU wheel; GPU users override the pin) plus the [test] extra (transformers).
# Writes each benchmark's log and its closing JSON line into out_dir
# (default outputs/bench/gpu) and prints a summary.
#
# STATUS: written without a GPU to run it on. The CUDA code path (index
# tensors packed on the host and moved to the device in one pinned copy, state
# store and KV cache on the device, bfloat16 by default, CUDA graphs under
# compile=true, synchronised forward timing) has only been exercised on CPU;
# treat the first run as its test.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-outputs/bench/gpu}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled

"$PY" - <<'EOF'
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device (a CPU build?)"
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__)
EOF

run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "Loading weights" | tail -n 25
  tail -n 1 "$OUT/$name.log" > "$OUT/$name.json"
}

# Exactness first: on CUDA (float32, TF32 off), plain decoding and both proposers give CPU plain
# decoding's tokens, eager and with CUDA graphs; bf16 is the default; index tensors move in one pinned copy.
run exactness 300 "$PY" -m pytest -q -x -p no:warnings -m gpu tests/spec/test_cuda.py tests/core/test_gpu_ready.py
run spec 120 "$PY" experiments/bench/spec.py device=cuda num_prompts=16 repeats=3
run compare_hf 200 "$PY" experiments/bench/compare_hf.py device=cuda 'pairs=["builtin"]' compile=false
echo "== summary ($OUT)"
for f in "$OUT"/spec.json "$OUT"/compare_hf.json; do echo "$(basename "$f" .json): $(cat "$f")"; done
