#!/usr/bin/env bash
# Issue 25: 20 RL steps on the BFCL warm start, TRACE and GRPO, paired seeds ($SEEDS, e.g. 2-2).
# Self-contained: builds the warm start where the committed records expect it (the benchmark's
# run signature names the starting policy by its path), copies the committed records into the
# work dir's runs/ (so finished (method, seed) runs are skipped and the report pairs every seed),
# and copies new records back here as they finish.
#   SEEDS=2-2 bash bench/results/rl_bfcl/rl_bfcl.sh      # ~16 min warm start, then ~40-70 min a run
set -euo pipefail
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false VLLM_CPU_KVCACHE_SPACE=1
cd "$(dirname "$0")/../../.."
here=bench/results/rl_bfcl
root=${RL_BFCL_DIR:-/work/exp25b}
WS=${WS:-$root/ws/policies/warmstart-bfcl-smollm2-s0}
[ -f "$WS/warmstart.json" ] || .venv/bin/trace warmstart family=bfcl --workdir "$root/ws"
mkdir -p "$root/rl_bfcl/runs"
cp -n "$here"/*-s*.json "$root/rl_bfcl/runs/"
.venv/bin/python -m bench.learning --family bfcl --policy "$WS" \
  --methods "${METHODS:-trace,grpo}" --seeds "$SEEDS" --steps 20 --eval-every 10 --eval-items 100 --eval-samples 2 \
  --root-budget 16 --multiplier 1 --pool-size 32 --jobs 1 --learning-rate 2e-5 \
  --workdir "$root/rl_bfcl" --plot "$root/rl_bfcl/learning.png" \
  --set engine=vllm temperature=1.0 trainable_layers=6 ppo_epochs=2 micro_batch=4
cp -n "$root/rl_bfcl/runs/"*.json "$here/"
