"""The ``warmstart`` flow: a real language model warm-started for a real family by SFT on ReAct
traces of the family's training data (``trace_rl.policy.warmstart``). Built once per machine: the
policy is cached under ``trace_rl.environ.cache_dir()`` by the hash of its inputs, and each work
dir gets a copy; the build is an MLflow run (experiment ``warmstart``) in the work dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from flows.common import announced, RELEASES_ENGINES, prepare_workdir
from trace_rl.config import FIELDS
from trace_rl.environ import cache_dir
from trace_rl.policy.warmstart import WarmstartConfig, read_record, warmstart_policy


def warmstart_run_name() -> str:
    """The warmstart flow run's name: family, base model and seed, e.g. ``warmstart hotpotqa
    SmolLM2-135M-Instruct seed 0``, instead of Prefect's random two words."""
    from prefect.runtime import flow_run

    given = flow_run.parameters.get("config") or {}
    value = lambda k: given.get(k, WarmstartConfig.model_fields[k].default)  # noqa: E731
    return f"warmstart {value('family')} {Path(str(value('base'))).name} seed {value('seed')}"


@flow(name="warmstart", log_prints=True, flow_run_name=announced(warmstart_run_name),
      **RELEASES_ENGINES)
def warmstart(config: dict[str, Any] | None = None, workdir: str | None = None,
              engine: str = FIELDS["engine"].default) -> dict[str, Any]:
    """Make (or reuse) the warm-started policy; return its directory and its record.

    Args:
        config: WarmstartConfig fields (family, base model, SFT settings); empty means its
            defaults.
        workdir: The work dir that gets a copy of the policy and the build's MLflow run
            (default trace_runs).
        engine: The engine that measures the policy: hf, vllm or auto (default: a train
            config's).
    """
    cfg = WarmstartConfig.model_validate(config or {})
    wd = prepare_workdir(workdir)
    out = Path(wd) / "policies" / f"warmstart-{cfg.family}-{Path(cfg.base).name}-s{cfg.seed}"
    policy = warmstart_policy(cfg, out, cache_dir=cache_dir(), workdir=wd, engine=engine,
                              show_progress=True)
    return {"policy_dir": str(policy), "record": read_record(policy)}
