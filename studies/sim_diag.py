"""Diagnostic rows of the learning simulator (docs/results.md, "Learning simulator": "Did not
help"): ``trace_rl.sim.run.run_seed`` on the named rows only, on the chain structure, with
records as the CLI writes them (results/README.md).

    python -m studies.sim_diag paper 100-107 trace_cover,grpo,cover_noexp results/learning_sim/diag/<name>

``control`` as the regime runs the negative control instead (``bench.learning_sim``'s: every item
the same, nothing to target), recorded as the ``control`` structure.
"""
import sys
import time
from pathlib import Path

import numpy as np

from bench.learning_runs import parse_seeds
from bench.learning_sim import REGIMES, write_records
from trace_rl.sim.model import ChainParams
from trace_rl.sim.run import SimSettings, methods, run_seed


def main(regime: str, seeds: str, names: list[str], out: Path) -> None:
    control = regime == "control"
    params = ChainParams(structure="arith") if control else ChainParams(**REGIMES[regime])
    rows = [m for m in methods([]) if m.name in names]
    for s in parse_seeds(seeds, count=False):
        t0 = time.time()
        res = run_seed(s, rows, params, SimSettings())
        write_records(out, "control" if control else "chain", s, res, {"regime": regime, "diag": names})
        print(s, f"{time.time() - t0:.0f}s",
              {n: round(100 * np.mean(res[n]["accuracy"][-5:]), 2) for n in names}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3].split(","), Path(sys.argv[4]))
