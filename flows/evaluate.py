"""The ``evaluate`` flow: a policy checkpoint on a held-out split.

Reports accuracy (mean reward of ``samples`` rollouts per item; pass@1 when samples = 1 at
temperature 0) and the contrast metrics that matter to TRACE: the share of items whose samples are
mixed (effective ratio at uniform sampling) and the mean per-item success rate spread.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from prefect import flow, task

from flows.common import resolve_workdir
from tasks import runtime
from trace_rl.config import config_from_mapping
from trace_rl.rollout.react import Start, run_episodes
from trace_rl.rollout.types import SamplingSettings


@task(name="evaluate-rollouts")
def evaluate_rollouts(config: dict[str, Any], policy_dir: str, split: str, limit: int | None,
                      samples: int, temperature: float, skip: int = 0) -> dict[str, Any]:
    """``limit`` items of ``split`` after the first ``skip`` (e.g. those a bootstrap selected on)."""
    cfg = config_from_mapping(config, "evaluate(config=...)")
    env = runtime.env_for(cfg)
    items = list(runtime.items_for(cfg, split).values())[skip:][: limit or None]
    if not items:
        raise ValueError(f"evaluate: split {split!r} of {cfg.family} has no items")
    engine = runtime.engine_for(cfg, policy_dir)
    episodes = run_episodes(engine, env, [Start(it, (), samples) for it in items],
                            sampling=SamplingSettings(max_tokens=cfg.max_new_tokens,
                                                      temperature=temperature, seed=cfg.seed),
                            max_turns=cfg.max_turns, tool_timeout_s=cfg.tool_timeout_s, seed=cfg.seed)
    rewards = np.array([float(ep.reward or 0.0) for ep in episodes]).reshape(len(items), samples)
    per_item = rewards.mean(axis=1)
    return {
        "accuracy": float(rewards.mean()),
        "items": len(items),
        "samples": samples,
        "mixed_share": float(np.mean((per_item > 0) & (per_item < 1))) if samples > 1 else 0.0,
        "any_success": float(np.mean(per_item > 0)),
        "generated_tokens": int(sum(ep.ledger.generated_tokens for ep in episodes)),
        "tool_calls": int(sum(ep.ledger.tool_calls for ep in episodes)),
    }


@flow(name="evaluate", log_prints=True)
def evaluate(policy_dir: str, config: dict[str, Any] | None = None, split: str | None = None,
             limit: int | None = 64, samples: int = 4, temperature: float = 1.0,
             workdir: str | None = None, skip: int = 0) -> dict[str, Any]:
    """Accuracy and contrast metrics of ``policy_dir`` on ``split`` (default: the config's
    eval split)."""
    resolve_workdir(workdir)
    runtime.configure_threads()
    cfg = config_from_mapping(config or {}, "evaluate(config=...)")
    result = evaluate_rollouts(cfg.to_dict(), policy_dir, split or cfg.eval_split, limit, samples,
                               temperature, skip)
    print(f"accuracy {result['accuracy']:.3f} on {result['items']} items x {samples} samples; "
          f"mixed share {result['mixed_share']:.2f}")
    return result
