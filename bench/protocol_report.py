"""The figures of the learning protocol (equal generated tokens per step and equal optimiser steps),
shared by the simulator (``bench.learning_sim``) and the tiny LM (``bench.learning --protocol
tokens``): per-method table rows, the paired differences, tokens to reach GRPO's final accuracy (a
ratio with a bootstrap interval over seeds), the detectable effect at 80% power, and the closing
line.

A run's log is a dict of per-step lists (``tokens``, ``train_tokens``, ``leaves``, ``mixed``,
``active``; ``cosine`` where known) and its held-out accuracy: ``acc0`` before the first step and
``accuracy`` after each step, or, where a run is evaluated only at some steps (the LM), after each
evaluation with ``eval_tokens`` the cumulative generated tokens there and ``final_of`` how many of
the last evaluations make its final accuracy."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from bench.learning_report import detectable_effect as detectable
from trace_core.stats import Interval, median_ratio, paired_gain, verdict

LAST = 5
"""Final accuracy = the mean held-out accuracy of the last LAST steps (declared before any run:
averaging the last checkpoints cuts the seed-to-seed noise of a single step)."""
START = 5
"""GRPO's effective ratio "at the start" is pooled over its first START steps."""
BASELINES = ("grpo", "dapo", "prompt_only")
"""The baselines the closing line's best is taken from (at equal tokens and steps)."""


def run_log(r: Any, final_of: int = LAST) -> dict[str, Any]:
    """A recorded run (``bench.learning_runs.RunResult``) as a log: per-step costs where it kept
    them, accuracy at its evaluations."""
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
    a seed that never reaches it counts as an infinite ratio, so a method that falls short is not
    flattered by its smaller total. Median over seeds, percentile bootstrap over seeds."""
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
        mixed = np.array([np.sum(lg["mixed"]) for lg in logs])
        active = np.array([np.sum(lg["active"]) for lg in logs])
        row = {
            "method": n,
            "mixed": float(np.mean([np.mean(lg["mixed"]) for lg in logs])),
            "ratio": float(mixed.sum() / active.sum()),
            "ratio_start": float(sum(np.sum(lg["mixed"][:START]) for lg in logs)
                                 / sum(np.sum(lg["active"][:START]) for lg in logs)),
            "active": float(np.mean([np.mean(lg["active"]) for lg in logs])),
            "tokens": float(np.mean([np.mean(lg["tokens"]) for lg in logs])),
            "train_tokens": float(np.mean([np.mean(lg["train_tokens"]) for lg in logs])),
            "leaves": float(np.mean([np.mean(lg["leaves"]) for lg in logs])),
            "cosine": float(np.mean([np.mean(lg.get("cosine", np.nan)) for lg in logs])),
            "acc": float(finals[n].mean()),
        }
        if len(results) >= 2 and grpo is not None:
            iv = paired_gain(finals["grpo"], finals[n])
            row["vs_grpo"] = (iv.mean, iv.low, iv.high)
            row["reach"] = reach_ratio(logs, grpo)
        table.append(row)
    return table, finals


def print_table(table: list[dict]) -> None:
    print(f"{'method':<17}{'mixed/step':>11}{'eff.ratio':>10}{'prompts':>8}{'gen tok':>8}"
          f"{'train tok':>10}{'leaves':>7}{'cos':>6}{'acc':>6}   {'vs GRPO (95% CI)':<22}"
          f"{'tokens to GRPO final (95% CI)':<30}")
    for r in table:
        d = r.get("vs_grpo")
        ci = f"{d[0]:+5.1f} ({d[1]:+.1f}, {d[2]:+.1f})" if d else ""
        q = r.get("reach")
        reach = (f"{q[0]:.2f} ({q[1]:.2f}, {q[2]:.2f})".replace("inf", "never")
                 + (f" {q[3]} never" if q[3] else "") if q else "")
        print(f"{r['method']:<17}{r['mixed']:>11.2f}{r['ratio']:>10.2f}{r['active']:>8.1f}"
              f"{r['tokens']:>8.0f}{r['train_tokens']:>10.0f}{r['leaves']:>7.1f}{r['cosine']:>6.2f}"
              f"{r['acc']:>6.1f}   {ci:<22}{reach:<30}")


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
    print(f"\npower: SD of the paired difference {sd:.2f} points; detectable at 80% power: "
          f"{detectable(sd, n):.1f} points over {n} seeds ({detectable(sd, 20):.1f} over 20, "
          f"{detectable(sd, 40):.1f} over 40)")
    for other in beside:
        if other in main:
            print(f"{other} vs {base}: {describe(paired_gain(main[base], main[other]))}")
    print(f"{contender} vs {base}: {describe(iv)}; control: {describe(civ) if civ else '-'}")
    print(line)
    return {"gain": iv, "control": civ, "line": line, "sd": sd, "best": base}
