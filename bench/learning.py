"""TRACE against the baselines at equal leaf budget, end to end on a CPU (issue 6).

Every method is the same ``train`` flow with another ``allocator``: grpo, dapo, prompt_only,
random_prefix, trace. Each (method, seed) run starts from the same bootstrapped tiny policy, spends
the same number of trajectories (leaves) per step, and is evaluated on held-out items of the family
at a few checkpoints (``--eval-samples`` rollouts per item at ``--eval-temperature``, the
training temperature by default: greedy decoding saturates). Printed per
method (mean and spread over seeds): final and best held-out accuracy, the area under accuracy
versus cumulative leaf budget (normalised to [0, 1]), the mean effective ratio over steps, tokens
and tool calls spent, and wall time; above the last line, TRACE minus each method paired by seed
(mean and standard error). A plot of accuracy against cumulative budget is saved.

    python -m bench.learning                 # the full benchmark (see --help)
    python -m bench.learning --quick         # a small configuration (what the test suite runs)

With ``--jobs 2`` (the default on a 2-core machine) the runs go to two worker processes, each
with its own work dir under ``--workdir`` (``job-<method>-s<seed>``; query one with
``trace sql --workdir ...``); ``--jobs 1`` keeps every run in one process and one DuckDB file.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

METHODS = ("trace", "grpo", "dapo", "prompt_only", "random_prefix")


@dataclass
class RunResult:
    method: str
    seed: int
    eval_steps: list[int]  # -1 = the starting policy
    accuracy: list[float]
    effective_ratio: list[float]
    leaves: list[float]
    generated_tokens: float
    tool_calls: float
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def _eval(cfg_dict: dict[str, Any], policy_dir: str, items: int, skip: int, samples: int,
          temperature: float) -> float:
    """Mean reward of ``samples`` rollouts per item at ``temperature`` on test items the bootstrap
    never saw: it picks its SFT epoch by success on the first ``eval_items`` test items and reports
    on the next ``report_items``, so accuracy on those is biased upward (measured: 27% there vs 16%
    on train items for the same policy)."""
    from flows.evaluate import evaluate_rollouts
    from trace_rl.config import config_from_mapping

    cfg = config_from_mapping(cfg_dict, "bench.learning")
    out = evaluate_rollouts.fn(cfg.to_dict(), policy_dir, cfg.eval_split, items, samples,
                               temperature, skip=skip)
    return out["accuracy"]


def run_one(method: str, seed: int, base: dict[str, Any], policy: str, workdir: Path,
            eval_steps: Sequence[int], eval_items: int, start_accuracy: float,
            eval_skip: int, eval_samples: int, eval_temperature: float) -> RunResult:
    from flows.train import train
    from tasks.runtime import Paths
    from trace_rl.storage.store import TreeStore

    config = {**base, "allocator": method, "seed": seed, "policy": policy,
              "run_name": f"learn-{method}-s{seed}"}
    t0 = time.perf_counter()
    summary = train(config=config, workdir=str(workdir))
    wall = time.perf_counter() - t0
    run_id = summary["run_id"]
    store = TreeStore(workdir / "trace.duckdb", create=False)
    steps = store.query("SELECT step, metrics_json FROM steps WHERE run_id = $r AND status = 'complete' "
                        "ORDER BY step", {"r": run_id}).to_pylist()
    metrics = [json.loads(s["metrics_json"]) for s in steps]
    acc = [start_accuracy]
    eval_cfg = {**config, "run_id": "learn-eval"}  # one evaluation engine, weights reloaded
    for s in eval_steps:
        acc.append(_eval(eval_cfg, str(Paths(workdir).policy_dir(run_id, s)), eval_items, eval_skip,
                         eval_samples, eval_temperature))
    return RunResult(method=method, seed=seed, eval_steps=[-1, *eval_steps], accuracy=acc,
                     effective_ratio=[m["tree/effective_ratio"] for m in metrics],
                     leaves=[m["rollout/leaves"] for m in metrics],
                     generated_tokens=sum(m["ledger/generated_tokens"] for m in metrics),
                     tool_calls=sum(m["ledger/tool_calls"] for m in metrics), wall_s=wall,
                     extra={"reward_mean": float(np.mean([m["rollout/reward_mean"] for m in metrics]))})


def _run_job(job: tuple[str, int], base: dict[str, Any], policy: str, workdir: str,
             eval_steps: Sequence[int], start: float, ev: dict[str, Any]) -> RunResult:
    """One (method, seed) run in a worker process, in a work dir of its own: a DuckDB file has
    one writer process, and each worker runs its own flows (and temporary Prefect server)."""
    from tasks.runtime import configure_threads

    configure_threads()
    method, seed = job
    return run_one(method, seed, base, policy, Path(workdir) / f"job-{method}-s{seed}", eval_steps,
                   start_accuracy=start, **ev)


def run_parallel(jobs: Sequence[tuple[str, int]], workers: int, base: dict[str, Any], policy: str,
                 workdir: Path, eval_steps: Sequence[int], start: float,
                 ev: dict[str, Any]) -> list[RunResult]:
    """The (method, seed) runs on ``workers`` processes (each one torch thread), results in job
    order. Every run is still the same train flow from the same policy; only the work dir
    differs (``<workdir>/job-<method>-s<seed>``)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")  # no forked torch / Prefect state
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(_run_job, job, base, str(Path(policy).resolve()), str(workdir),
                               list(eval_steps), start, ev) for job in jobs]
        return [f.result() for f in futures]


