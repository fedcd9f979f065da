"""The learning benchmark's report: per method, held-out accuracy (final, best, area under the
curve, at equal generated tokens) over seeds, TRACE minus each baseline paired by seed with
Student-t intervals and Holm-corrected p values, and the plot (``bench.learning``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.learning_runs import VARIANTS, RunResult


def area_under_curve(budget: Sequence[float], accuracy: Sequence[float]) -> float:
    """Trapezoid area under accuracy vs cumulative budget, divided by the budget span: the mean
    accuracy over the budget, in [0, 1]."""
    x, y = np.asarray(budget, dtype=float), np.asarray(accuracy, dtype=float)
    return float(np.trapezoid(y, x) / (x[-1] - x[0])) if x[-1] > x[0] else float(y[-1])


def _final(r: RunResult) -> float:
    return r.accuracy[-1]


def _hard(r: RunResult) -> float:
    """Final accuracy on the hard split (``bench.learning --hard-items``), nan if not measured."""
    return float(r.extra.get("hard", {}).get("final", float("nan")))


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


def late_root_auc(r: RunResult) -> float:
    """Mean within-step root AUC of run ``r`` over its second half of steps (from step 10 of 20:
    the per-prompt posterior needs a few visits of a prompt), nan where none was defined."""
    aucs = np.asarray(r.extra.get("root_auc", []), dtype=float)
    late = aucs[len(aucs) // 2:]
    late = late[np.isfinite(late)]
    return float(late.mean()) if late.size else float("nan")


def _nanmean(values: Sequence[float]) -> float:
    v = np.asarray(values, dtype=float)
    return float(v[np.isfinite(v)].mean()) if np.isfinite(v).any() else float("nan")


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
            "root_auc": _nanmean([late_root_auc(r) for r in rs]),
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


def detectable_effect(sd: float, n: int, level: float = 0.95, power: float = 0.8) -> float:
    """The smallest true paired difference that the two-sided paired t-test at ``level`` detects
    with probability ``power`` over ``n`` seeds when the seed-wise differences have standard
    deviation ``sd`` (exact, from the noncentral t distribution); nan below 2 seeds or for a
    non-positive or non-finite ``sd``."""
    from scipy import optimize
    from scipy import stats as st

    if n < 2 or not np.isfinite(sd) or sd <= 0:
        return float("nan")
    df, crit = n - 1, float(st.t.ppf(0.5 + level / 2, n - 1))

    def shortfall(delta: float) -> float:
        nc = delta * np.sqrt(n) / sd  # the far tail (below -crit) underflows to nan at large nc
        return float(st.nct.sf(crit, df, nc) + np.nan_to_num(st.nct.cdf(-crit, df, nc))) - power

    # power rises with delta; at a noncentrality of 50 it is 1 for any n >= 2
    return float(optimize.brentq(shortfall, 0.0, 50.0 * sd / np.sqrt(n)))


def seeds_needed(sd: float, effect: float, level: float = 0.95, power: float = 0.8,
                 most: int = 10_000) -> int:
    """The fewest paired seeds at which ``effect`` is detectable (``detectable_effect``) when the
    seed-wise differences have standard deviation ``sd``; 0 where even ``most`` seeds fall short
    or ``sd`` is not a positive finite number."""
    if not np.isfinite(sd) or sd <= 0 or effect <= 0:
        return 0
    low, high = 2, most
    if detectable_effect(sd, high, level, power) > effect:
        return 0
    while low < high:  # the detectable effect falls as seeds are added
        mid = (low + high) // 2
        if detectable_effect(sd, mid, level, power) <= effect:
            high = mid
        else:
            low = mid + 1
    return low


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
           "auc": _auc, "hard": _hard}[key]
    mine = {r.seed: r for r in results if r.method == method}
    out: dict[str, dict[str, Any]] = {}
    for other in dict.fromkeys(r.method for r in results if r.method != method):
        theirs = {r.seed: r for r in results if r.method == other}
        seeds = sorted(set(mine) & set(theirs))
        d = np.array([get(mine[s]) - get(theirs[s]) for s in seeds])
        d = d[np.isfinite(d)]
        row: dict[str, Any] = {"seeds": seeds, "n": int(d.size), "diffs": d.tolist(),
                               "mean": float(d.mean()) if d.size else float("nan"),
                               "low": float("nan"), "high": float("nan"), "p": float("nan"),
                               "sd": float("nan"), "detectable": float("nan")}
        if d.size >= 2:
            se = float(d.std(ddof=1) / np.sqrt(d.size))
            row.update(sd=float(d.std(ddof=1)),
                       detectable=detectable_effect(float(d.std(ddof=1)), int(d.size), level))
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


def versus_best(results: list[RunResult], table: dict[str, dict[str, Any]]
                ) -> tuple[str, dict[str, dict[str, Any]]]:
    """The baseline best at equal generated tokens (``table``: ``summarise``) and TRACE and each
    of its ``VARIANTS`` minus it, paired by seed (``paired_tests``)."""
    baselines = [m for m in table if m != "trace" and m not in VARIANTS]
    best = max(baselines, key=lambda m: table[m]["at_tokens"][0])
    return best, {m: paired_tests(results, method=m, key="at_tokens")[best]
                  for m in ["trace", *(v for v in VARIANTS if v in table)]}


def print_tests(tests: dict[str, dict[str, Any]], key: str, method: str = "trace") -> None:
    what = {"at_tokens": "at equal generated tokens", "final": "at equal leaves (final)",
            "auc": "area under accuracy vs leaves", "hard": "on the hard split (final)"}[key]
    for other, t in tests.items():
        print(f"{method} - {other:<14} {what}: {100 * t['mean']:+5.1f} points (95% CI "
              f"{100 * t['low']:+.1f}, {100 * t['high']:+.1f}), p {t['p']:.3f}, Holm-adjusted "
              f"{t['p_holm']:.3f} over {t['n']} seeds; detectable at 80% power: "
              f"{100 * t.get('detectable', float('nan')):.1f} (paired sd "
              f"{100 * t.get('sd', float('nan')):.1f})")


def _two(v: float) -> str:
    return f"{v:.2f}" if np.isfinite(v) else "-"


def print_table(table: dict[str, dict[str, Any]], seeds: int) -> None:
    head = (f"{'method':<14}{'final acc':>14}{'best acc':>14}{'AUC':>14}{'@tokens':>14}{'eff.ratio':>10}"
            f"{'root AUC':>9}{'leaves':>8}{'gen tokens':>12}{'tool calls':>11}{'wall s':>8}")
    print(f"held-out accuracy: mean ± std over {seeds} seed(s)")
    print(head)
    print("-" * len(head))
    for m, t in table.items():
        pm = lambda v: f"{100 * v[0]:5.1f} ± {100 * v[1]:4.1f}"  # noqa: E731
        print(f"{m:<14}{pm(t['final']):>14}{pm(t['best']):>14}{pm(t['auc']):>14}"
              f"{pm(t['at_tokens']):>14}{t['effective_ratio']:>10.2f}"
              f"{_two(t.get('root_auc', float('nan'))):>9}{t['leaves']:>8.0f}{t['generated_tokens']:>12.0f}"
              f"{t['tool_calls']:>11.0f}{t['wall_s']:>8.0f}")
    budget = next(iter(table.values()), {}).get("token_budget", float("nan"))
    print(f"@tokens: held-out accuracy at {budget:.0f} generated tokens (the smallest total of any "
          "run), linear between evaluations; AUC, final, best: at equal leaves; root AUC: "
          "Stage 1's within-step AUC of its root scores, mean over the second half of the steps")


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


def print_predictor(results: list[RunResult]) -> dict[str, dict[str, float]]:
    """Per method whose runs kept them, the predictor's statistics over the second half of the
    steps, mean over steps and seeds (nan-skipping): root and prefix AUC and Brier, and the
    predicted against the realised flip rate of continuations (a calibrated Stage 2 has them
    equal)."""
    keys = ("root_auc", "root_brier", "prefix_auc", "prefix_brier", "flip_predicted", "flip_realised")
    out: dict[str, dict[str, float]] = {}
    for m in dict.fromkeys(r.method for r in results):
        late = {k: [v for r in results if r.method == m
                    for v in r.extra.get(k, [])[len(r.extra.get(k, [])) // 2:]] for k in keys}
        row = {k: _nanmean(v) if v else float("nan") for k, v in late.items()}
        if np.isfinite(row["flip_realised"]):  # the methods with a Stage 2
            out[m] = row
            print(f"predictor, {m} (steps of the second half): root AUC {_two(row['root_auc'])} "
                  f"Brier {_two(row['root_brier'])}; prefix AUC {_two(row['prefix_auc'])} Brier "
                  f"{_two(row['prefix_brier'])}; flip rate predicted {_two(row['flip_predicted'])}"
                  f", realised {_two(row['flip_realised'])}")
    return out


def print_hard(results: list[RunResult], start: float) -> dict[str, dict[str, Any]]:
    """Each method's final accuracy on the hard split (mean ± std over seeds) and TRACE minus
    each method there, paired by seed (``paired_tests``)."""
    setting = next(r.extra["hard"] for r in results if "hard" in r.extra)
    print(f"hard split ({setting['items']} items x {setting['samples']} samples, final "
          f"checkpoints; start {100 * start:.1f}%): " + ", ".join(
              f"{m} {100 * np.mean(v):.1f} ± {100 * np.std(v):.1f}" for m in
              dict.fromkeys(r.method for r in results)
              if (v := [_hard(r) for r in results if r.method == m and np.isfinite(_hard(r))])))
    tests = paired_tests(results, key="hard") if any(r.method == "trace" for r in results) else {}
    print_tests(tests, "hard")
    return tests


def report(results: list[RunResult], args: dict[str, Any], start: float,
           record: Path, hard_start: float | None = None) -> dict[str, Any]:
    """Print the table, the paired differences and the last line; save the plot."""
    leaves_per_step = args["root_budget"] * (1 + args["multiplier"])
    table = summarise(results, leaves_per_step)
    print(f"\nfamily {args['family']} (difficulty {args.get('mix') or args['difficulty']}), {args['steps']} "
          f"steps x {leaves_per_step} leaves, starting accuracy {100 * start:.1f}% "
          f"({args['eval_items']} held-out items x {args['eval_samples']} samples at temperature "
          f"{args['eval_temperature']}), workdir {args['workdir']} (records: {record})")
    print_table(table, len({r.seed for r in results}))
    predictor = print_predictor(results)
    tests = {}
    if any(r.method == "trace" for r in results):
        for key in ("at_tokens", "final"):
            tests[key] = paired_tests(results, key=key)
            print_tests(tests[key], key)
    if hard_start is not None and any("hard" in r.extra for r in results):
        tests["hard"] = print_hard(results, hard_start)
    if args["plot"]:
        plot(table, Path(args["plot"]))
        print(f"plot: {args['plot']}")
    baselines = {m: t for m, t in table.items() if m != "trace" and m not in VARIANTS}
    if "trace" in table and baselines and "at_tokens" in tests:
        # The primary comparison: each TRACE row against the baseline best at equal tokens.
        best_tok, versus = versus_best(results, table)
        for m, t in versus.items():
            print(f"{m} - best baseline ({best_tok}) at equal generated tokens: "
                  f"{100 * t['mean']:+.1f} points (95% CI {100 * t['low']:+.1f}, "
                  f"{100 * t['high']:+.1f}) over {t['n']} seeds")
        t = tests["at_tokens"][best_tok]
        if np.isfinite(t["sd"]):  # what this spread between seeds lets the benchmark see
            print(f"power: with the paired sd of trace - {best_tok} ({100 * t['sd']:.1f} points), "
                  f"{t['n']} seeds detect {100 * t['detectable']:.1f} points at 80% power; "
                  + ", ".join(f"{e} points need {n or 'over 10000'} seeds" for e in (3, 5)
                              for n in [seeds_needed(t["sd"], e / 100)]))
    if "trace" in table and baselines:
        others = baselines
        best = max(others, key=lambda m: others[m]["final"][0])
        delta = 100 * (table["trace"]["final"][0] - others[best]["final"][0])
        ratio = (table["trace"]["effective_ratio"] / table["grpo"]["effective_ratio"]
                 if table.get("grpo", {}).get("effective_ratio") else float("nan"))
        print(f"TRACE vs best baseline: {delta:+.1f} points held-out accuracy; "
              f"effective ratio {ratio:.2f}x GRPO")
    return {"table": table, "tests": tests, "predictor": predictor,
            "results": [r.__dict__ for r in results]}
