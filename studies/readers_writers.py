"""Readers and writers of a work dir: the checks, and what publishing costs.

    python -m studies.readers_writers race    [--reps 20] [--policy DIR] [--out DIR]
    python -m studies.readers_writers reader  [--hold-s 600] [--steps 5] [--policy DIR] [--out DIR]
    python -m studies.readers_writers publish [--sizes-mb 5,25,100] [--out DIR]

``race``: per repetition, two ``trace train steps=1`` started together on a fresh work dir, each
with its own embedded Prefect server, as a user would. Pass when exactly one exits 0 and the other
exits 3 at once with a message naming the first's pid and run id. Prints one line per repetition
and a summary (refusal seconds, winner seconds, crashes).

``reader``: a separate process opens ``<workdir>/trace.duckdb`` with
``duckdb.connect(path, read_only=True)`` (what ``duckdb -readonly`` does) and holds it for
``--hold-s`` seconds, querying it every 30 s; meanwhile ``trace train steps=N`` runs in that work
dir. Then the same config runs in a second work dir with no reader. Pass when the first run
finishes, its per-step times match the second's, and both runs' trees are equal (node ids without
the run id, texts, rewards, values).

``publish``: the cost of one publish (copy of the writer's private file + rename) against the file
size, on a synthetic store grown to each size.

``--policy``: a policy directory (skips the SFT bootstrap, ~6 min on 2 cores). Without it the
tiny policy is bootstrapped once into ``<out>/bootstrap`` and re-used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.pop("PREFECT_API_URL", None)
    return env


def _policy(args: argparse.Namespace) -> str:
    if args.policy:
        return args.policy
    from flows.bootstrap import bootstrap
    from trace_rl.config import TrainConfig

    cfg = TrainConfig()  # the defaults `trace train` bootstraps for
    return str(bootstrap(cfg.family, cfg.difficulty, str(Path(args.out) / "bootstrap"), cfg.seed))


def _train_cmd(workdir: Path, policy: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "cli", "train", "--workdir", str(workdir),
            f"policy={policy}", f"steps={steps}"]


def race(args: argparse.Namespace) -> dict:
    policy = _policy(args)
    rows = []
    for rep in range(args.reps):
        wd = Path(tempfile.mkdtemp(dir=args.out, prefix=f"race{rep:02d}-"))
        logs = [(wd.parent / f"{wd.name}-{i}.log").open("w") for i in range(2)]
        t0 = time.perf_counter()
        procs = [subprocess.Popen(_train_cmd(wd, policy, 1), cwd=REPO, env=_env(), stdout=log,
                                  stderr=subprocess.STDOUT) for log in logs]
        ended: dict[int, float] = {}
        while len(ended) < 2:
            for i, p in enumerate(procs):
                if i not in ended and p.poll() is not None:
                    ended[i] = time.perf_counter() - t0
            time.sleep(0.05)
        codes = [p.returncode for p in procs]
        out = [Path(log.name).read_text() for log in logs]
        ok = sorted(codes) == [0, 3]
        row = {"rep": rep, "codes": codes, "ok": ok}
        if ok:
            win, lose = codes.index(0), codes.index(3)
            msg = " ".join(out[lose].split())
            row.update(refused_s=round(ended[lose], 2), winner_s=round(ended[win], 1),
                       named=f"pid {procs[win].pid}" in msg and "run trace-" in msg)
            row["ok"] = row["named"]
        else:
            row["tails"] = [o[-600:] for o in out]
        rows.append(row)
        print(json.dumps(row), flush=True)
    good = [r for r in rows if r["ok"]]
    summary = {"reps": len(rows), "ok": len(good), "crashes": len(rows) - len(good),
               "refused_s_max": max((r["refused_s"] for r in good), default=None),
               "refused_s_median": statistics.median([r["refused_s"] for r in good]) if good else None,
               "winner_s_median": statistics.median([r["winner_s"] for r in good]) if good else None}
    print(json.dumps(summary), flush=True)
    return summary


HOLD = """
import duckdb, json, sys, time
t0 = time.time()
con = duckdb.connect(sys.argv[1], read_only=True)
print(json.dumps({"held": True}), flush=True)
while time.time() - t0 < float(sys.argv[2]):
    print(json.dumps({"t": round(time.time() - t0), "nodes":
                      con.execute("SELECT count(*) FROM nodes").fetchone()[0]}), flush=True)
    time.sleep(30)
