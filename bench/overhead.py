"""Where a training step's wall time goes (docs/results.md, "The overhead of a step, and the
optimiser against the machine").

Runs the real ``train`` flow (Prefect, DuckDB, MLflow, the tiny policy bootstrapped as ``trace
train`` does) in a new work dir and ``PREFECT_HOME``, then reads the timers the run recorded: the
step's wall (``steps``), generation (``ledger.wall_seconds``), the optimiser (``loss/seconds``) and
each phase (Prefect's task runs). The overhead is the wall less generation and the optimiser, as a
share of the wall; the engine's start (once per process) is reported on its own. Cases:
``default`` (``trace train``'s defaults, evaluation off; the share is over the steps after step 0,
which also warms caches) and ``4096`` (one step of 4,096 leaves).

    python -m bench.overhead --out bench_runs/overhead.json            # both cases
    python -m bench.overhead --case default --steps 4
    python -m bench.overhead --case default --ref main   # main's code, then this checkout's
    python -m bench.overhead --case default --ref main --repeats 3   # A B B A A B: the
                                                          # difference with its 95% interval

``--keep DIR`` keeps the work dirs (``studies.optimiser`` replays a kept run's last policy update).

The optimiser's throughput is read the same way for every code, from the run's DuckDB file (so a
``--ref`` older than this reading is measured alike): **trained tokens per second** = the tokens of
the paths the update trains (every token of a root-to-leaf path of a tree whose leaves disagree:
the others carry no advantage under binary rewards) times its passes over them (``loss/updates``
over ``mini_batches``), over ``loss/seconds``; as ``studies.optimiser`` counts them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from datetime import timezone
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from bench import add_options

CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "4096": {"pool_size": 512, "root_budget": 1024, "multiplier": 3, "steps": 1},
}
"""Config overrides per case (on top of the defaults, ``eval_items=0`` and ``--steps``)."""


def _task_runs(flow_run_id: str) -> list[Any]:
    """Every task run of the flow run, from the Prefect server the flow reported to."""
    from uuid import UUID

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    runs, offset = [], 0
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(flow_run_id)])),
                offset=offset, limit=200)
            runs += page
            offset += len(page)
            if len(page) < 200:
                return runs


def _phase(name: str) -> str:
    """A task run's phase: its name without the suffix Prefect adds (``expand-roots-3f1``)."""
    head, _, tail = name.rpartition("-")
    return head if head and len(tail) == 3 and tail.isalnum() else name


def measure(workdir: Path, run_id: str) -> list[dict[str, Any]]:
    """Per step of the run: wall, generation, optimiser and phase seconds (from its records)."""
    from trace_rl.storage.store import TreeStore

    store = TreeStore(workdir, create=False)
    q = {"r": run_id}
    steps = store.query("SELECT step, started_at, finished_at, metrics_json FROM steps "
                        "WHERE run_id = $r AND status = 'complete' ORDER BY step", q).to_pylist()
    gen = {r["step"]: r["s"] for r in store.query(
        "SELECT step, sum(wall_seconds) AS s FROM ledger WHERE run_id = $r GROUP BY step",
        q).to_pylist()}
    flow_run_id = store.get_run(run_id)["prefect_flow_run_id"]
    tasks = [t for t in _task_runs(flow_run_id) if t.start_time and t.end_time]
    out = []
    for s in steps:
        start = s["started_at"].replace(tzinfo=timezone.utc)
        end = s["finished_at"].replace(tzinfo=timezone.utc)
        phases: dict[str, float] = defaultdict(float)
        for t in tasks:
            if start <= t.start_time <= end:
                phases[_phase(t.name)] += (t.end_time - t.start_time).total_seconds()
        metrics = json.loads(s["metrics_json"])
        wall = (end - start).total_seconds()
        gen_s, opt_s = float(gen.get(s["step"], 0)), float(metrics["loss/seconds"])
        out.append({"step": s["step"], "wall_s": wall, "generation_s": gen_s, "optimiser_s": opt_s,
                    "leaves": int(metrics["rollout/leaves"]), "tasks_s": sum(phases.values()),
                    "phases_s": dict(phases), "overhead_s": wall - gen_s - opt_s,
                    "overhead_share": (wall - gen_s - opt_s) / wall})
    return out


TRAINED_TOKENS = """
WITH p AS (
    SELECT p.step, p.root_id, sum(n.gen_tokens + n.obs_tokens) AS tokens
    FROM paths p, unnest(p.node_ids) AS u(id) JOIN nodes n ON n.node_id = u.id
    WHERE p.run_id = $r GROUP BY p.step, p.leaf_id, p.root_id)
SELECT p.step, sum(p.tokens) AS tokens FROM p JOIN subtree_stats s ON s.node_id = p.root_id
WHERE s.min_reward < s.max_reward GROUP BY p.step ORDER BY p.step
"""
"""Per step: the tokens of every path of a mixed tree (one count per path, shared prefixes again)."""


