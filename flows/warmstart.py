"""The ``warmstart`` flow: a real language model warm-started for a real family by SFT on ReAct
traces of the family's training data (``trace_rl.policy.warmstart``). Built once per machine: the
policy is cached under ``trace_rl.environ.cache_dir()`` by the hash of its inputs, and each work
dir gets a copy; the build is an MLflow run (experiment ``warmstart``) in the work dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from flows.common import RELEASES_ENGINES, resolve_workdir
from trace_rl.environ import cache_dir
from trace_rl.policy.warmstart import WarmstartConfig, read_record, warmstart_policy


@flow(name="warmstart", log_prints=True, **RELEASES_ENGINES)
def warmstart(config: dict[str, Any] | None = None, workdir: str | None = None,
              engine: str = "auto") -> dict[str, Any]:
    """Make (or reuse) the warm-started policy; return its directory and its record."""
    values = dict(config or {})
    if "env_args" in values and isinstance(values["env_args"], dict):
        values["env_args"] = tuple(sorted(values["env_args"].items()))
    cfg = WarmstartConfig(**values)
    wd = resolve_workdir(workdir)
    out = Path(wd) / "policies" / f"warmstart-{cfg.family}-{Path(cfg.base).name}-s{cfg.seed}"
    policy = warmstart_policy(cfg, out, cache_dir=cache_dir(), workdir=wd, engine=engine,
                              show_progress=True)
    return {"policy_dir": str(policy), "record": read_record(policy)}
