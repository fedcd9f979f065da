"""The warm start's measurement: sampled success of a policy directory on held-out items through
the real ReAct loop and engine, overall and per question type."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from trace_rl.envs.base import Environment, TaskItem
from trace_rl.policy.warmstart.config import WarmstartConfig


def measure(config: WarmstartConfig, env: Environment, policy_dir: Path,
            items: Sequence[TaskItem], engine: str = "auto",
            temperature: float = 1.0) -> dict[str, Any]:
    """Sampled success (``temperature``, ``eval_samples`` per item) of ``policy_dir`` through the
    real ReAct loop: overall, per question type (``item.meta["type"]``), with the verifier's
    metrics (means of whatever the family's verifier reports) and the share of episodes that
    answered at all."""
    import numpy as np

    from trace_rl.engines import context_limit, default_engine_kind, make_engine
    from trace_rl.rollout.format import TurnFormat
    from trace_rl.rollout.react import Start, run_episodes
    from trace_rl.rollout.types import SamplingSettings

    kind = default_engine_kind() if engine == "auto" else engine
    eng = make_engine(kind, policy_dir, seed=config.seed)
    try:
        limit = context_limit(policy_dir)
        fmt = TurnFormat(eng.tokenizer)
        system = env.system_prompt()
        fits = [it for it in items if len(fmt.prompt_ids(system, env.user_prompt(it)))
                + config.max_new_tokens <= limit]
        t0 = time.perf_counter()
        episodes = run_episodes(eng, env, [Start(it, (), config.eval_samples) for it in fits],
                                sampling=SamplingSettings(max_tokens=config.max_new_tokens,
                                                          temperature=temperature),
                                max_turns=config.max_turns, seed=config.seed, max_context=limit)
        wall = time.perf_counter() - t0
    finally:
        eng.close()
    n = config.eval_samples
    rewards = np.array([float(ep.reward or 0.0) for ep in episodes]).reshape(len(fits), n)
    per_item = rewards.mean(axis=1)
    out: dict[str, Any] = {"engine": kind, "temperature": temperature, "items": len(fits), "skipped_overlong":
                           len(items) - len(fits), "success": float(per_item.mean()),
                           "rollout_seconds": wall}
    from trace_core.stats import mean_interval

    if len(fits) >= 2:
        ci = mean_interval(per_item.tolist())
        out["ci_low"], out["ci_high"] = float(ci.low), float(ci.high)
    for t in sorted({str(it.meta.get("type") or "") for it in fits} - {""}):
        mask = np.array([str(it.meta.get("type") or "") == t for it in fits])
        out[f"success_{t}"] = float(per_item[mask].mean())
        out[f"items_{t}"] = int(mask.sum())
        if mask.sum() >= 2:
            ci = mean_interval(per_item[mask].tolist())
            out[f"ci_low_{t}"], out[f"ci_high_{t}"] = float(ci.low), float(ci.high)
    answered = [ep for ep in episodes if ep.turns and ep.turns[-1].action.kind == "answer"]
    out["answered"] = len(answered) / max(1, len(episodes))
    out["searches_per_episode"] = float(np.mean([sum(t.action.kind == "tool" for t in ep.turns)
                                                 for ep in episodes])) if episodes else 0.0
    # The verifier's own metrics, whichever the family reports (HotpotQA: em, f1, strict; BFCL:
    # ast_match, exact, parsed), as means over the episodes.
    for key in sorted({k for ep in episodes for k in ep.metrics}):
        out[key] = float(np.mean([float(ep.metrics.get(key, 0.0)) for ep in episodes]))
    return out
