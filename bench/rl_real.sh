#!/usr/bin/env bash
# 20 RL steps on a real family's warm start, TRACE and GRPO, paired seeds; records in
# results/rl_<family>/runs/ (results/README.md).
#   SEEDS=0-2 bash bench/rl_real.sh hotpotqa     # or bfcl; METHODS=trace,grpo by default
# Builds the warm start where the records expect it (their signature names the policy by its path):
# under $RL_DIR, default /work/exp25b for bfcl (where its records were made), else /work/rl_<family>.
set -euo pipefail
family=${1:?usage: SEEDS=0-2 bash bench/rl_real.sh hotpotqa|bfcl}
export MLFLOW_DISABLE_TELEMETRY=true PREFECT_SERVER_ANALYTICS_ENABLED=false VLLM_CPU_KVCACHE_SPACE=1
cd "$(dirname "$0")/.."
case $family in
  bfcl)  # 258 live_simple requests; measured on 100 simple_python items at temperature 1
    root=${RL_DIR:-/work/exp25b}; rl=$root/rl_bfcl; ws_args=()
    learn=(--set engine=vllm temperature=1.0 trainable_layers=6 ppo_epochs=2 micro_batch=4) ;;
  hotpotqa)  # RL on dev_rest (400 items), measured on dev_heldout (100) at the warm start's 0.7
    root=${RL_DIR:-/work/rl_hotpotqa}; rl=$root/rl
    # one SFT thread, as the committed runs' start was built (two threads sum in another order:
    # another policy, whose runs would not pair), measured at the RL runs' temperature
    ws_args=(threads=1 eval_temperature=0.7)
    # the update on both cores while the engine idles: 200 s a step, not 320 (studies.update_threads);
    # the runs' signature names the thread count
    export TRACE_TORCH_THREADS=${TRACE_TORCH_THREADS:-2}
    learn=(--eval-temperature 0.7
           --set engine=vllm temperature=0.7 train_split=dev_rest ppo_epochs=2 micro_batch=4) ;;
  *) echo "bench/rl_real.sh: family $family has no RL recipe here (bfcl, hotpotqa)" >&2; exit 2 ;;
esac
# the seeds before the warm start's hour: SEEDS=0 is a count of none (seed 0 alone is 0-0)
.venv/bin/python -c 'import sys; from bench.learning_runs import parse_seeds
try: print("bench/rl_real.sh: seeds", *parse_seeds(sys.argv[1]))
except ValueError as e: sys.exit(f"bench/rl_real.sh: SEEDS: {e}")' "${SEEDS:?set SEEDS, e.g. 0-2}"
WS=${WS:-$root/ws/policies/warmstart-$family-smollm2-s0}
[ -f "$WS/warmstart.json" ] || .venv/bin/trace warmstart "family=$family" "${ws_args[@]}" --workdir "$root/ws"
.venv/bin/python -m bench.learning --family "$family" --policy "$WS" \
  --methods "${METHODS:-trace,grpo}" --seeds "${SEEDS:?set SEEDS, e.g. 0-2}" --steps 20 \
  --eval-every 10 --eval-items 100 --eval-samples 2 \
  --root-budget 16 --multiplier 1 --pool-size 32 --jobs 1 --learning-rate 2e-5 \
  --workdir "$rl" --records "results/rl_$family" "${learn[@]}"
