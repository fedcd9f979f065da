"""The learning benchmarks' report, one for the simulator (``bench.learning_sim``) and the tiny LM
(``bench.learning``), with one interval kind: Student t over paired seeds (``trace_core.stats``).

* The learning protocol (equal generated tokens per step and equal optimiser steps): per-method
  rows (``rows_of``), the paired differences from GRPO, tokens to reach GRPO's final accuracy (a
  ratio with a bootstrap interval over seeds), the power statement and the closing line. A run's
  log is a dict of per-step lists (``tokens``, ``train_tokens``, ``leaves``, ``mixed``, ``active``;
  ``cosine`` where known) and its held-out accuracy: ``acc0`` before the first step and
  ``accuracy`` after each step, or, where a run is evaluated only at some steps (the LM), after
  each evaluation with ``eval_tokens`` the cumulative generated tokens there and ``final_of`` how
  many of the last evaluations make its final accuracy.
* The equal-leaf benchmark (``report``): per method, held-out accuracy (final, best, area under
  the curve, at equal generated tokens) over seeds, TRACE minus each baseline paired by seed with
  Holm-corrected p values, the predictor's statistics, and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench.learning_runs import VARIANTS, RunResult
from trace_core.stats import (Interval, detectable_effect, holm, mean_interval, median_ratio,
                              paired_gain, seeds_needed, verdict)

LAST = 5
"""Final accuracy = the mean held-out accuracy of the last LAST steps (declared before any run:
averaging the last checkpoints cuts the seed-to-seed noise of a single step)."""
START = 5
"""GRPO's effective ratio "at the start" is pooled over its first START steps."""
BASELINES = ("grpo", "dapo", "prompt_only")
"""The baselines the closing line's best is taken from (at equal tokens and steps)."""


# ----------------------------------------------------------------------------- the protocol

def run_log(r: RunResult, final_of: int = LAST) -> dict[str, Any]:
    """A recorded run as a log: per-step costs where it kept them, accuracy at its evaluations."""
    steps = r.extra.get("steps", {})
    costs = {k: steps[k] for k in ("tokens", "train_tokens", "mixed", "active") if k in steps}
    return {"acc0": r.accuracy[0], "accuracy": r.accuracy[1:], "eval_tokens": r.eval_tokens[1:],
            "final_of": final_of, "leaves": r.leaves, **costs}


def final_accuracy(log: dict) -> float:
    """Mean held-out accuracy (points) of the last ``final_of`` evaluations (default ``LAST``)."""
    return 100.0 * float(np.mean(log["accuracy"][-int(log.get("final_of", LAST)):]))


def curve(log: dict) -> tuple[np.ndarray, np.ndarray]:
    """(cumulative generated tokens, held-out accuracy in points) at the start and after each
    evaluation: every step's, or those at ``eval_tokens`` where the log has them."""
    spent = log["eval_tokens"] if "eval_tokens" in log else np.cumsum(log["tokens"])
    if len(spent) != len(log["accuracy"]):
        raise ValueError(f"{len(log['accuracy'])} accuracies against {len(spent)} token totals")
    tokens = np.concatenate([[0.0], np.asarray(spent, dtype=float)])
    return tokens, 100.0 * np.concatenate([[log["acc0"]], log["accuracy"]])


def tokens_to_reach(log: dict, target: float) -> float:
    """Cumulative generated tokens at which the accuracy curve (points, linear in between) first
    reaches ``target`` (points); NaN if it never does."""
    tokens, acc = curve(log)
    hit = np.flatnonzero(acc >= target)
    if not len(hit):
        return float("nan")
    k = int(hit[0])
    if k == 0:
        return 0.0
    frac = (target - acc[k - 1]) / (acc[k] - acc[k - 1])
    return float(tokens[k - 1] + frac * (tokens[k] - tokens[k - 1]))


def reach_ratio(logs: list[dict], grpo: list[dict], seed: int = 0,
                draws: int = 2000) -> tuple[float, float, float, int]:
    """(median ratio, 95% low, high, seeds that never reach): per seed, the generated tokens a
    method needs to reach GRPO's final accuracy over the tokens GRPO needs (its first crossing);
    ``trace_core.stats.median_ratio`` over seeds."""
    targets = [final_accuracy(g) for g in grpo]
    need = [tokens_to_reach(lg, t) for lg, t in zip(logs, targets)]
    base = [tokens_to_reach(g, t) for g, t in zip(grpo, targets)]
    return median_ratio(need, base, seed, draws)


