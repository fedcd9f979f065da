#!/usr/bin/env bash
# Issue 25: 20 RL steps on the BFCL warm start, TRACE and GRPO, paired seeds ($SEEDS, e.g. 0-0).
set -euo pipefail
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false VLLM_CPU_KVCACHE_SPACE=1
cd /work/main
exec .venv/bin/python -m bench.learning --family bfcl --policy "$WS" \
  --methods "${METHODS:-trace,grpo}" --seeds "$SEEDS" --steps 20 --eval-every 10 --eval-items 100 --eval-samples 2 \
  --root-budget 16 --multiplier 1 --pool-size 32 --jobs 1 --learning-rate 2e-5 \
  --workdir /work/exp25b/rl_bfcl --plot /work/exp25b/rl_bfcl/learning.png \
  --set engine=vllm temperature=1.0 trainable_layers=6 ppo_epochs=2 micro_batch=4
