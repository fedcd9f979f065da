"""The ``evaluate`` flow: a policy checkpoint on a held-out split.

Reports accuracy (mean reward of ``samples`` rollouts per item; pass@1 when samples = 1 at
temperature 0) and the contrast metrics that matter to TRACE: the share of items whose samples are
mixed (effective ratio at uniform sampling) and the mean per-item success rate spread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, task

from flows.common import announced, RELEASES_ENGINES, prepare_workdir, run_config
from tasks import runtime
from tasks.evaluate import rollout_eval
from trace_rl.config import TrainConfig
from trace_rl.policy.named import resolve_policy


@task(name="evaluate-rollouts", task_run_name="evaluate-rollouts")
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


def evaluate_run_name() -> str:
    """The evaluate flow run's name: the policy and where it is measured, e.g. ``evaluate
    tiny-synth_arith-d1-s0 on synth_arith/test``, instead of Prefect's random two words."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    cfg = run_config()
    if cfg is None:
        return "evaluate (invalid config)"
    policy = Path(str(params.get("policy_dir") or "?"))
    name = policy.parent.name if policy.name == "model" else policy.name
    return f"evaluate {name} on {cfg.family}/{Path(params.get('split') or cfg.eval_split).name}"


@flow(name="evaluate", log_prints=True, flow_run_name=announced(evaluate_run_name),
      **RELEASES_ENGINES)
def evaluate(policy_dir: str, config: TrainConfig = TrainConfig(), split: str | None = None,
             limit: int | None = 64, samples: int | None = None, temperature: float | None = None,
             workdir: str | None = None, skip: int = 0,
             predictions: str | None = None) -> dict[str, Any]:
    """Accuracy, the verifier's metrics and contrast metrics of a policy on a held-out split.

    Args:
        policy_dir: The policy to measure: a Hugging Face model directory (a run's checkpoint)
            or a named policy such as smollm2.
        config: The family, engine and rollout settings (a TrainConfig; its other fields are
            not used).
        split: The split or data file to measure on; empty means the config's eval split.
        limit: How many items to measure (empty means all of them).
        samples: Rollouts per item, an item's score their mean; empty means the config's
            eval_samples.
        temperature: Sampling temperature of the rollouts; empty means the config's.
        workdir: The work dir the predictions file goes under (default trace_runs).
        skip: Items to leave out at the start of the split (those a bootstrap selected on).
        predictions: Where the per-item predictions go (JSONL); empty means
            <workdir>/predictions/<family>-<split>.jsonl.
    """
    workdir = prepare_workdir(workdir)
    runtime.configure_threads()
    policy_dir = resolve_policy(policy_dir)  # a named policy (smollm2) or a directory
    samples = config.eval_samples if samples is None else samples
    temperature = config.temperature if temperature is None else temperature
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