def rows_of(results: list[dict], names: list[str]) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Table rows (means over seeds) and each method's final accuracy per seed."""
    finals = {n: np.array([final_accuracy(r[n]) for r in results]) for n in names}
    grpo = [r["grpo"] for r in results] if "grpo" in names else None
    table = []
    for n in names:
        logs = [r[n] for r in results]
        mean = lambda key: float(np.mean([np.mean(lg.get(key, np.nan)) for lg in logs]))  # noqa: E731
        pooled = lambda end=None: float(sum(np.sum(lg["mixed"][:end]) for lg in logs)  # noqa: E731
                                        / sum(np.sum(lg["active"][:end]) for lg in logs))
        row = {"method": n, "mixed": mean("mixed"), "ratio": pooled(), "ratio_start": pooled(START),
               **{k: mean(k) for k in ("active", "tokens", "train_tokens", "leaves", "cosine")},
               "acc": float(finals[n].mean())}
        if len(results) >= 2 and grpo is not None:
            iv = paired_gain(finals["grpo"], finals[n])
            row["vs_grpo"] = (iv.mean, iv.low, iv.high)
            row["reach"] = reach_ratio(logs, grpo)
        table.append(row)
    return table, finals


def ci_text(d: tuple[float, float, float] | None, width: int = 0) -> str:
    """A row's ``vs_grpo`` as printed: ``+1.9 (-2.1, +5.9)``."""
    return f"{d[0]:+{width}.1f} ({d[1]:+.1f}, {d[2]:+.1f})" if d else ""


def reach_text(q: tuple[float, float, float, int] | None, of: str = "") -> str:
    """A row's ``reach`` as printed: ``0.97 (0.95, never), 19 of 40 never``."""
    if not q:
        return ""
    return (f"{q[0]:.2f} ({q[1]:.2f}, {q[2]:.2f})".replace("inf", "never")
            + (f", {q[3]}{of} never" if q[3] else ""))


def print_rows(table: list[dict]) -> None:
    print(f"{'method':<17}{'mixed/step':>11}{'eff.ratio':>10}{'prompts':>8}{'gen tok':>8}"
          f"{'train tok':>10}{'leaves':>7}{'cos':>6}{'acc':>6}   {'vs GRPO (95% CI)':<22}"
          f"{'tokens to GRPO final (95% CI)':<30}")
    for r in table:
        ci, reach = ci_text(r.get("vs_grpo"), 5), reach_text(r.get("reach"))
        print(f"{r['method']:<17}{r['mixed']:>11.2f}{r['ratio']:>10.2f}{r['active']:>8.1f}"
              f"{r['tokens']:>8.0f}{r['train_tokens']:>10.0f}{r['leaves']:>7.1f}{r['cosine']:>6.2f}"
              f"{r['acc']:>6.1f}   {ci:<22}{reach:<30}")


def structure_rows(name: str, logs: list[dict], names: list[str], reference: str
                   ) -> tuple[list[dict], dict[str, np.ndarray]]:
    """One structure's table (``rows_of``), printed under its start accuracy, GRPO's effective
    ratio over its first ``START`` steps and each method's generated tokens per step over the
    ``reference``'s."""
    table, finals = rows_of(logs, names)
    by = {r["method"]: r for r in table}
    print(f"\n{name}: {len(logs)} seed(s); start accuracy {100 * logs[0]['grpo']['acc0']:.1f}; "
          f"GRPO's effective ratio over its first {START} steps {by['grpo']['ratio_start']:.2f}; "
          f"generated tokens per step / {reference}'s: "
          + ", ".join(f"{m} {r['tokens'] / by[reference]['tokens']:.2f}" for m, r in by.items()))
    print_rows(table)
    return table, finals


def best_baseline(finals: dict[str, np.ndarray]) -> str:
    return max((n for n in BASELINES if n in finals), key=lambda n: float(finals[n].mean()))


def closing(main: dict[str, np.ndarray], control: dict[str, np.ndarray] | None,
            contender: str) -> tuple[str, Interval, Interval | None]:
    """The closing line: ``contender`` against the best baseline (chosen on the main family) at
    equal tokens and steps, and the same pair on the control family."""
    base = best_baseline(main)
    iv = paired_gain(main[base], main[contender])
    ctl = paired_gain(control[base], control[contender]) if control else None
    line = (f"TRACE-cover vs best baseline at equal tokens and steps: {iv.mean:+.1f} points "
            f"(95% CI {iv.low:+.1f}, {iv.high:+.1f}) over {iv.n} seeds")
    if ctl is not None:
        line += f"; control {ctl.mean:+.1f} (95% CI {ctl.low:+.1f}, {ctl.high:+.1f})"
    return line, iv, ctl


def describe(iv: Interval) -> str:
    return f"{iv.mean:+.1f} ({iv.low:+.1f}, {iv.high:+.1f}), {verdict(iv.mean, iv.low, iv.high)}"


