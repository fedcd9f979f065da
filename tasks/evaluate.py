"""Held-out evaluation: a policy's rollouts on items of the eval split, per item and in total.

``rollout_eval`` is the measurement (``trace eval``, bench.learning, and the train flow use it);
``evaluate_policy`` is the train flow's phase: it measures the policy before the first step and
after the last on the same items with the same sampling seeds (so the two are paired item by item,
``trace_core.stats.paired_gain``), stores the result in DuckDB's ``evals`` table and returns it. A
resumed run finds its stored evaluation instead of measuring again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from prefect import task

from tasks import runtime
from trace_core.stats import mean_interval
from trace_rl.config import TrainConfig
from trace_rl.engines import context_limit
from trace_rl.rollout.react import Start, run_episodes
from trace_rl.rollout.types import SamplingSettings


def rollout_eval(cfg: TrainConfig, policy_dir: str, split: str, limit: int | None, samples: int,
                 temperature: float, skip: int = 0) -> dict[str, Any]:
    """``samples`` rollouts of each of ``limit`` items of ``split`` after the first ``skip``.

    Returns accuracy (mean reward), the per-item success rates (``per_item``, in item order), the
    share of items whose samples are mixed (effective ratio at uniform sampling), the share with
    any success, and the generated tokens and tool calls spent."""
    env = runtime.env_for(cfg)
    fitting, skipped = runtime.items_and_skipped(cfg, split, policy_dir)
    items = list(fitting.values())[skip:][: limit or None]
    if not items:
        raise ValueError(f"evaluate: split {split!r} of {cfg.family} has no items after the "
                         f"first {skip}" + (f" ({skipped} skipped: prompt too long for the "
                                            "policy's context)" if skipped else ""))
    engine = runtime.engine_for(cfg.engine, cfg.cluster_section, cfg.resolved_run_id, policy_dir)
    episodes = run_episodes(engine, env, [Start(it, (), samples) for it in items],
                            sampling=SamplingSettings(max_tokens=cfg.max_new_tokens,
                                                      temperature=temperature, seed=cfg.seed),
                            max_turns=cfg.max_turns, tool_timeout_s=cfg.tool_timeout_s,
                            seed=cfg.seed, max_context=context_limit(policy_dir))
    rewards = np.array([float(ep.reward or 0.0) for ep in episodes]).reshape(len(items), samples)
    keys = sorted({k for ep in episodes for k in ep.metrics
                   if k not in ("truncated", "turn_cap", "verify_error")})
    per_item = rewards.mean(axis=1)  # [items]
    return {
        "accuracy": float(rewards.mean()),
        "items": len(items),
        "samples": samples,
        "per_item": per_item.tolist(),
        "mixed_share": float(np.mean((per_item > 0) & (per_item < 1))) if samples > 1 else 0.0,
        "any_success": float(np.mean(per_item > 0)),
        "generated_tokens": int(sum(ep.ledger.generated_tokens for ep in episodes)),
        "tool_calls": int(sum(ep.ledger.tool_calls for ep in episodes)),
        "skipped_overlong": skipped,
        # The verifier's metrics beside the reward (hotpotqa: em, f1, strict; bfcl: ast_match,
        # exact), averaged over every episode; an episode without an answer counts 0.
        "metrics": {k: float(np.mean([float(ep.metrics.get(k, 0.0)) for ep in episodes]))
                    for k in keys},
        "predictions": [prediction_row(it, episodes[i * samples:(i + 1) * samples])
                        for i, it in enumerate(items)],
    }


def prediction_row(item: Any, episodes: list[Any]) -> dict[str, Any]:
    """One item's line of ``trace eval``'s predictions file: ``id`` and ``answer`` (the first
    sample's final answer; null when it gave none, which ``trace score`` scores 0), its
    ``reward``, and every sample's answer, reward and metrics."""
    def answer(ep: Any) -> str | None:
        last = ep.turns[-1].action if ep.turns else None
        return last.answer if last is not None and last.kind == "answer" else None

    samples = [{"answer": answer(ep), "reward": float(ep.reward or 0.0),
                "metrics": dict(ep.metrics)} for ep in episodes]
    return {"id": item.id, "answer": samples[0]["answer"], "reward": samples[0]["reward"],
            "samples": samples}


def bootstrap_items(policy_dir: str) -> int:
    """Test items a bootstrapped policy was selected and reported on (its ``bootstrap.json``), to
    be skipped by a held-out evaluation; 0 for any other policy."""
    record = Path(policy_dir) / "bootstrap.json"
    if not record.is_file():
        return 0
    seen = json.loads(record.read_text())["config"]
    return int(seen["eval_items"]) + int(seen["report_items"])


@task(name="evaluate-policy")
def evaluate_policy(cfg: TrainConfig, workdir: str, run_id: str, step: int, policy_dir: str,
                    skip: int) -> dict[str, Any]:
    """The train flow's held-out evaluation of ``policy_dir`` as of ``step`` (0 = before any
    update, ``cfg.steps`` = after the last), stored in the ``evals`` table once."""
    store = runtime.store(workdir)
    stored = store.get_eval(run_id, step)
    if stored is not None:
        return stored
    result = rollout_eval(cfg, policy_dir, cfg.eval_split, cfg.eval_items, cfg.eval_samples,
                          cfg.temperature, skip)
    ci = mean_interval(result["per_item"]) if result["items"] >= 2 else None
    row = {"run_id": run_id, "step": step, "policy_dir": str(policy_dir),
           "split": cfg.eval_split, "skip": skip, "items": result["items"],
           "samples": result["samples"], "temperature": cfg.temperature,
           "accuracy": result["accuracy"],
           "ci_low": ci.low if ci else None, "ci_high": ci.high if ci else None,
           "per_item": result["per_item"], "generated_tokens": result["generated_tokens"],
           "tool_calls": result["tool_calls"]}
    store.record_eval(row)
    return store.get_eval(run_id, step)