def area_under_curve(budget: Sequence[float], accuracy: Sequence[float]) -> float:
    """Trapezoid area under accuracy vs cumulative budget, divided by the budget span: the mean
    accuracy over the budget, in [0, 1]."""
    x, y = np.asarray(budget, dtype=float), np.asarray(accuracy, dtype=float)
    return float(np.trapezoid(y, x) / (x[-1] - x[0])) if x[-1] > x[0] else float(y[-1])


def _final(r: RunResult) -> float:
    return r.accuracy[-1]


def _auc(r: RunResult) -> float:
    """Area under accuracy vs cumulative budget; the budget is proportional to the steps and the
    area is normalised by its span, so steps stand in for leaves."""
    return area_under_curve([e + 1 for e in r.eval_steps], r.accuracy)


def summarise(results: list[RunResult], leaves_per_step: int) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for method in dict.fromkeys(r.method for r in results):
        rs = [r for r in results if r.method == method]
        budget = [(s + 1) * leaves_per_step for s in rs[0].eval_steps]
        final = [_final(r) for r in rs]
        best = [max(r.accuracy[1:]) for r in rs]
        auc = [_auc(r) for r in rs]
        table[method] = {
            "final": (float(np.mean(final)), float(np.std(final))),
            "best": (float(np.mean(best)), float(np.std(best))),
            "auc": (float(np.mean(auc)), float(np.std(auc))),
            "effective_ratio": float(np.mean([np.mean(r.effective_ratio) for r in rs])),
            "generated_tokens": float(np.mean([r.generated_tokens for r in rs])),
            "tool_calls": float(np.mean([r.tool_calls for r in rs])),
            "wall_s": float(np.mean([r.wall_s for r in rs])),
            "leaves": float(np.mean([sum(r.leaves) for r in rs])),
            "curve_budget": budget,
            "curve": np.mean([r.accuracy for r in rs], axis=0).tolist(),
        }
    return table


def paired(results: list[RunResult], method: str = "trace") -> dict[str, dict[str, Any]]:
    """``method`` minus each other method, per seed both ran (same starting policy, same seed of
    the train flow): mean and standard error of the seed-wise differences in final accuracy and
    AUC. Seeds share the pool draws and the held-out items, so the paired difference is less noisy
    than the difference of two means; with 3 seeds its s.e. is still rough."""
    def by_seed(m: str) -> dict[int, RunResult]:
        return {r.seed: r for r in results if r.method == m}

    mine, out = by_seed(method), {}
    for other in dict.fromkeys(r.method for r in results if r.method != method):
        theirs = by_seed(other)
        seeds = sorted(set(mine) & set(theirs))
        if not seeds:
            continue
        row: dict[str, Any] = {"seeds": seeds}
        for key, get in (("final", _final), ("auc", _auc)):
            d = np.array([get(mine[s]) - get(theirs[s]) for s in seeds])
            se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
            row[key] = (float(d.mean()), se)
        out[other] = row
    return out


