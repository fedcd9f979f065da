"""TRACE against the baselines at equal leaf budget, end to end on a CPU (issue 6).

Every method is the same ``train`` flow with another ``allocator``: grpo, dapo, prompt_only,
random_prefix, trace. Each (method, seed) run starts from the same bootstrapped tiny policy, spends
the same number of trajectories (leaves) per step, and is evaluated on held-out items of the family
at a few checkpoints (``--eval-samples`` rollouts per item at ``--eval-temperature``, the
training temperature by default: greedy decoding saturates). Printed per
method (mean and spread over seeds): final and best held-out accuracy, the area under accuracy
versus cumulative leaf budget (normalised to [0, 1]), the mean effective ratio over steps, tokens
and tool calls spent, and wall time; held-out accuracy at equal generated tokens (``@tokens``: at the
smallest token total any run spent, read off each run's accuracy-vs-tokens curve); above the last
line, TRACE minus each method paired by seed (mean and standard error). A plot of accuracy against
cumulative budget (leaves, and generated tokens) is saved. The last line compares at equal leaf
budget, the issue's basis; ``@tokens`` is a second view of the same runs (a continuation leaf
generates only its suffix, so tree methods spend fewer tokens per leaf).

    python -m bench.learning                 # the full benchmark (see --help)
    python -m bench.learning --quick         # a small configuration (what the test suite runs)
    python -m bench.learning --workdir DIR --summarise-only   # re-print a finished benchmark

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

METHODS = ("trace", "grpo", "dapo", "prompt_only", "random_prefix")
VARIANTS: dict[str, dict[str, Any]] = {
    "trace_oracle": {"allocator": "trace", "root_oracle": True},
    "trace_posterior": {"allocator": "trace", "root_posterior": 4.0},
}
"""Methods beyond the allocators: TRACE with Stage 1 scored by the family's oracle
(``TrainConfig.root_oracle``: on synth_chain 0.5 per homonym, scaled to the policy's success so
far; what a predictor ranking prompts by their hidden hazards would give), and TRACE with the
per-prompt posterior (``root_posterior`` 4)."""


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
    eval_tokens: list[float] = field(default_factory=list)  # generated tokens spent before each evaluation


def _eval(cfg_dict: dict[str, Any], policy_dir: str, items: int, skip: int, samples: int,
          temperature: float) -> float:
    """Mean reward of ``samples`` rollouts per item at ``temperature`` on test items the bootstrap
    never saw: it picks its SFT epoch by success on the first ``eval_items`` test items and reports
    on the next ``report_items``, so accuracy on those is biased upward (measured: 27% there vs 16%
    on train items for the same policy)."""
    from flows.evaluate import evaluate_rollouts
    from trace_rl.config import config_from_mapping

    cfg = config_from_mapping(cfg_dict, "bench.learning")
    out = evaluate_rollouts.fn(cfg, policy_dir, cfg.eval_split, items, samples,
                               temperature, skip=skip)
    return out["accuracy"]


def run_one(method: str, seed: int, base: dict[str, Any], policy: str, workdir: Path,
            eval_steps: Sequence[int], eval_items: int, start_accuracy: float,
            eval_skip: int, eval_samples: int, eval_temperature: float) -> RunResult:
    from flows.train import train
    from tasks.runtime import Paths
    from trace_rl.config import config_from_mapping
    from trace_rl.storage.store import TreeStore

    config = {**base, **VARIANTS.get(method, {"allocator": method}), "seed": seed,
              "policy": policy, "run_name": f"learn-{method}-s{seed}"}
    t0 = time.perf_counter()
    summary = train(config=config_from_mapping(config, "bench.learning"), workdir=str(workdir))
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
                     extra={"reward_mean": float(np.mean([m["rollout/reward_mean"] for m in metrics]))},
                     eval_tokens=tokens_at_evals(metrics, eval_steps))


def tokens_at_evals(metrics: Sequence[dict[str, Any]], eval_steps: Sequence[int]) -> list[float]:
    """Generated tokens spent before each evaluation: 0 before the first step, then the sum
    through each evaluated step, from the per-step metrics (step order)."""
    spent = np.cumsum([m["ledger/generated_tokens"] for m in metrics])
    if eval_steps and max(eval_steps) >= len(spent):
        raise ValueError(f"{len(spent)} steps stored, evaluations at steps {list(eval_steps)}")
    return [0.0, *(float(spent[s]) for s in eval_steps)]


def fill_eval_tokens(workdir: Path, r: RunResult) -> RunResult:
    """``r`` with its tokens per evaluation read back from the run's stored steps, for a results
    file written before they were recorded (the job's own work dir, else the shared one)."""
    if r.eval_tokens:
        return r
    from trace_rl.storage.store import TreeStore

    db = workdir / f"job-{r.method}-s{r.seed}" / "trace.duckdb"
    db = db if db.exists() else workdir / "trace.duckdb"
    if not db.exists():
        raise FileNotFoundError(f"{r.method} seed {r.seed}: no trace.duckdb under {workdir} to read "
                                "its generated tokens from")
    rows = TreeStore(db, create=False).query(
        "SELECT run_id, step, metrics_json FROM steps WHERE status = 'complete' AND run_id LIKE $p "
        "ORDER BY step", {"p": f"learn-{r.method}-s{r.seed}-%"}).to_pylist()
    runs = {row["run_id"] for row in rows}
    if len(runs) != 1:
        raise ValueError(f"{r.method} seed {r.seed}: {len(runs)} matching runs in {db} "
                         f"({sorted(runs)[:3]}); expected one")
    try:
        tokens = tokens_at_evals([json.loads(row["metrics_json"]) for row in rows], r.eval_steps[1:])
    except ValueError as exc:
        raise ValueError(f"{r.method} seed {r.seed}, {db}: {exc}") from exc
    return RunResult(**{**r.__dict__, "eval_tokens": tokens})


def parse_seeds(text: str, start: int = 0) -> list[int]:
    """``--seeds``: ``"3"`` = three seeds from ``start``; ``"3-5"`` = seeds 3, 4 and 5."""
    first, sep, last = str(text).partition("-")
    try:
        seeds = list(range(int(first), int(last) + 1)) if sep else \
            list(range(start, start + int(first)))
    except ValueError:
        raise ValueError(f"--seeds {text!r}: give a count (3) or a range (3-5)") from None
    if not seeds or min(seeds) < 0:
        raise ValueError(f"--seeds {text!r}: no seeds (a count >= 1, or a range low-high of seeds >= 0)")
    return seeds


def run_record(workdir: Path, method: str, seed: int) -> Path:
    """Where the result of one (method, seed) run is kept, so that seeds accumulate across
    invocations (``--seeds 3-5`` adds three to a benchmark of seeds 0-2)."""
    return workdir / "runs" / f"{method}-s{seed}.json"


def save_run(workdir: Path, signature: str, r: RunResult) -> Path:
    path = run_record(workdir, r.method, r.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"signature": signature, "result": r.__dict__}, indent=1) + "\n")
    tmp.rename(path)
    return path


