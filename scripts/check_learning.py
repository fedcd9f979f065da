"""Did training improve the policy? The learning guard of ``.ci/run``.

    .venv/bin/python scripts/check_learning.py WORKDIR [--run-id ID]

Reads the run's summary from the work dir's store (``tasks.reports.run_summary``: held-out
accuracy before the first step and after the last, on the same items and sampling seeds, and the
paired gain with its 95% interval), prints it in one line, and exits 1 unless the interval lies
above zero. Default run: the newest complete run in the work dir (the README's main command
makes one). A change that stops learning (a zeroed policy gradient, a broken weight sync, a
reward that never reaches the update) leaves the interval holding zero and fails CI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from any folder


def newest_complete_run(workdir: str) -> str:
    from trace_rl.storage.store import TreeStore

    db = Path(workdir) / "trace.duckdb"
    if not db.is_file():
        raise SystemExit(f"check_learning: no store at {db}: did the main command run?")
    rows = TreeStore(db, create=False).query(
        "SELECT run_id FROM runs WHERE status = 'complete' ORDER BY created_at DESC LIMIT 1"
    ).to_pylist()
    if not rows:
        raise SystemExit(f"check_learning: no complete run in {db}")
    return rows[0]["run_id"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workdir")
    p.add_argument("--run-id", default=None, help="default: the newest complete run")
    args = p.parse_args(argv)
    from tasks.reports import run_summary

    run_id = args.run_id or newest_complete_run(args.workdir)
    s = run_summary(str(Path(args.workdir).resolve()), run_id)
    b, a, g = s["before"], s["after"], s["gain"]
    if not (b and a and g):
        print(f"learning guard: FAILED, run {run_id} has no paired evaluation before and after "
              "training")
        return 1
    ok = g["low"] > 0
    print(f"learning guard: {'passed' if ok else 'FAILED'}, run {run_id}: held-out accuracy "
          f"{b['accuracy']:.3f} -> {a['accuracy']:.3f} over {b['items']} items x {b['samples']} "
          f"samples; paired gain {100 * g['mean']:+.1f} points, 95% CI [{100 * g['low']:+.1f}, "
          f"{100 * g['high']:+.1f}] ({len(s['steps'])} steps, {s['generated_tokens']} generated "
          f"tokens){'' if ok else ': the interval does not lie above zero'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
