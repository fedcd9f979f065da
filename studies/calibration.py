"""Is the allocation's reading of the predictor right? Predicted vs realised disagreement, per depth.

Stage 1 and Stage 2 read a prediction v as the success probability of independent rollouts
(``trace_core.allocation``). This reads the trees a ``train`` run stored (a learning-benchmark work
dir holds one DuckDB file per job) and compares, per depth, what that reading predicts with what
happened (``trace_core.calibration``):

* depth 0 (roots): the share of disagreeing pairs among each root's bare rollouts, predicted
  2 v (1 - v);
* depth >= 1 (prefixes Stage 2 continued): the share of continuations whose outcome differs from
  the bare rollout's, predicted 1 - q with q = r v + (1 - r)(1 - v).

rho = 1 - realised / predicted is the intra-class correlation the pipeline estimates online
(``TrainConfig.correlation_window``); 0 means the independent-draw reading holds.

    python -m studies.calibration --workdir bench_runs/learning7
"""

from __future__ import annotations

import argparse
from pathlib import Path


def rows_for(workdir: Path) -> list[dict]:
    """One row per (run, depth) of every DuckDB file under ``workdir`` (itself or job-*/)."""
    from tasks.correlation import stored_terms
    from trace_rl.storage.store import TreeStore

    dbs = sorted(workdir.glob("job-*/trace.duckdb")) or [workdir / "trace.duckdb"]
    out = []
    for db in dbs:
        if not db.exists():
            raise FileNotFoundError(f"studies.calibration: no DuckDB store at {db}")
        runs = TreeStore(db, create=False).query(
            "SELECT r.run_id, max(n.step) AS last, any_value(n.allocator) AS allocator FROM runs r "
            "JOIN nodes n USING (run_id) GROUP BY r.run_id ORDER BY r.run_id").to_pylist()
        for run in runs:
            terms = stored_terms(str(db.parent), run["run_id"], 0, run["last"] + 1)
            for depth in sorted({t.depth for t in terms}):
                ts = [t for t in terms if t.depth == depth]
                units = sum(t.units for t in ts)
                predicted, realised = sum(t.expected for t in ts) / units, sum(t.observed for t in ts) / units
                out.append({"run": run["run_id"], "allocator": run["allocator"], "depth": depth,
                            "nodes": len(ts), "draws": units, "predicted": predicted,
                            "realised": realised,
                            "rho": 1.0 - realised / predicted if predicted > 0 else float("nan")})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, help="a train work dir or a bench.learning work dir")
    args = ap.parse_args(argv)
    rows = rows_for(Path(args.workdir))
    print(f"{'run':34s} {'allocator':13s} {'depth':>5s} {'nodes':>6s} {'draws':>6s} "
          f"{'predicted':>9s} {'realised':>9s} {'rho':>6s}")
    for r in rows:
        print(f"{r['run'][:34]:34s} {str(r['allocator']):13s} {r['depth']:5d} {r['nodes']:6d} "
              f"{r['draws']:6.0f} {r['predicted']:9.3f} {r['realised']:9.3f} {r['rho']:6.2f}")
    pre = [r for r in rows if r["depth"] >= 1]
    if pre:
        w = sum(r["draws"] for r in pre)
        print(f"prefixes (depth >= 1), all runs: predicted flip rate "
              f"{sum(r['predicted'] * r['draws'] for r in pre) / w:.3f}, realised "
              f"{sum(r['realised'] * r['draws'] for r in pre) / w:.3f} ({w:.0f} continuations)")


if __name__ == "__main__":
    main()
