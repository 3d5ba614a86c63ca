#!/usr/bin/env bash
# The device check in one command: GPU tests and benchmarks on one CUDA device, one JSON.
#
#   PYTHON=/path/to/python bash experiments/bench/gpu.sh [out_dir]
#   DEVICE=cpu GPU_SH_BUDGET=300 bash experiments/bench/gpu.sh /tmp/gpu-dry   # the same steps on the CPU
#
# Needs a CUDA build of torch in $PYTHON's environment (the project pins the CPU wheel;
# GPU users override the pin) plus the [test] extra (transformers, scipy).
#
# Steps, in order; each runs under its own `timeout`, capped so the whole stays within
# GPU_SH_BUDGET seconds (default 470: under 8 minutes on one H100). A failing step is
# recorded and the script goes on; a step the budget leaves no time for is recorded as timed
# out; the script exits nonzero at the end if any step failed.
#   device       machine_record(DEVICE): the GPU, torch build, git commit
#   tests        pytest -m gpu tests/spec/test_cuda.py tests/core/test_gpu_ready.py: every method and
#                tree equal to CPU plain decoding (fp32, TF32 off), bf16 under the exactness policy,
#                sampling chi-square on the device (and its negative control), compile = eager
#   compare_hf   experiments/bench/compare_hf.py on the built-in pair, compiled and eager at batch 1
#                (compile_gain_plain: CUDA graphs against the same code eager), a small batch sweep
#   spec_b1/_b8  experiments/bench/spec.py device=DEVICE at batch 1 and 8 (EAGLE-3, draft model ... vs plain)
#   smollm2      spec.py on the real target (SmolLM2-135M GGUF, n-gram), if cached (a device has no
#                network: SMOLLM2_GGUF=<a copy of the file> otherwise); skipped with a note if absent
#   ar           experiments/bench/ar.py, only once it takes device= (today it runs on the CPU only)
# Then out_dir/summary.json (experiments/bench/gpu_summary.py): each step's status, its closing
# JSON line and the device record. Logs: out_dir/<step>.log.
#
# STATUS: has not yet run on a GPU. Its steps and the summary were dry-run on a CPU
# (DEVICE=cpu); tests/spec/test_cuda.py passes there with SPECDEC_GPU_TEST_DEVICE=cpu.
# Treat the first device run as its test; put its results in the README.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-outputs/bench/gpu}
DEVICE=${DEVICE:-cuda}
BUDGET=${GPU_SH_BUDGET:-470}
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/*.rc "$OUT"/summary.json
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled SPECDEC_GPU_TEST_DEVICE=$DEVICE
START=$SECONDS
STEPS=()

step() {  # name, timeout seconds, command...: runs it, records "<exit status> <seconds>" in out_dir/name.rc
  local name=$1 limit=$2 left t0 rc; shift 2
  STEPS+=("$name")
  left=$((BUDGET - (SECONDS - START)))
  if ((left < 15)); then  # not run: a failure of the check (a timeout), not a skip
    echo "== $name: not run (no time left in GPU_SH_BUDGET=$BUDGET s)"
    echo "not run: no time left in GPU_SH_BUDGET=$BUDGET s" >"$OUT/$name.log"
    echo "124 0" >"$OUT/$name.rc"
    return
  fi
  ((limit > left)) && limit=$left
  echo "== $name (timeout ${limit}s)"
  t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  echo "$rc $((SECONDS - t0))" >"$OUT/$name.rc"
  grep -v "Loading weights" "$OUT/$name.log" | tail -n 8
  ((rc == 0)) || echo "!! $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)')"
}

skip() {  # name, reason
  echo "== $1: skipped ($2)"
  echo "skipped: $2" >"$OUT/$1.log"
  echo "skip 0" >"$OUT/$1.rc"
}

# Sizes: a CPU dry run checks the control flow with the smallest runs that still mean something.
if [[ $DEVICE == cpu ]]; then
  SPEC_SIZE=(num_prompts=2 new_tokens=16 repeats=1 'gammas=[4]' 'proposers=[ngram]' 'trees=[]')
  CMP_SIZE=(quick=true num_prompts=2 new_tokens=16 'batch_sizes=[1]' sweep_repeats=1 sweep_min_requests=1)
else
  SPEC_SIZE=(num_prompts=8 new_tokens=64 repeats=3 'gammas=[4]' 'proposers=[draft_model,ngram,eagle,eagle3,medusa]'
             'trees=[eagle3,medusa]' 'tree_budgets=[8]')
  CMP_SIZE=(num_prompts=4 new_tokens=64 repeats=3 hf_repeats=1 'batch_sizes=[1,8]' sweep_repeats=3
            sweep_min_requests=8 sweep_compile=false sweep_hf=false)
fi

step device 60 "$PY" - "$DEVICE" <<'EOF'
import json, sys
from specdec.experiment.machine import machine_record
r = machine_record(sys.argv[1])
print(json.dumps(r))
assert not r["device"].startswith("cuda") or r["gpu"], f"torch {r['torch']} ({r['torch_build']}) sees no CUDA device"
EOF

step tests 240 "$PY" -m pytest -p no:cacheprovider -p no:warnings -m gpu -rs \
  tests/spec/test_cuda.py tests/core/test_gpu_ready.py

# CUDA graphs: compare_hf.py with compile=true times plain decoding compiled (CUDA graphs) against the
# same code eager by turns (compile_gain_plain), beside the pairs' figures; before the long steps.
step compare_hf 180 "$PY" experiments/bench/compare_hf.py device="$DEVICE" 'pairs=[builtin]' compile=true \
  "${CMP_SIZE[@]}"

step spec_b1 120 "$PY" experiments/bench/spec.py device="$DEVICE" batch_size=1 "${SPEC_SIZE[@]}"
step spec_b8 120 "$PY" experiments/bench/spec.py device="$DEVICE" batch_size=8 "${SPEC_SIZE[@]}"

# The real target: its GGUF comes from PyPI on first use, and a device machine has no network.
GGUF=${SMOLLM2_GGUF:-${SPECDEC_CACHE:-$HOME/.cache/specdec}/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
if [[ -f $GGUF ]]; then
  step smollm2 120 "$PY" experiments/bench/spec.py device="$DEVICE" target="$GGUF" batch_size=1 \
    num_prompts=4 new_tokens=32 repeats=2 'gammas=[4]' 'proposers=[ngram]' 'trees=[]'
else
  STEPS+=(smollm2)
  skip smollm2 "no $GGUF: fetch it where there is network (python -c 'from specdec.zoo_fetch import \
fetch; fetch(\"smollm2\")') and copy it here, or set SMOLLM2_GGUF"
fi

# ar.py times ours against transformers; it has no device= key yet (CPU only), so it is not a device figure.
if grep -q '^    device:' experiments/bench/ar.py; then
  step ar 120 "$PY" experiments/bench/ar.py device="$DEVICE" quick=true 'batch_sizes=[1,8]' compile=true
else
  STEPS+=(ar); skip ar "experiments/bench/ar.py takes no device= key: it would time the CPU"
fi

"$PY" experiments/bench/gpu_summary.py "$OUT" "${STEPS[@]}" >"$OUT/summary.json"
echo "== summary: $OUT/summary.json ($((SECONDS - START)) s)"
"$PY" - "$OUT/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print("device:", (s["device"] or {}).get("gpu") or (s["device"] or {}).get("device"))
for name, r in s["steps"].items():
    print(f"  {name:12s} {r['status']:8s} {r['seconds']}s")
print("failed:", ", ".join(s["failed"]) or "none")
EOF
[[ -s $OUT/summary.json ]] &&
  "$PY" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['ok'] else 1)" "$OUT/summary.json"