def optimiser_throughput(workdir: Path) -> dict[int, dict[str, float]]:
    """Per step of the work dir's one run: the optimiser's trained tokens, seconds and tokens/s,
    read with plain SQL from its DuckDB file (any code's run). Steps without an update: absent."""
    import duckdb

    with duckdb.connect(str(workdir / "trace.duckdb"), read_only=True) as con:
        (run_id, config), = con.execute("SELECT run_id, config_json FROM runs").fetchall()
        mini = json.loads(config).get("mini_batches", 1)
        tokens = dict(con.execute(TRAINED_TOKENS, {"r": run_id}).fetchall())
        steps = con.execute("SELECT step, metrics_json FROM steps WHERE run_id = $r AND "
                            "status = 'complete'", {"r": run_id}).fetchall()
    out = {}
    for step, metrics_json in steps:
        m = json.loads(metrics_json)
        seconds, updates = m.get("loss/seconds"), m.get("loss/updates", 0.0)
        if not seconds or not updates or not tokens.get(step):
            continue
        trained = float(tokens[step]) * updates / mini
        out[int(step)] = {"trained_tokens": trained, "optimiser_s": float(seconds),
                          "tokens_per_s": trained / float(seconds)}
    return out


def with_throughput(result: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """``result`` with the optimiser's trained tokens/s per step and over ``share_over``."""
    per_step = optimiser_throughput(workdir)
    for r in result["steps"]:
        r.update(per_step.get(r["step"], {}))
    over = [per_step[s] for s in result["share_over"] if s in per_step]
    total_s = sum(x["optimiser_s"] for x in over)
    result["optimiser_tokens_per_s"] = (sum(x["trained_tokens"] for x in over) / total_s
                                        if total_s else float("nan"))
    return result


def run_case(name: str, steps: int, root: Path) -> dict[str, Any]:
    """One real train run of the case in ``root``; its per-step figures. Every rollout engine's
    start (vLLM's takes minutes here) is timed: once per process, not a cost of a step."""
    import trace_rl.engines as engines
    from flows.train import train
    from trace_rl.config import TrainConfig

    make, starts = engines.make_engine, []

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return make(*args, **kwargs)
        finally:
            starts.append(time.perf_counter() - t0)

    overrides = {"steps": steps, **CASES[name], "eval_items": 0, "run_name": f"overhead-{name}"}
    cfg = TrainConfig(**overrides)
    workdir = root / name
    t0 = time.perf_counter()
    engines.make_engine = timed
    try:
        summary = train(config=cfg, workdir=str(workdir))
    finally:
        engines.make_engine = make
    total = time.perf_counter() - t0
    rows = measure(workdir, summary["run_id"])
    rows[0]["engine_start_s"] = sum(starts)  # started by step 0's first rollout
    rows[0]["overhead_s"] -= rows[0]["engine_start_s"]
    rows[0]["overhead_share"] = rows[0]["overhead_s"] / rows[0]["wall_s"]
    later = rows[1:] or rows  # step 0 also starts the engine (not counted) and warms caches
    share = sum(r["overhead_s"] for r in later) / sum(r["wall_s"] for r in later)
    return with_throughput({"case": name, "overrides": overrides, "run_s": total, "steps": rows,
                            "overhead_share": share, "share_over": [r["step"] for r in later]},
                           workdir)


def report(result: dict[str, Any]) -> str:
    """The case as text: per step, then the overhead's phases of the last step."""
    lines = [f"case {result['case']} ({json.dumps(result['overrides'], sort_keys=True)}), "
             f"run {result['run_s']:.1f} s, code {result['code']}"]
    lines.append("  step  leaves   wall s  engine start s  generation s  optimiser s  overhead s"
                 "  share")
    for r in result["steps"]:
        lines.append(f"  {r['step']:4d}  {r['leaves']:6d}  {r['wall_s']:7.1f}  "
                     f"{r.get('engine_start_s', 0.0):14.1f}  {r['generation_s']:12.1f}  "
                     f"{r['optimiser_s']:11.1f}  {r['overhead_s']:10.1f}  "
                     f"{100 * r['overhead_share']:4.1f}%")
    last = result["steps"][-1]
    lines.append(f"  overhead share (steps {result['share_over']}): "
                 f"{100 * result['overhead_share']:.1f}%; optimiser "
                 f"{result.get('optimiser_tokens_per_s', float('nan')):.0f} trained tokens/s")
    lines.append(f"  step {last['step']} by phase (Prefect task runs, s; generation is inside "
                 f"expand-*, the optimiser inside policy-update):")
    for phase, s in sorted(last["phases_s"].items(), key=lambda kv: -kv[1]):
        lines.append(f"    {phase:20s} {s:7.2f}")
    lines.append(f"    {'(outside tasks)':20s} {last['wall_s'] - last['tasks_s']:7.2f}")
    return "\n".join(lines)


@contextlib.contextmanager
def worktree(ref: str, tree: Path) -> Iterator[tuple[Path, str]]:
    """A detached git worktree of ``ref`` at ``tree`` for the block, and its short commit."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), ref],
                   check=True, capture_output=True)
    try:
        yield tree, subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                                   check=True, capture_output=True, text=True).stdout.strip()
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                       capture_output=True)


def run_in(tree: Path, name: str, steps: int, out: Path) -> dict[str, Any]:
    """``run_case`` on the code checked out at ``tree``, in a process of its own (a new Prefect
    home); its figures, with the optimiser's throughput read here from the work dir it keeps
    (``out`` without its suffix), the same way for every code."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_HOME", "PREFECT_API_URL")}
    module = next(d for d in ("bench", "studies") if (tree / d / "overhead.py").exists()) + ".overhead"
    log = out.with_suffix(".log")
    with log.open("w") as sink:  # its own report says "this checkout" of whichever code it ran
        done = subprocess.run([sys.executable, "-m", module, "--case", name, "--steps", str(steps),
                               "--out", str(out), "--keep", str(out.with_suffix(""))], cwd=tree,
                              env={**env, "PYTHONPATH": str(tree)}, stdout=sink,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"the run of {tree} exited {done.returncode}; its log {log} ends:\n{tail}")
    return with_throughput(json.loads(out.read_text())[0], out.with_suffix("") / name)


