"""What a run and a step say to a person: the run's summary, read from the store with the SQL a
user would run, and the Markdown of the Prefect artifacts (``tasks.track`` logs them)."""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from tasks import runtime
from trace_core.stats import paired_gain, verdict
from trace_rl.storage.tracking import Tracker
from trace_rl.view.server import page_url


def fmt_value(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def step_markdown(tracker: Tracker, workdir: str, run_id: str, step: int,
                  metrics: Mapping[str, float], roots: list[Mapping[str, Any]]) -> str:
    """The Markdown of a step's Prefect artifact. Its links are http URLs (a browser will not
    open a file:// link from a web page), each beside the command that starts its server."""
    run = tracker.client.get_run(tracker._run())
    m = lambda k: metrics.get(k, float("nan"))  # noqa: E731
    spent = [r["k"] for r in roots]
    lines = [f"# {run_id}: step {step}", "",
             "| reward | effective ratio | leaves | prefixes continued | refill waves |",
             "|---|---|---|---|---|",
             f"| {m('rollout/reward_mean'):.3f} | {m('tree/effective_ratio'):.2f} | "
             f"{int(m('rollout/leaves')) if 'rollout/leaves' in metrics else '-'} | "
             f"{int(m('alloc/prefixes_expanded')) if 'alloc/prefixes_expanded' in metrics else '-'}"
             f" | {int(m('alloc/refill_waves')) if 'alloc/refill_waves' in metrics else '-'} |", ""]
    if spent:
        lines += [f"Root allocation: {sum(spent)} bare rollouts over {len(spent)} prompts "
                  f"({sum(1 for k in spent if k > 0)} given any; most {max(spent)}, fewest "
                  f"{min(spent)}); the table artifact `allocation-{slug(run_id)}-{step}` lists "
                  f"them.", ""]
    page = f"view/step_{step:04d}.html"
    live = page_url(run_id, step)
    lines += [f"* MLflow run: [{run.info.run_name}]({tracker.ui_url(run.info.run_id)}) (id "
              f"`{run.info.run_id}`, experiment `{tracker.experiment}`), once `{tracker.ui_command}`"
              f" serves the store",
              f"* Rollout trees of step {step}: [in MLflow]"
              f"({tracker.ui_url(run.info.run_id, page)}) (the artifact `{page}`, same server), "
              f"or [live]({live}) once `trace view --workdir {workdir}` serves them (also while "
              f"the run writes)"]
    return "\n".join(lines) + "\n"


def run_summary(workdir: str, run_id: str) -> dict[str, Any]:
    """What a run achieved, read from the store with the SQL a user would run: held-out accuracy
    before and after with intervals, the paired gain, and per step the reward, effective ratio,
    leaves and generated tokens (``trace sql`` on ``evals``, ``steps``, ``nodes``, ``ledger``)."""
    store = runtime.store(workdir)
    q = {"r": run_id}
    steps = complete_steps(store, run_id)
    totals = store.query("SELECT count(*) AS leaves FROM nodes WHERE run_id = $r AND is_leaf",
                         q).to_pylist()[0]
    tokens = store.query("SELECT coalesce(sum(generated_tokens), 0) AS t FROM ledger "
                         "WHERE run_id = $r", q).to_pylist()[0]["t"]
    evals = store.query("SELECT * FROM evals WHERE run_id = $r ORDER BY step", q).to_pylist()
    before = next((e for e in evals if e["step"] == 0), None)
    last = max((e for e in evals if e["step"] > 0), key=lambda e: e["step"], default=None)
    gain = None
    if before and last and len(before["per_item"]) >= 2:
        g = paired_gain(before["per_item"], last["per_item"])
        gain = {"mean": g.mean, "low": g.low, "high": g.high, "excludes_zero": bool(g.excludes_zero)}

    def brief(e: Mapping[str, Any] | None) -> dict[str, Any] | None:
        return None if e is None else {k: e[k] for k in ("step", "accuracy", "ci_low", "ci_high",
                                                          "items", "samples")}

    return {"run_id": run_id, "steps": steps, "leaves": int(totals["leaves"]),
            "generated_tokens": int(tokens), "before": brief(before), "after": brief(last),
            "gain": gain}


def complete_steps(store: Any, run_id: str) -> list[dict[str, Any]]:
    """Per complete step: reward, effective ratio, leaves and generated tokens (``steps``)."""
    steps = []
    for row in store.query("SELECT step, metrics_json FROM steps WHERE run_id = $r "
                           "AND status = 'complete' ORDER BY step", {"r": run_id}).to_pylist():
        m = json.loads(row["metrics_json"] or "{}")
        steps.append({"step": row["step"], "reward": m.get("rollout/reward_mean"),
                      "effective_ratio": m.get("tree/effective_ratio"),
                      "leaves": int(m.get("rollout/leaves", 0)),
                      "generated_tokens": int(m.get("ledger/generated_tokens", 0))})
    return steps


def summary_markdown(summary: Mapping[str, Any], where: Mapping[str, str]) -> str:
    """The summary as the Markdown of the flow's Prefect artifact (the CLI prints the same)."""
    lines = [f"# {summary['run_id']}", ""]
    b, a, g = summary["before"], summary["after"], summary["gain"]
    if b and a:
        lines += ["| held-out accuracy | value | 95% CI |", "|---|---|---|",
                  f"| before (step {b['step']}) | {b['accuracy']:.3f} | {_ci(b)} |",
                  f"| after (step {a['step']}) | {a['accuracy']:.3f} | {_ci(a)} |"]
        if g:
            lines.append(f"| gain (paired over {b['items']} items) | {g['mean']:+.3f} | "
                         f"[{g['low']:+.3f}, {g['high']:+.3f}] |")
            lines += ["", f"Training changed held-out accuracy by {100 * g['mean']:+.1f} points: "
                          f"{verdict(g['mean'], g['low'], g['high'])}."]
        lines.append("")
    lines += ["| step | reward | effective ratio | leaves | generated tokens |",
              "|---|---|---|---|---|"]
    lines += [f"| {s['step']} | {s['reward']:.3f} | {s['effective_ratio']:.2f} | {s['leaves']} | "
              f"{s['generated_tokens']} |" for s in summary["steps"]]
    lines += ["", f"Spent: {summary['leaves']} leaves, {summary['generated_tokens']} generated "
              "tokens in training.", ""]
    lines += [f"* {name}: " + (f"<{value}>" if value.startswith("http://") else f"`{value}`")
              for name, value in where.items()]
    return "\n".join(lines) + "\n"


def _ci(e: Mapping[str, Any]) -> str:
    return "-" if e["ci_low"] is None else f"[{e['ci_low']:.3f}, {e['ci_high']:.3f}]"


def promotion_line(tracker: Tracker, p: Mapping[str, Any]) -> str:
    name = tracker.model_name("policy")
    return (f"{name} v{p['version']} is {'now the' if p['champion'] else 'not the'} champion "
            f"({p['reason']}); load it with mlflow.pyfunc.load_model('models:/{name}@champion')")


def artifact_key(run_id: str) -> str:
    """Prefect artifact keys allow lower-case letters, digits and dashes only."""
    return "summary-" + slug(run_id)


def slug(run_id: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")
