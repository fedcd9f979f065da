"""Diagnostic rows of bench.learning_sim (docs/results.md, "Learning simulator"): run_seed on the
named rows only, records as the CLI writes them. Usage, from the repo root:
    python bench/results/learning_sim/diag/diag.py paper 100-107 trace_cover,grpo,cover_noexp DIR"""
import json, sys, time
import numpy as np
from bench.learning_sim import REGIMES, run_seed, write_records
from bench.sim.model import ChainParams
from bench.sim.run import SimSettings, methods
regime, seeds, names, out = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
r = REGIMES[regime]
params = ChainParams(r["hops"], r["hazard_a"], r["hazard_b"])
rows = [m for m in methods([]) if m.name in names]
lo, hi = map(int, seeds.split("-"))
from pathlib import Path
for s in range(lo, hi + 1):
    t0 = time.time()
    res = run_seed(s, rows, params, SimSettings())
    write_records(Path(out), "chain", s, res, {"regime": regime, "diag": names})
    print(s, f"{time.time()-t0:.0f}s", {n: round(100*np.mean(res[n]["accuracy"][-5:]), 2) for n in names}, flush=True)