def load_run(workdir: Path, signature: str, method: str, seed: int) -> RunResult | None:
    """The recorded run of (method, seed) made with the same settings (``signature``), or None."""
    path = run_record(workdir, method, seed)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    return RunResult(**data["result"]) if data.get("signature") == signature else None


def signature(base: dict[str, Any], eval_steps: Sequence[int], ev: dict[str, Any], policy: str) -> str:
    """What makes two runs of one method and seed the same run: the train config (every field
    but the method and seed), the evaluation settings and the starting policy's record."""
    import hashlib

    record = Path(policy) / "bootstrap.json"
    policy_id = json.loads(record.read_text()).get("input_hash", "") if record.exists() else policy
    blob = json.dumps({"base": base, "eval_steps": list(eval_steps), "ev": ev, "policy": policy_id},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _run_job(job: tuple[str, int], base: dict[str, Any], policy: str, workdir: str,
             eval_steps: Sequence[int], start: float, ev: dict[str, Any], sig: str) -> RunResult:
    """One (method, seed) run in a worker process, in a work dir of its own: a DuckDB file has
    one writer process, and each worker runs its own flows (and temporary Prefect server)."""
    from tasks.runtime import configure_threads

    configure_threads()
    method, seed = job
    r = run_one(method, seed, base, policy, Path(workdir) / f"job-{method}-s{seed}", eval_steps,
                start_accuracy=start, **ev)
    save_run(Path(workdir), sig, r)
    return r


def run_parallel(jobs: Sequence[tuple[str, int]], workers: int, base: dict[str, Any], policy: str,
                 workdir: Path, eval_steps: Sequence[int], start: float,
                 ev: dict[str, Any], sig: str) -> list[RunResult]:
    """The (method, seed) runs on ``workers`` processes (each one torch thread), results in job
    order, each saved as it ends (``save_run``). Every run is still the same train flow from the
    same policy; only the work dir differs (``<workdir>/job-<method>-s<seed>``)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")  # no forked torch / Prefect state
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = [pool.submit(_run_job, job, base, str(Path(policy).resolve()), str(workdir),
                               list(eval_steps), start, ev, sig) for job in jobs]
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


def token_budget(results: Sequence[RunResult]) -> float:
    """The generated-token budget every run reached: the smallest total any run spent (nan when
    no run recorded its tokens per evaluation)."""
    totals = [r.eval_tokens[-1] for r in results if r.eval_tokens]
    return float(min(totals)) if totals else float("nan")


def accuracy_at_tokens(r: RunResult, tokens: float) -> float:
    """Held-out accuracy of run ``r`` after ``tokens`` generated tokens: linear between its
    evaluations on the cumulative-token axis (the start at 0 tokens). nan beyond the run's total
    (no extrapolation) or without the run's tokens per evaluation."""
    if not r.eval_tokens:
        return float("nan")
    if len(r.eval_tokens) != len(r.accuracy) or np.any(np.diff(r.eval_tokens) < 0):
        raise ValueError(f"{r.method} seed {r.seed}: eval_tokens {r.eval_tokens} must rise with "
                         f"the {len(r.accuracy)} evaluations")
    if not 0 <= tokens <= r.eval_tokens[-1]:
        return float("nan")
    return float(np.interp(tokens, r.eval_tokens, r.accuracy))


def summarise(results: list[RunResult], leaves_per_step: int) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    budget_tokens = token_budget(results)
    for method in dict.fromkeys(r.method for r in results):
        rs = [r for r in results if r.method == method]
        budget = [(s + 1) * leaves_per_step for s in rs[0].eval_steps]
        final = [_final(r) for r in rs]
        best = [max(r.accuracy[1:]) for r in rs]
        auc = [_auc(r) for r in rs]
        at_tokens = [accuracy_at_tokens(r, budget_tokens) for r in rs]
        table[method] = {
            "final": (float(np.mean(final)), float(np.std(final))),
            "best": (float(np.mean(best)), float(np.std(best))),
            "auc": (float(np.mean(auc)), float(np.std(auc))),
            "at_tokens": (float(np.mean(at_tokens)), float(np.std(at_tokens))),
            "token_budget": budget_tokens,
            "effective_ratio": float(np.mean([np.mean(r.effective_ratio) for r in rs])),
            "generated_tokens": float(np.mean([r.generated_tokens for r in rs])),
            "tool_calls": float(np.mean([r.tool_calls for r in rs])),
            "wall_s": float(np.mean([r.wall_s for r in rs])),
            "leaves": float(np.mean([sum(r.leaves) for r in rs])),
            "curve_budget": budget,
            "curve": np.mean([r.accuracy for r in rs], axis=0).tolist(),
            "curve_tokens": (np.mean([r.eval_tokens for r in rs], axis=0).tolist()
                             if all(r.eval_tokens for r in rs) else []),
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
    budget_tokens = token_budget(results)
    at_tokens = lambda r: accuracy_at_tokens(r, budget_tokens)  # noqa: E731
    for other in dict.fromkeys(r.method for r in results if r.method != method):
        theirs = by_seed(other)
        seeds = sorted(set(mine) & set(theirs))
        if not seeds:
            continue
        row: dict[str, Any] = {"seeds": seeds}
        for key, get in (("final", _final), ("auc", _auc), ("at_tokens", at_tokens)):
            d = np.array([get(mine[s]) - get(theirs[s]) for s in seeds])
            se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
            row[key] = (float(d.mean()), se)
        out[other] = row
    return out


def paired_tests(results: list[RunResult], method: str = "trace", key: str = "at_tokens",
                 level: float = 0.95) -> dict[str, dict[str, Any]]:
    """``method`` minus each other method on ``key`` (``at_tokens``: held-out accuracy at equal
    generated tokens, the primary comparison; ``final``: at equal leaves), paired by seed: mean,
    its ``level`` Student-t interval, the paired t-test's two-sided p and the p after Holm's
    correction over the baselines (``trace_core.stats.holm``; the allocators of ``METHODS``: the
    ``VARIANTS`` of TRACE get their own p and no correction, nan). A baseline with fewer than two
    shared seeds has no interval or p (nan) and takes no part in the correction."""
    from scipy import stats as st

    from trace_core.stats import holm

    budget_tokens = token_budget(results)
    get = {"at_tokens": lambda r: accuracy_at_tokens(r, budget_tokens), "final": _final,
           "auc": _auc}[key]
    mine = {r.seed: r for r in results if r.method == method}
    out: dict[str, dict[str, Any]] = {}
    for other in dict.fromkeys(r.method for r in results if r.method != method):
        theirs = {r.seed: r for r in results if r.method == other}
        seeds = sorted(set(mine) & set(theirs))
        d = np.array([get(mine[s]) - get(theirs[s]) for s in seeds])
        d = d[np.isfinite(d)]
        row: dict[str, Any] = {"seeds": seeds, "n": int(d.size),
                               "mean": float(d.mean()) if d.size else float("nan"),
                               "low": float("nan"), "high": float("nan"), "p": float("nan")}
        if d.size >= 2:
            se = float(d.std(ddof=1) / np.sqrt(d.size))
            half = float(st.t.ppf(0.5 + level / 2, d.size - 1)) * se
            row.update(low=row["mean"] - half, high=row["mean"] + half,
                       p=float(st.ttest_1samp(d, 0.0).pvalue) if se > 0 else
                       (0.0 if row["mean"] != 0 else 1.0))
        out[other] = row
    tested = [m for m, row in out.items() if np.isfinite(row["p"]) and m not in VARIANTS]
    adjusted = holm([out[m]["p"] for m in tested]) if tested else []
    for m in out:
        out[m]["p_holm"] = float("nan")
    for m, p in zip(tested, adjusted):
        out[m]["p_holm"] = float(p)
    return out


def print_tests(tests: dict[str, dict[str, Any]], key: str, method: str = "trace") -> None:
    what = {"at_tokens": "at equal generated tokens", "final": "at equal leaves (final)",
            "auc": "area under accuracy vs leaves"}[key]
    for other, t in tests.items():
        print(f"{method} - {other:<14} {what}: {100 * t['mean']:+5.1f} points (95% CI "
              f"{100 * t['low']:+.1f}, {100 * t['high']:+.1f}), p {t['p']:.3f}, Holm-adjusted "
              f"{t['p_holm']:.3f} over {t['n']} seeds")


def print_paired(diffs: dict[str, dict[str, Any]], method: str = "trace") -> None:
    for other, row in diffs.items():
        f, a, t = row["final"], row["auc"], row["at_tokens"]
        print(f"{method} - {other:<14} final {100 * f[0]:+5.1f} ± {100 * f[1]:3.1f}   "
              f"AUC {100 * a[0]:+5.1f} ± {100 * a[1]:3.1f}   "
              f"@tokens {100 * t[0]:+5.1f} ± {100 * t[1]:3.1f}   (paired over seeds "
              f"{','.join(map(str, row['seeds']))}; ± = s.e.)")


def print_table(table: dict[str, dict[str, Any]], seeds: int) -> None:
    head = (f"{'method':<14}{'final acc':>14}{'best acc':>14}{'AUC':>14}{'@tokens':>14}{'eff.ratio':>10}"
            f"{'leaves':>8}{'gen tokens':>12}{'tool calls':>11}{'wall s':>8}")
    print(f"held-out accuracy: mean ± std over {seeds} seed(s)")
    print(head)
    print("-" * len(head))
    for m, t in table.items():
        pm = lambda v: f"{100 * v[0]:5.1f} ± {100 * v[1]:4.1f}"  # noqa: E731
        print(f"{m:<14}{pm(t['final']):>14}{pm(t['best']):>14}{pm(t['auc']):>14}"
              f"{pm(t['at_tokens']):>14}{t['effective_ratio']:>10.2f}{t['leaves']:>8.0f}{t['generated_tokens']:>12.0f}"
              f"{t['tool_calls']:>11.0f}{t['wall_s']:>8.0f}")
    budget = next(iter(table.values()), {}).get("token_budget", float("nan"))
    print(f"@tokens: held-out accuracy at {budget:.0f} generated tokens (the smallest total of any "
          "run), linear between evaluations; AUC, final, best: at equal leaves")


def plot(table: dict[str, dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = all(t.get("curve_tokens") for t in table.values())
    fig, axes = plt.subplots(1, 2 if tokens else 1, figsize=(11 if tokens else 6, 4), squeeze=False)
    for i, (key, label) in enumerate([("curve_budget", "cumulative budget (trajectories)"),
                                      ("curve_tokens", "cumulative generated tokens")][:1 + tokens]):
        ax = axes[0, i]
        for m, t in table.items():
            ax.plot(t[key], [100 * a for a in t["curve"]], marker="o", label=m,
                    linewidth=2.5 if m == "trace" else 1.2)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy (%)")
        ax.legend()
    axes[0, 0].set_title("accuracy vs sampling budget (mean over seeds)")
    if tokens:
        axes[0, 1].set_title("the same runs against generated tokens")
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
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"allocators, or variants: {', '.join(VARIANTS)}")
    ap.add_argument("--seeds", default=None,
                    help="a count (3: seeds seed-start .. seed-start + 2) or a range (3-5). Each "
                         "(method, seed) run is kept in <workdir>/runs/, and a later invocation "
                         "with the same settings reuses it, so seeds accumulate: the report covers "
                         "every recorded seed (default 3; 1 with --quick)")
    ap.add_argument("--seed-start", type=int, default=0,
                    help="first seed of a --seeds count")
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
    ap.add_argument("--policy", default=None,
                    help="start every run from this Hugging Face policy directory instead of the "
                         "family's bootstrapped tiny policy (a bootstrap.json beside it tells "
                         "which test items to skip)")
    ap.add_argument("--workdir", default="bench_runs/learning",
                    help="keeps the bootstrapped policy (cached) and every run's trees and metrics")
    ap.add_argument("--plot", default="docs/learning.png")
    ap.add_argument("--jobs", type=int, default=None,
                    help="(method, seed) runs in parallel worker processes, one torch thread "
                         "each (default: 2 on a machine with >= 2 cores, 1 with --quick); 1 = all "
                         "in this process, in one work dir")
    ap.add_argument("--quick", action="store_true", help="a small configuration for the tests")
    ap.add_argument("--summarise-only", action="store_true",
                    help="run nothing: re-print (and re-plot) the benchmark recorded in "
                         "<workdir>/learning_results.json")
    args = ap.parse_args(argv)
    if args.summarise_only:
        return summarise_recorded(Path(args.workdir), args.plot)
    if args.quick:
        args.steps, args.eval_every, args.eval_items, args.eval_samples = 2, 2, 8, 2
        args.seeds = args.seeds or "1"
        args.root_budget, args.pool_size = 4, 8
    if args.jobs is None:
        args.jobs = 1 if args.quick else min(2, os.cpu_count() or 1)
    workdir = Path(args.workdir)
    from flows.bootstrap import bootstrap

    from trace_rl.config import TrainConfig, load_config
    from trace_rl.envs.registry import options

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    seeds = parse_seeds(args.seeds or "3", args.seed_start)
    mix = [int(d) for d in args.mix.split(",") if d.strip()]
    keys = [kv.split("=", 1)[0].strip() for kv in args.set]
    # --set, parsed (and unknown keys refused) exactly as `trace train key=value` does
    overridden = load_config(None, [f"family={args.family}", *args.set]) if args.set else None
    family_options = {k: getattr(overridden or TrainConfig(), k) for k in options(args.family)}
    policy = str(Path(args.policy).resolve()) if args.policy else bootstrap(
        family=args.family, difficulty=args.difficulty, workdir=str(workdir), seed=0,
        preset="test" if args.quick else "tiny", mix=mix or None, options=family_options or None)
    base = {"family": args.family, "difficulty": args.difficulty, "steps": args.steps,
            "root_budget": args.root_budget, "multiplier": args.multiplier,
            "pool_size": args.pool_size, "plot_every": 0, "engine": "hf",
            "eval_items": 0,  # evaluated here, at eval_steps, not by the flow
            "checkpoint_every": args.eval_every}
    from tasks.evaluate import bootstrap_items

    skip = bootstrap_items(policy)
    # A family with its own train-split option (synth_chain's chain_train_items) takes
    # --train-items there; the other synthetic families as n_train.
    own_train = next((k for k in options(args.family) if k.endswith("_train_items")), None)
    base["extra"] = {"n_test": skip + args.eval_items, **({"mix": mix} if mix else {}),
                     **({"n_train": args.train_items} if args.train_items is not None
                        and own_train is None else {})}
    if own_train and args.train_items is not None:
        base[own_train] = args.train_items
    if args.learning_rate is not None:
        base["learning_rate"] = args.learning_rate
    if overridden is not None:
        base.update({k: getattr(overridden, k) for k in keys})
    eval_steps = sorted({*range(args.eval_every - 1, args.steps, args.eval_every), args.steps - 1})
    ev = dict(eval_items=args.eval_items, eval_skip=skip, eval_samples=args.eval_samples,
              eval_temperature=args.eval_temperature)
    sig = signature(base, eval_steps, ev, policy)
    start = _eval({**base, "policy": policy, "run_id": "learn-eval"}, policy, args.eval_items, skip,
                  args.eval_samples, args.eval_temperature)
    jobs = [(m, s) for s in seeds for m in methods if load_run(workdir, sig, m, s) is None]
    if args.jobs <= 1:
        for m, s in jobs:
            save_run(workdir, sig, run_one(m, s, base, policy, workdir, eval_steps,
                                           start_accuracy=start, **ev))
    elif jobs:
        run_parallel(jobs, args.jobs, base, policy, workdir, eval_steps, start, ev, sig)
    # Every recorded seed of these methods made with these settings, this invocation's and
    # earlier ones'.
    recorded = sorted({int(p.stem.rsplit("-s", 1)[1]) for p in (workdir / "runs").glob("*.json")})
    results = [r for s in recorded for m in methods
               if (r := load_run(workdir, sig, m, s)) is not None]
    record = workdir / "learning_results.json"  # every run's curve, per seed, for later reading
    record.write_text(json.dumps({"args": vars(args), "start_accuracy": start,
                                  "results": [r.__dict__ for r in results]}, indent=1) + "\n")
    return report(results, vars(args), start, record)


def summarise_recorded(workdir: Path, plot_path: str) -> dict[str, Any]:
    """The report of a finished benchmark from its ``learning_results.json`` (tokens per evaluation
    read back from the runs' stores where the file predates them)."""
    record = workdir / "learning_results.json"
    if not record.exists():
        raise FileNotFoundError(f"--summarise-only: no {record}; run the benchmark with --workdir "
                                f"{workdir} first")
    data = json.loads(record.read_text())
    results = [fill_eval_tokens(workdir, RunResult(**r)) for r in data["results"]]
    return report(results, {**data["args"], "plot": plot_path}, data["start_accuracy"], record)


def report(results: list[RunResult], args: dict[str, Any], start: float,
           record: Path) -> dict[str, Any]:
    """Print the table, the paired differences and the last line; save the plot."""
    leaves_per_step = args["root_budget"] * (1 + args["multiplier"])
    table = summarise(results, leaves_per_step)
    print(f"\nfamily {args['family']} (difficulty {args.get('mix') or args['difficulty']}), {args['steps']} "
          f"steps x {leaves_per_step} leaves, starting accuracy {100 * start:.1f}% "
          f"({args['eval_items']} held-out items x {args['eval_samples']} samples at temperature "
          f"{args['eval_temperature']}), workdir {args['workdir']} (per-run curves: {record})")
    print_table(table, len({r.seed for r in results}))
    diffs = paired(results)
    print_paired(diffs)
    tests = {}
    if any(r.method == "trace" for r in results):
        for key in ("at_tokens", "final"):
            tests[key] = paired_tests(results, key=key)
            print_tests(tests[key], key)
    if args["plot"]:
        plot(table, Path(args["plot"]))
        print(f"plot: {args['plot']}")
    if "trace" in table and len(table) > 1:
        others = {m: t for m, t in table.items() if m != "trace"}
        best = max(others, key=lambda m: others[m]["final"][0])
        delta = 100 * (table["trace"]["final"][0] - others[best]["final"][0])
        ratio = (table["trace"]["effective_ratio"] / table["grpo"]["effective_ratio"]
                 if table.get("grpo", {}).get("effective_ratio") else float("nan"))
        print(f"TRACE vs best baseline: {delta:+.1f} points held-out accuracy; "
              f"effective ratio {ratio:.2f}x GRPO")
    return {"table": table, "paired": diffs, "tests": tests,
            "results": [r.__dict__ for r in results]}


if __name__ == "__main__":
    main()