print(json.dumps({"released_after_s": round(time.time() - t0)}), flush=True)
"""


def _trees(workdir: Path) -> tuple[list[tuple], list[float]]:
    from trace_rl.storage.store import TreeStore

    store = TreeStore(workdir, create=False)
    nodes = store.query("SELECT node_id, text, reward, value, is_leaf FROM nodes "
                        "ORDER BY step, tree_id, local_index").to_pylist()
    steps = store.query("SELECT metrics_json FROM steps ORDER BY step").to_pylist()
    return ([(n["node_id"].split("/", 1)[1], n["text"], n["reward"], n["value"], n["is_leaf"])
             for n in nodes], [json.loads(s["metrics_json"])["time/step_s"] for s in steps])


def reader(args: argparse.Namespace) -> dict:
    from trace_rl.storage.store import TreeStore

    policy = _policy(args)
    held, free = Path(args.out) / "with-reader", Path(args.out) / "no-reader"
    TreeStore(held)  # publish the schema so the reader has a file to hold before the run
    hold = subprocess.Popen([sys.executable, "-c", HOLD, str(held / "trace.duckdb"),
                             str(args.hold_s)], stdout=subprocess.PIPE, text=True)
    assert json.loads(hold.stdout.readline())["held"]
    runs = {}
    for name, wd in (("with_reader", held), ("no_reader", free)):
        t0 = time.perf_counter()
        with (Path(args.out) / f"{name}.log").open("w") as log:
            rc = subprocess.run(_train_cmd(wd, policy, args.steps), cwd=REPO, env=_env(),
                                stdout=log, stderr=subprocess.STDOUT).returncode
        runs[name] = {"rc": rc, "wall_s": round(time.perf_counter() - t0, 1),
                      "reader_alive": hold.poll() is None}
        print(json.dumps({name: runs[name]}), flush=True)
    out_lines = [json.loads(line) for line in hold.stdout]  # waits out the hold
    a, b = _trees(held), _trees(free)
    w = TreeStore(held)
    for _ in range(5):
        w._publish()
    summary = {
        "hold_s": args.hold_s, "runs": runs, "reader_rc": hold.wait(),
        "reader_saw": [o.get("nodes") for o in out_lines if "nodes" in o],
        "reader_released_after_s": out_lines[-1].get("released_after_s"),
        "nodes_equal": a[0] == b[0], "nodes": len(a[0]),
        "step_s_with_reader": [round(s, 2) for s in a[1]],
        "step_s_no_reader": [round(s, 2) for s in b[1]],
        "db_mb": round(w.private.stat().st_size / 2**20, 2),
        "publish_ms_median": round(1000 * statistics.median(w.publish_seconds), 1)}
    print(json.dumps(summary), flush=True)
    return summary


def publish(args: argparse.Namespace) -> list[dict]:
    import pyarrow as pa

    from trace_rl.storage.schema import NODE_INPUT
    from trace_rl.storage.store import TreeStore

    schema = pa.schema({c: t for c, (t, _) in NODE_INPUT.items()})
    store = TreeStore(Path(tempfile.mkdtemp(dir=args.out, prefix="publish-")))
    store.init_run("bench", {})
    rows_out, step = [], 0
    for target in sorted(float(x) for x in args.sizes_mb.split(",")):
        while store.private.stat().st_size < target * 2**20:
            rows = []
            for tree in range(32):
                rows.append(dict(tree_id=tree, local_index=0, parent_index=-1, depth=0, item_id="q",
                                 is_leaf=False, obs_token_ids=list(range(256))))
                for i in range(1, 8):
                    rows.append(dict(tree_id=tree, local_index=i, parent_index=i - 1, depth=i,
                                     item_id="q", is_leaf=i == 7, reward=1.0 if i == 7 else None,
                                     gen_token_ids=list(range(step, step + 128)),
                                     obs_token_ids=list(range(64)), text=f"turn {step}.{i} " * 40))
            rows = [{c: r.get(c) for c in NODE_INPUT} for r in rows]
            store.write_level("bench", step, 0, pa.Table.from_pylist(rows, schema=schema))
            step += 1
        store.publish_seconds.clear()
        for _ in range(5):
            store._publish()
        row = {"db_mb": round(store.private.stat().st_size / 2**20, 1), "steps": step,
               "publish_ms_median": round(1000 * statistics.median(store.publish_seconds), 1),
               "publish_ms_max": round(1000 * max(store.publish_seconds), 1),
               "write_level_lock_ms_median": round(1000 * statistics.median(list(store.lock_seconds)[-20:]), 1)}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    return rows_out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m studies.readers_writers",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("race", "reader", "publish"))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--hold-s", type=float, default=600.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--sizes-mb", default="5,25,100")
    ap.add_argument("--policy", default=None)
    ap.add_argument("--out", default=None, help="Folder for work dirs and logs (default: a temp dir).")
    args = ap.parse_args(argv)
    args.out = args.out or tempfile.mkdtemp(prefix="bench-rw-")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    {"race": race, "reader": reader, "publish": publish}[args.what](args)


if __name__ == "__main__":
    main()
