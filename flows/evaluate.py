"""The ``evaluate`` flow: a policy checkpoint on a held-out split.

Reports accuracy (mean reward of ``samples`` rollouts per item; pass@1 when samples = 1 at
temperature 0) and the contrast metrics that matter to TRACE: the share of items whose samples are
mixed (effective ratio at uniform sampling) and the mean per-item success rate spread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, task

from flows.common import RELEASES_ENGINES, resolve_workdir
from tasks import runtime
from tasks.evaluate import rollout_eval
from trace_rl.config import TrainConfig
from trace_rl.policy.named import resolve_policy


@task(name="evaluate-rollouts")
def evaluate_rollouts(cfg: TrainConfig, policy_dir: str, split: str, limit: int | None,
                      samples: int, temperature: float, skip: int = 0) -> dict[str, Any]:
    """``limit`` items of ``split`` after the first ``skip`` (e.g. those a bootstrap selected on);
    ``tasks.evaluate.rollout_eval`` without the per-item rates."""
    result = rollout_eval(cfg, policy_dir, split, limit, samples, temperature, skip)
    del result["per_item"]
    return result


def write_predictions(path: str, rows: list[dict[str, Any]]) -> str:
    """The per-item predictions as JSONL (``trace score --predictions`` reads them)."""
    from trace_rl.envs.io import write_jsonl

    return str(write_jsonl(path, rows))


@flow(name="evaluate", log_prints=True, **RELEASES_ENGINES)
def evaluate(policy_dir: str, config: TrainConfig = TrainConfig(), split: str | None = None,
             limit: int | None = 64, samples: int = 4, temperature: float = 1.0,
             workdir: str | None = None, skip: int = 0,
             predictions: str | None = None) -> dict[str, Any]:
    """Accuracy, the verifier's metrics and contrast metrics of ``policy_dir`` on ``split``
    (default: the config's eval split; a data file works too). ``predictions``: where the
    per-item predictions go (JSONL, ``tasks.evaluate.prediction_row``; default
    ``<workdir>/predictions/<family>-<split>.jsonl``)."""
    workdir = resolve_workdir(workdir)
    runtime.configure_threads()
    policy_dir = resolve_policy(policy_dir)  # a named policy (smollm2) or a directory
    result = evaluate_rollouts(config, policy_dir, split or config.eval_split, limit, samples,
                               temperature, skip)
    split = split or config.eval_split
    out = predictions or str(Path(workdir) / "predictions" / f"{config.family}-{Path(split).stem}.jsonl")
    result["predictions"] = write_predictions(out, result["predictions"])
    print(f"accuracy {result['accuracy']:.3f} on {result['items']} items x {samples} samples; "
          f"mixed share {result['mixed_share']:.2f}"
          + "".join(f"; {k} {v:.3f}" for k, v in result["metrics"].items())
          + (f"; skipped {result['skipped_overlong']} items too long for the policy's context"
             if result["skipped_overlong"] else "") + f"; predictions in {out}")
    return result
