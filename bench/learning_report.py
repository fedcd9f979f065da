"""The learning benchmarks' report, shared by the simulator (``bench.learning_sim``) and the tiny LM
(``bench.learning``): the learning protocol's tables, power statement and closing line over each
run's log (per-step lists, ``acc0``, ``accuracy``: ``run_log``), and the equal-leaf benchmark
(``report``); intervals Student t over paired seeds (``trace_core.stats``)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from bench.learning_runs import VARIANTS, RunResult
from trace_core.stats import Interval, detectable_effect, median_ratio, paired_gain, verdict

OURS = ("trace", "trace_cover")
"""The allocators the equal-leaf report sets against the others (the paper's Stage 1, the coverage-aware one)."""

LAST = 5  # final accuracy = the mean held-out accuracy of the last LAST steps (declared up front)
START = 5  # GRPO's effective ratio "at the start" is pooled over its first START steps
BASELINES = ("grpo", "dapo", "prompt_only")  # the closing line's best is taken from these
BESIDE = ("trace", "cover_oracle", "oracle_pred")  # rows shown against it before the closing line


def run_log(r: RunResult, final_of: int = LAST) -> dict[str, Any]:
    """A recorded run as a log: per-step costs where it kept them, accuracy at its evaluations."""
    steps = r.extra.get("steps", {})
    costs = {k: steps[k] for k in ("tokens", "train_tokens", "mixed", "active", "oracle_tokens")
             if k in steps}
    return {"acc0": r.accuracy[0], "accuracy": r.accuracy[1:], "eval_tokens": r.eval_tokens[1:],
            "final_of": final_of, "leaves": r.leaves, **costs}


def final_accuracy(log: dict) -> float:
    """Mean held-out accuracy (points) of the last ``final_of`` evaluations (default ``LAST``)."""
    return 100.0 * float(np.mean(log["accuracy"][-int(log.get("final_of", LAST)):]))


def curve(log: dict) -> tuple[np.ndarray, np.ndarray]:
    """(cumulative generated tokens, accuracy in points) at the start and after each evaluation."""
    spent = log["eval_tokens"] if "eval_tokens" in log else np.cumsum(log["tokens"])
    if len(spent) != len(log["accuracy"]):
        raise ValueError(f"{len(log['accuracy'])} accuracies against {len(spent)} token totals")
    tokens = np.concatenate([[0.0], np.asarray(spent, dtype=float)])
    return tokens, 100.0 * np.concatenate([[log["acc0"]], log["accuracy"]])


def tokens_to_reach(log: dict, target: float) -> float:
    """Cumulative generated tokens at which the accuracy curve (points, linear in between) first
    reaches ``target`` (points); NaN if it never does."""
    tokens, acc = curve(log)
    k = int(np.argmax(acc >= target))  # the first evaluation at the target, if any
    if acc[k] < target:
        return float("nan")
    return float(np.interp(target, acc[k - 1:k + 1], tokens[k - 1:k + 1])) if k else 0.0


def reach_ratio(logs: list[dict], grpo: list[dict]) -> tuple[float, float, float, int]:
    """(median ratio, 95% low, high, seeds that never reach) over seeds of the generated tokens a
    method needs to reach GRPO's final accuracy over the tokens GRPO needs (its first crossing)."""
    targets = [final_accuracy(g) for g in grpo]
    need = [tokens_to_reach(lg, t) for lg, t in zip(logs, targets)]
    base = [tokens_to_reach(g, t) for g, t in zip(grpo, targets)]
    return median_ratio(need, base)


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


def structure_rows(name: str, logs: list[dict], names: list[str], reference: str,
                   optional: Sequence[str] = ()) -> tuple[list[dict], dict[str, np.ndarray]]:
    """One structure's table (``rows_of``), printed; then each ``optional`` method's row over the
    seeds whose log holds it, with its ``seeds``, ``oracle_tokens`` per step and, over two or more
    seeds, ``vs``: its paired difference from the best baseline and from the ``reference``."""
    table, finals = rows_of(logs, names)
    by = {r["method"]: r for r in table}
    print(f"\n{name}: {len(logs)} seed(s); start accuracy {100 * logs[0]['grpo']['acc0']:.1f}; "
          f"GRPO's effective ratio over its first {START} steps {by['grpo']['ratio_start']:.2f}; "
          f"generated tokens per step / {reference}'s: "
          + ", ".join(f"{m} {r['tokens'] / by[reference]['tokens']:.2f}" for m, r in by.items()))
    print_rows(table)
    for m in optional:
        have = [lg for lg in logs if m in lg]
        if not have:
            continue
        rows, per_seed = rows_of(have, [*names, m])
        row = {**rows[-1], "seeds": len(have),
               "oracle_tokens": float(np.mean([np.mean(lg[m].get("oracle_tokens", np.nan)) for lg in have]))}
        print(f"{m} over the {len(have)} complete seed(s) that hold it, its oracle "
              f"{row['oracle_tokens']:.0f} generated tokens per step apart:")
        print_rows([row])
        table.append(row)
        if len(have) >= 2:
            row["vs"] = {b: paired_gain(per_seed[b], per_seed[m]) for b in (best_baseline(finals), reference)}
            print(f"{m} over its {len(have)} seeds: "
                  + "; ".join(f"vs {b} {describe(iv)}" for b, iv in row["vs"].items()))
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


def conclude(main: dict[str, np.ndarray], control: dict[str, np.ndarray] | None, contender: str) -> dict:
    """Print the power statement (the paired difference's SD against the best baseline and the
    effect detectable at 80% power), the ``BESIDE`` rows against it and the closing line."""
    line, iv, civ = closing(main, control, contender)
    base = best_baseline(main)
    n = len(main[contender])
    sd = float(np.std(main[contender] - main[base], ddof=1))
    see = detectable_effect
    print(f"\npower: SD of the paired difference {sd:.2f} points; detectable at 80% power: "
          f"{see(sd, n):.1f} points over {n} seeds ({see(sd, 20):.1f} over 20, {see(sd, 40):.1f} "
          f"over 40)")
    for other in BESIDE:
        if other in main:
            print(f"{other} vs {base}: {describe(paired_gain(main[base], main[other]))}")
    print(f"{contender} vs {base}: {describe(iv)}; control: {describe(civ) if civ else '-'}")
    print(line)
    return {"gain": iv, "control": civ, "line": line, "sd": sd, "best": base}


def token_budget(results: Sequence[RunResult]) -> float:
    """The smallest generated-token total any run spent (nan where none recorded it)."""
    totals = [r.eval_tokens[-1] for r in results if r.eval_tokens]
    return float(min(totals)) if totals else float("nan")


def accuracy_at(r: RunResult, x: float, axis: str = "eval_tokens") -> float:
    """Held-out accuracy of run ``r`` at ``x`` on an axis of its evaluations, ``eval_tokens`` or
    ``extra["eval_wall_s"]`` (``bench.peers``), linear in between; nan beyond the last evaluation
    or where the run did not record that axis."""
    at = r.eval_tokens if axis == "eval_tokens" else r.extra.get(axis, [])
    if not at:
        return float("nan")
    if len(at) != len(r.accuracy) or np.any(np.diff(at) < 0):
        raise ValueError(f"{r.method} seed {r.seed}: {axis} {at} must rise with the "
                         f"{len(r.accuracy)} evaluations")
    if not 0 <= x <= at[-1]:
        return float("nan")
    return float(np.interp(x, at, r.accuracy))


def paired_tests(results: list[RunResult], method: str = "trace", key: str = "at_tokens"
                 ) -> dict[str, dict[str, Any]]:
    """``method`` minus each other method in points, paired by seed, on ``key`` (``at_tokens``:
    accuracy at the ``token_budget``; ``final``: at equal leaves): the ``seeds`` both ran, the
    finite ``diffs``, their ``gain`` (``paired_gain``; nan below two) and the effect ``detectable``."""
    budget = token_budget(results)
    value = {(r.method, r.seed): 100 * (accuracy_at(r, budget) if key == "at_tokens" else r.accuracy[-1])
             for r in results}
    out: dict[str, dict[str, Any]] = {}
    for other in dict.fromkeys(m for m, _ in value if m != method):
        seeds = sorted(s for m, s in value if m == other and (method, s) in value)
        pairs = np.array([(value[other, s], value[method, s]) for s in seeds]).reshape(-1, 2)
        before, after = pairs[np.isfinite(pairs).all(axis=1)].T
        d, nan = after - before, float("nan")
        if d.size >= 2:
            gain, detectable = paired_gain(before, after), detectable_effect(float(d.std(ddof=1)), d.size)
        else:
            gain, detectable = Interval(float(d.mean()) if d.size else nan, nan, nan, d.size), nan
        out[other] = {"seeds": seeds, "diffs": d.tolist(), "gain": gain, "detectable": detectable}
    return out


def report(results: list[RunResult], start: float) -> dict[str, Any]:
    """The equal-leaf benchmark: per method over seeds the final held-out accuracy and that at equal
    generated tokens; each TRACE allocator (``OURS``) minus each baseline paired by seed at both,
    and its closing line (``tests``: the paper's ``trace``; ``tests_by_method``: each)."""
    budget = token_budget(results)
    table: dict[str, dict[str, Any]] = {}
    for m in dict.fromkeys(r.method for r in results):
        rs = [r for r in results if r.method == m]
        spread = lambda v: (float(np.mean(v)), float(np.std(v)))  # noqa: E731
        table[m] = {"final": spread([r.accuracy[-1] for r in rs]),
                    "at_tokens": spread([accuracy_at(r, budget) for r in rs]),
                    "effective_ratio": float(np.mean([np.mean(r.effective_ratio) for r in rs])),
                    "leaves": float(np.mean([sum(r.leaves) for r in rs])),
                    **{k: float(np.mean([getattr(r, k) for r in rs]))
                       for k in ("generated_tokens", "wall_s")}}
    print(f"held-out accuracy from {100 * start:.1f}%, mean ± std over "
          f"{len({r.seed for r in results})} seed(s); @tokens: at {budget:.0f} generated tokens "
          "(the smallest total of any run), linear between evaluations")
    print(f"{'method':<16}{'final acc':>14}{'@tokens':>14}{'eff.ratio':>10}{'leaves':>8}"
          f"{'gen tokens':>12}{'wall s':>8}")
    pm = lambda v: f"{100 * v[0]:5.1f} ± {100 * v[1]:4.1f}"  # noqa: E731
    for m, t in table.items():
        print(f"{m:<16}{pm(t['final']):>14}{pm(t['at_tokens']):>14}{t['effective_ratio']:>10.2f}"
              f"{t['leaves']:>8.0f}{t['generated_tokens']:>12.0f}{t['wall_s']:>8.0f}")
    by_method: dict[str, dict[str, Any]] = {}
    ours = [m for m in OURS if m in table]  # each TRACE allocator run, against every other
    baselines = [m for m in table if m not in OURS and m not in VARIANTS]
    for mine in ours if baselines else []:
        found = by_method[mine] = {}
        for key, what in (("at_tokens", "at equal generated tokens"), ("final", "at equal leaves")):
            found[key] = paired_tests(results, method=mine, key=key)
            for other, t in found[key].items():
                g = t["gain"]
                print(f"{mine} - {other:<14} {what}: {g.mean:+5.1f} points (95% CI {g.low:+.1f}, "
                      f"{g.high:+.1f}) over {g.n} seeds; detectable at 80% power: {t['detectable']:.1f}")
        # the baseline best on the seeds both ran (the smallest paired difference), and that difference
        def paired(m: str) -> float:
            d = found["final"][m]["diffs"]
            return float(np.mean(d)) if d else float("nan")
        best = min(baselines, key=lambda m: np.nan_to_num(paired(m), nan=np.inf))
        delta = paired(best)
        ratio = (table[mine]["effective_ratio"] / table["grpo"]["effective_ratio"]
                 if table.get("grpo", {}).get("effective_ratio") else float("nan"))
        print(f"{'TRACE' if mine == 'trace' else mine} vs best baseline: {delta:+.1f} points held-out "
              f"accuracy; effective ratio {ratio:.2f}x GRPO")
    tests = by_method.get("trace", {})
    return {"table": table, "tests": tests, "tests_by_method": by_method,
            "results": [r.__dict__ for r in results]}