def conclude(main: dict[str, np.ndarray], control: dict[str, np.ndarray] | None, contender: str,
             beside: Sequence[str] = ("trace", "cover_oracle", "oracle_pred")) -> dict:
    """Print the power statement (the paired difference's SD against the best baseline and the
    effect detectable at 80% power), the ``beside`` rows against the same baseline, and the
    closing line; the figures as a dict."""
    line, iv, civ = closing(main, control, contender)
    base = best_baseline(main)
    n = len(main[contender])
    sd = float(np.std(main[contender] - main[base], ddof=1))
    see = detectable_effect
    print(f"\npower: SD of the paired difference {sd:.2f} points; detectable at 80% power: "
          f"{see(sd, n):.1f} points over {n} seeds ({see(sd, 20):.1f} over 20, {see(sd, 40):.1f} "
          f"over 40)")
    for other in beside:
        if other in main:
            print(f"{other} vs {base}: {describe(paired_gain(main[base], main[other]))}")
    print(f"{contender} vs {base}: {describe(iv)}; control: {describe(civ) if civ else '-'}")
    print(line)
    return {"gain": iv, "control": civ, "line": line, "sd": sd, "best": base}


# ----------------------------------------------------------------------------- equal leaves

def area_under_curve(budget: Sequence[float], accuracy: Sequence[float]) -> float:
    """Trapezoid area under accuracy vs cumulative budget, divided by the budget span: the mean
    accuracy over the budget, in [0, 1]."""
    x, y = np.asarray(budget, dtype=float), np.asarray(accuracy, dtype=float)
    return float(np.trapezoid(y, x) / (x[-1] - x[0])) if x[-1] > x[0] else float(y[-1])


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
    """Mean within-step root AUC of run ``r`` over its second half of steps (the per-prompt
    posterior needs a few visits of a prompt), nan where none was defined."""
    aucs = np.asarray(r.extra.get("root_auc", []), dtype=float)
    return _nanmean(aucs[len(aucs) // 2:])


def _nanmean(values: Sequence[float]) -> float:
    v = np.asarray(values, dtype=float)
    return float(v[np.isfinite(v)].mean()) if np.isfinite(v).any() else float("nan")


def summarise(results: list[RunResult], leaves_per_step: int) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    budget_tokens = token_budget(results)
    for method in dict.fromkeys(r.method for r in results):
        rs = [r for r in results if r.method == method]
        spread = lambda v: (float(np.mean(v)), float(np.std(v)))  # noqa: E731
        table[method] = {
            "final": spread([r.accuracy[-1] for r in rs]),
            "best": spread([max(r.accuracy[1:]) for r in rs]),
            "auc": spread([_auc(r) for r in rs]),
            "at_tokens": spread([accuracy_at_tokens(r, budget_tokens) for r in rs]),
            "token_budget": budget_tokens,
            "effective_ratio": float(np.mean([np.mean(r.effective_ratio) for r in rs])),
            "root_auc": _nanmean([late_root_auc(r) for r in rs]),
            **{k: float(np.mean([getattr(r, k) for r in rs]))
               for k in ("generated_tokens", "tool_calls", "wall_s")},
            "leaves": float(np.mean([sum(r.leaves) for r in rs])),
            "curve_budget": [(s + 1) * leaves_per_step for s in rs[0].eval_steps],
            "curve": np.mean([r.accuracy for r in rs], axis=0).tolist(),
            "curve_tokens": (np.mean([r.eval_tokens for r in rs], axis=0).tolist()
                             if all(r.eval_tokens for r in rs) else []),
        }
    return table


def paired_tests(results: list[RunResult], method: str = "trace", key: str = "at_tokens",
                 level: float = 0.95) -> dict[str, dict[str, Any]]:
    """``method`` minus each other method on ``key`` (``at_tokens``: held-out accuracy at equal
    generated tokens, the primary comparison; ``final``: at equal leaves; ``auc``), paired by
    seed: mean, its ``level`` Student-t interval (``trace_core.stats.mean_interval``), the paired
    t-test's two-sided p and the p after Holm's correction over the baselines (the ``VARIANTS`` of
    TRACE get their own p and no correction, nan). A baseline with fewer than two shared seeds
    has no interval or p (nan) and takes no part in the correction."""
    from scipy import stats as st

    budget_tokens = token_budget(results)
    get = {"at_tokens": lambda r: accuracy_at_tokens(r, budget_tokens),
           "final": lambda r: r.accuracy[-1], "auc": _auc}[key]
    mine = {r.seed: r for r in results if r.method == method}
    out: dict[str, dict[str, Any]] = {}
    for other in dict.fromkeys(r.method for r in results if r.method != method):
        theirs = {r.seed: r for r in results if r.method == other}
        seeds = sorted(set(mine) & set(theirs))
        d = np.array([get(mine[s]) - get(theirs[s]) for s in seeds])
        d = d[np.isfinite(d)]
        nan = float("nan")
        row: dict[str, Any] = {"seeds": seeds, "n": int(d.size), "diffs": d.tolist(),
                               "mean": float(d.mean()) if d.size else nan, "low": nan,
                               "high": nan, "p": nan, "sd": nan, "detectable": nan}
        if d.size >= 2:
            iv, sd = mean_interval(d, level), float(d.std(ddof=1))
            row.update(low=iv.low, high=iv.high, sd=sd,
                       detectable=detectable_effect(sd, int(d.size), level),
                       p=float(st.ttest_1samp(d, 0.0).pvalue) if sd > 0 else float(iv.mean == 0))
        out[other] = row
    tested = [m for m, row in out.items() if np.isfinite(row["p"]) and m not in VARIANTS]
    adjusted = dict(zip(tested, holm([out[m]["p"] for m in tested]))) if tested else {}
    for m in out:
        out[m]["p_holm"] = float(adjusted.get(m, float("nan")))
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
            "auc": "area under accuracy vs leaves"}[key]
    for other, t in tests.items():
        print(f"{method} - {other:<14} {what}: {100 * t['mean']:+5.1f} points (95% CI "
              f"{100 * t['low']:+.1f}, {100 * t['high']:+.1f}), p {t['p']:.3f}, Holm-adjusted "
              f"{t['p_holm']:.3f} over {t['n']} seeds; detectable at 80% power: "
              f"{100 * t['detectable']:.1f} (paired sd {100 * t['sd']:.1f})")


def _two(v: float) -> str:
    return f"{v:.2f}" if np.isfinite(v) else "-"


def print_table(table: dict[str, dict[str, Any]], seeds: int) -> None:
    head = (f"{'method':<14}{'final acc':>14}{'best acc':>14}{'AUC':>14}{'@tokens':>14}{'eff.ratio':>10}"
            f"{'root AUC':>9}{'leaves':>8}{'gen tokens':>12}{'tool calls':>11}{'wall s':>8}")
    print(f"held-out accuracy: mean ± std over {seeds} seed(s)")
    print(head)
    print("-" * len(head))
    pm = lambda v: f"{100 * v[0]:5.1f} ± {100 * v[1]:4.1f}"  # noqa: E731
    for m, t in table.items():
        print(f"{m:<14}{pm(t['final']):>14}{pm(t['best']):>14}{pm(t['auc']):>14}"
              f"{pm(t['at_tokens']):>14}{t['effective_ratio']:>10.2f}{_two(t['root_auc']):>9}"
              f"{t['leaves']:>8.0f}{t['generated_tokens']:>12.0f}{t['tool_calls']:>11.0f}"
              f"{t['wall_s']:>8.0f}")
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


def report(results: list[RunResult], args: dict[str, Any], start: float, record: Path
           ) -> dict[str, Any]:
    """The equal-leaf benchmark: print the table, the paired differences and the last line;
    save the plot."""
    leaves_per_step = args["root_budget"] * (1 + args["multiplier"])
    table = summarise(results, leaves_per_step)
    print(f"\nfamily {args['family']} (difficulty {args.get('mix') or args['difficulty']}), {args['steps']} "
          f"steps x {leaves_per_step} leaves, starting accuracy {100 * start:.1f}% "
          f"({args['eval_items']} held-out items x {args['eval_samples']} samples at temperature "
          f"{args['eval_temperature']}), workdir {args['workdir']} (records: {record})")
    print_table(table, len({r.seed for r in results}))
    predictor = print_predictor(results)
    tests = {}
    if "trace" in table:
        for key in ("at_tokens", "final"):
            tests[key] = paired_tests(results, key=key)
            print_tests(tests[key], key)
    if args["plot"]:
        plot(table, Path(args["plot"]))
        print(f"plot: {args['plot']}")
    baselines = {m: t for m, t in table.items() if m != "trace" and m not in VARIANTS}
    if "trace" in table and baselines:
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
        best = max(baselines, key=lambda m: baselines[m]["final"][0])
        delta = 100 * (table["trace"]["final"][0] - baselines[best]["final"][0])
        ratio = (table["trace"]["effective_ratio"] / table["grpo"]["effective_ratio"]
                 if table.get("grpo", {}).get("effective_ratio") else float("nan"))
        print(f"TRACE vs best baseline: {delta:+.1f} points held-out accuracy; "
              f"effective ratio {ratio:.2f}x GRPO")
    return {"table": table, "tests": tests, "predictor": predictor,
            "results": [r.__dict__ for r in results]}
