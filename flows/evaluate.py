"""The ``evaluate`` flow: a policy checkpoint on a held-out split.

Reports accuracy (mean reward of ``samples`` rollouts per item; pass@1 when samples = 1 at
temperature 0) and the contrast metrics that matter to TRACE: the share of items whose samples are
mixed (effective ratio at uniform sampling) and the mean per-item success rate spread.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, task

from flows.common import resolve_workdir
from tasks import runtime
from tasks.evaluate import rollout_eval
from trace_rl.config import TrainConfig


@task(name="evaluate-rollouts")
def evaluate_rollouts(cfg: TrainConfig, policy_dir: str, split: str, limit: int | None,
                      samples: int, temperature: float, skip: int = 0) -> dict[str, Any]:
    """``limit`` items of ``split`` after the first ``skip`` (e.g. those a bootstrap selected on);
    ``tasks.evaluate.rollout_eval`` without the per-item rates."""
    result = rollout_eval(cfg, policy_dir, split, limit, samples, temperature, skip)
    del result["per_item"]
    return result


@flow(name="evaluate", log_prints=True)
def evaluate(policy_dir: str, config: TrainConfig = TrainConfig(), split: str | None = None,
             limit: int | None = 64, samples: int = 4, temperature: float = 1.0,
             workdir: str | None = None, skip: int = 0) -> dict[str, Any]:
    """Accuracy and contrast metrics of ``policy_dir`` on ``split`` (default: the config's
    eval split)."""
    resolve_workdir(workdir)
    runtime.configure_threads()
    result = evaluate_rollouts(config, policy_dir, split or config.eval_split, limit, samples,
                               temperature, skip)
    print(f"accuracy {result['accuracy']:.3f} on {result['items']} items x {samples} samples; "
          f"mixed share {result['mixed_share']:.2f}")
    return result
