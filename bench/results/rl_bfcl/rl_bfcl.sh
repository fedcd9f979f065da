#!/usr/bin/env bash
# 20 RL steps on the BFCL warm start, TRACE and GRPO, paired seeds ($SEEDS, e.g. 2-2);
# the recipe, its settings and the record handling are bench/rl_real.sh's.
#   SEEDS=2-2 bash bench/results/rl_bfcl/rl_bfcl.sh      # ~16 min warm start, then ~40-70 min a run
exec bash "$(dirname "$0")/../../rl_real.sh" bfcl