def print_paired(diffs: dict[str, dict[str, Any]], method: str = "trace") -> None:
    for other, row in diffs.items():
        f, a = row["final"], row["auc"]
        print(f"{method} - {other:<14} final {100 * f[0]:+5.1f} ± {100 * f[1]:3.1f}   "
              f"AUC {100 * a[0]:+5.1f} ± {100 * a[1]:3.1f}   (paired over seeds "
              f"{','.join(map(str, row['seeds']))}; ± = s.e.)")


def print_table(table: dict[str, dict[str, Any]], seeds: int) -> None:
    head = (f"{'method':<14}{'final acc':>14}{'best acc':>14}{'AUC':>14}{'eff.ratio':>10}"
            f"{'leaves':>8}{'gen tokens':>12}{'tool calls':>11}{'wall s':>8}")
    print(f"held-out accuracy: mean ± std over {seeds} seed(s)")
    print(head)
    print("-" * len(head))
    for m, t in table.items():
        pm = lambda v: f"{100 * v[0]:5.1f} ± {100 * v[1]:4.1f}"  # noqa: E731
        print(f"{m:<14}{pm(t['final']):>14}{pm(t['best']):>14}{pm(t['auc']):>14}"
              f"{t['effective_ratio']:>10.2f}{t['leaves']:>8.0f}{t['generated_tokens']:>12.0f}"
              f"{t['tool_calls']:>11.0f}{t['wall_s']:>8.0f}")