def alternate(ref: str, name: str, steps: int, repeats: int, root: Path) -> list[dict[str, Any]]:
    """``repeats`` runs of ``ref``'s code and as many of this checkout's, each in a process of its
    own, in the order A B B A A B ... (a drift of the machine's speed falls on both); the runs'
    figures, each with its code and order."""
    repo = Path(__file__).resolve().parents[1]
    runs = []
    with worktree(ref, root / f"ref-{name}") as (tree, commit):
        codes = [(tree, f"{ref} ({commit})"), (repo, "this checkout")]
        for r in range(repeats):
            for tree_, code in codes if r % 2 == 0 else codes[::-1]:
                result = run_in(tree_, name, steps, root / f"run-{name}-{len(runs)}.json")
                runs.append({**result, "code": code, "order": len(runs)})
                print(report(runs[-1]), flush=True)
    return runs


def compare(runs: list[dict[str, Any]]) -> str:
    """The overhead share of each code over its runs (mean, and the runs' spread), and the
    difference of the pairs' shares (this checkout less the ref, per repeat) with its 95%
    interval."""
    from trace_core.stats import mean_interval

    ref = [r for r in runs if r["code"] != "this checkout"]
    now = [r for r in runs if r["code"] == "this checkout"]
    lines = []
    for rs in (ref, now):
        shares = [100 * r["overhead_share"] for r in rs]
        per_step = [s["overhead_s"] for r in rs for s in r["steps"] if s["step"] in r["share_over"]]
        rates = [r["optimiser_tokens_per_s"] for r in rs]
        lines.append(f"  {rs[0]['code']}: overhead share {np.mean(shares):.1f}% over {len(rs)} runs "
                     f"({', '.join(f'{x:.1f}' for x in shares)}); {np.median(per_step):.2f} s a "
                     f"step (median over {len(per_step)} steps); optimiser {np.mean(rates):.0f} "
                     f"trained tokens/s ({', '.join(f'{x:.0f}' for x in rates)})")
    diff = [100 * (b["overhead_share"] - a["overhead_share"]) for a, b in zip(ref, now)]
    if len(diff) >= 2:
        d = mean_interval(diff)
        lines.append(f"  this checkout - ref: {d.mean:+.1f} points (95% CI {d.low:+.1f}, "
                     f"{d.high:+.1f}) over {len(diff)} pairs")
    logs = [np.log(b["optimiser_tokens_per_s"] / a["optimiser_tokens_per_s"]) for a, b in zip(ref, now)]
    if logs and np.all(np.isfinite(logs)):
        g = mean_interval(logs) if len(logs) >= 2 else None
        ci = f" (95% CI {np.exp(g.low):.2f}x, {np.exp(g.high):.2f}x)" if g else ""
        lines.append(f"  optimiser trained tokens/s, this checkout / ref: {np.exp(np.mean(logs)):.2f}x"
                     f"{ci} over {len(logs)} pairs (geometric mean)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=sorted(CASES), action="append",
                   help="case to run (repeatable; default: all)")
    add_options(p, ("--steps", 3, "steps of the default case"),
                ("--out", Path, "also write the figures here as JSON"),
                ("--keep", Path, "keep the work dirs under this folder (default: a temporary one)"),
                ("--ref", str, "also run each case on the code of this git revision (before/after), "
                               "each run in a process of its own"),
                ("--repeats", 1, "with --ref: this many runs of each, alternating; from 2 on the "
                                 "difference comes with its 95%% interval"))
    args = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="trace-overhead-") as tmp:
        for name in args.case or ["default", "4096"]:
            if args.ref:
                runs = alternate(args.ref, name, args.steps, args.repeats, args.keep or Path(tmp))
                results += runs
                print(f"case {name}, {args.repeats} run(s) of each:\n{compare(runs)}", flush=True)
            else:
                results.append({**run_case(name, args.steps, args.keep or Path(tmp)),
                                "code": "this checkout"})
                print(report(results[-1]), flush=True)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    # A new Prefect home (its own database) per invocation, set before Prefect is imported.
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="trace-overhead-prefect-"))
    from trace_rl.engines import entry_point

    sys.exit(entry_point(main))  # its engines stop with it (trace_rl.engines.lifecycle)
