#!/usr/bin/env bash
# One prepared check for a lent GPU machine: set up the GPU extra, run the engines
# benchmark, a 3-step `trace train` with vLLM on the GPU, and bench/scale.py with two vLLM engine
# actors sharing the one GPU (memory fractions). Every figure goes to ONE file, $OUT/gpu_check.txt
# ($OUT defaults to ./gpu_check_out), as each part finishes, so a part that runs out of time
# still leaves the earlier ones. Budget: under 10 minutes on one H200; each part has its own
# timeout so the whole stays inside it.
#
#   bash scripts/gpu_check.sh            # from the repository root
#
# Needs the package registry (setup installs vllm and ray) or a .venv already set up there.
# Not run in the session that wrote it (no GPU was lent): see docs/results.md, "Scaling out on Ray".
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
REPORT="$OUT/gpu_check.txt"
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false TOKENIZERS_PARALLELISM=false
export RAY_USAGE_STATS_ENABLED=0 PYTHONPATH=$PWD

part() {  # part NAME TIMEOUT_S COMMAND...: run, time, append its tail to the report
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*" | tee -a "$REPORT"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.log" >> "$REPORT"
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$REPORT"
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; } >> "$REPORT" 2>&1

# 1. The GPU stack (vllm pins its own CUDA torch) + ray; scripts/setup.sh picks .[gpu,dev,cluster].
part setup 240 bash scripts/setup.sh
PY=.venv/bin/python

# 2. Engines benchmark on the GPU: vLLM against transformers, prefix-cache share.
part engines 90 $PY -m bench.engines --models tiny,smollm2 --device cuda --prompts 8 --n 4

# 3. A 3-step train with vLLM on the GPU, one process. SmolLM2 (shipped in a wheel) rather than
#    the tiny policy, whose SFT bootstrap alone would take minutes.
part train_vllm 120 $PY -m cli train --workdir "$OUT/wd" engine=vllm policy=smollm2 steps=3 \
    eval_items=20 plot_every=0 run_name=gpu-check

# 4. The scale benchmark: 1 and 2 vLLM actors sharing the GPU (0.3 of its memory each),
#    sticky against round-robin prefix-cache hits, 1 trainer rank (0.3 of the GPU), disk against
#    broadcast sync. One node: the GPU is shared by fractions.
part scale 150 $PY -m bench.scale --cluster local:1 --engine vllm --engines 1,2 --ranks 1 \
    --policy smollm2 --items 16 --k 4 --max-tokens 64 --gpu-share 0.3 \
    --engine-opts '{"gpu_memory_utilization": 0.3}' --out "$OUT/scale.json"

echo "report: $REPORT"