def plot(table: dict[str, dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, t in table.items():
        ax.plot(t["curve_budget"], [100 * a for a in t["curve"]], marker="o", label=m,
                linewidth=2.5 if m == "trace" else 1.2)
    ax.set_xlabel("cumulative budget (trajectories)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title("accuracy vs sampling budget (mean over seeds)")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="synth_arith")
    ap.add_argument("--difficulty", type=int, default=1)
    ap.add_argument("--mix", default="",
                    help="item difficulties taken in turn, e.g. 1,2,3 (a pool of uneven prompts; "
                         "--difficulty must be >= the largest); default: all at --difficulty")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed-start", type=int, default=0,
                    help="first seed (runs seeds seed-start .. seed-start + seeds - 1)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-items", type=int, default=200)
    ap.add_argument("--eval-samples", type=int, default=4,
                    help="rollouts per held-out item; accuracy is their mean reward")
    ap.add_argument("--eval-temperature", type=float, default=1.0,
                    help="sampling temperature of the evaluation (1.0 = the training rollouts'; "
                         "greedy saturates: the bootstrapped policy answers 100%% of held-out "
                         "items greedily while sampling succeeds ~50%%)")
    ap.add_argument("--learning-rate", type=float, default=None,
                    help="policy learning rate for every method (default: the config's)")
    ap.add_argument("--root-budget", type=int, default=16,
                    help="M: bare rollouts per step of the tree methods (leaves per step: M (1 + N))")
    ap.add_argument("--multiplier", type=int, default=2,
                    help="N: continuation multiplier (2: the smallest of the paper's budget "
                         "configurations, as in bench/allocation.py)")
    ap.add_argument("--pool-size", type=int, default=32)
    ap.add_argument("--train-items", type=int, default=None,
                    help="size of the train split (default: the family's, 2000 for the synthetic "
                         "ones, so a 20-step run rarely rolls out a prompt twice); a smaller split "
                         "makes prompts recur across steps, as in multi-epoch training")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="further TrainConfig fields for every method (e.g. loss_agg=seq-mean-token-mean)")
    ap.add_argument("--workdir", default="bench_runs/learning",
                    help="keeps the bootstrapped policy (cached) and every run's trees and metrics")
    ap.add_argument("--plot", default="docs/learning.png")
    ap.add_argument("--jobs", type=int, default=None,
                    help="(method, seed) runs in parallel worker processes, one torch thread "
                         "each (default: 2 on a machine with >= 2 cores, 1 with --quick); 1 = all "
                         "in this process, in one work dir")
    ap.add_argument("--quick", action="store_true", help="a small configuration for the tests")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.eval_every, args.eval_items, args.eval_samples = 1, 2, 2, 8, 2
        args.root_budget, args.pool_size = 4, 8
    if args.jobs is None:
        args.jobs = 1 if args.quick else min(2, os.cpu_count() or 1)
    workdir = Path(args.workdir)
    from flows.bootstrap import bootstrap

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    mix = [int(d) for d in args.mix.split(",") if d.strip()]
    policy = bootstrap(family=args.family, difficulty=args.difficulty, workdir=str(workdir), seed=0,
                       preset="test" if args.quick else "tiny", mix=mix or None)
    base = {"family": args.family, "difficulty": args.difficulty, "steps": args.steps,
            "root_budget": args.root_budget, "multiplier": args.multiplier,
            "pool_size": args.pool_size, "plot_every": 0, "engine": "hf",
            "checkpoint_every": args.eval_every}
    seen = json.loads((Path(policy) / "bootstrap.json").read_text())["config"]
    skip = seen["eval_items"] + seen["report_items"]
    base["extra"] = {"n_test": skip + args.eval_items, **({"mix": mix} if mix else {}),
                     **({"n_train": args.train_items} if args.train_items is not None else {})}
    if args.learning_rate is not None:
        base["learning_rate"] = args.learning_rate
    if args.set:  # parsed (and unknown keys refused) exactly as `trace train key=value` does
        from trace_rl.config import load_config

        overridden = load_config(None, args.set)
        keys = [kv.split("=", 1)[0].strip() for kv in args.set]
        base.update({k: getattr(overridden, k) for k in keys})
    eval_steps = sorted({*range(args.eval_every - 1, args.steps, args.eval_every), args.steps - 1})
    ev = dict(eval_items=args.eval_items, eval_skip=skip, eval_samples=args.eval_samples,
              eval_temperature=args.eval_temperature)
    start = _eval({**base, "policy": policy, "run_id": "learn-eval"}, policy, args.eval_items, skip,
                  args.eval_samples, args.eval_temperature)
    jobs = [(m, s) for s in range(args.seed_start, args.seed_start + args.seeds) for m in methods]
    if args.jobs <= 1:
        results = [run_one(m, s, base, policy, workdir, eval_steps, start_accuracy=start, **ev)
                   for m, s in jobs]
    else:
        results = run_parallel(jobs, args.jobs, base, policy, workdir, eval_steps, start, ev)
    leaves_per_step = args.root_budget * (1 + args.multiplier)
    table = summarise(results, leaves_per_step)
    record = workdir / "learning_results.json"  # every run's curve, per seed, for later reading
    record.write_text(json.dumps({"args": vars(args), "start_accuracy": start,
                                  "results": [r.__dict__ for r in results]}, indent=1) + "\n")
    print(f"\nfamily {args.family} (difficulty {args.mix or args.difficulty}), {args.steps} steps x "
          f"{leaves_per_step} leaves, starting accuracy {100 * start:.1f}% ({args.eval_items} "
          f"held-out items x {args.eval_samples} samples at temperature {args.eval_temperature}), "
          f"workdir {workdir} (per-run curves: {record})")
    print_table(table, args.seeds)
    diffs = paired(results)
    print_paired(diffs)
    if args.plot:
        plot(table, Path(args.plot))
        print(f"plot: {args.plot}")
    if "trace" in table and len(table) > 1:
        others = {m: t for m, t in table.items() if m != "trace"}
        best = max(others, key=lambda m: others[m]["final"][0])
        delta = 100 * (table["trace"]["final"][0] - others[best]["final"][0])
        ratio = (table["trace"]["effective_ratio"] / table["grpo"]["effective_ratio"]
                 if table.get("grpo", {}).get("effective_ratio") else float("nan"))
        print(f"TRACE vs best baseline: {delta:+.1f} points held-out accuracy; "
              f"effective ratio {ratio:.2f}x GRPO")
    return {"table": table, "paired": diffs, "results": [r.__dict__ for r in results]}


if __name__ == "__main__":
    main()
