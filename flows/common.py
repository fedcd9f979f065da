"""What every flow does first: resolve the work dir and point task results and cache records at
it, so a re-run in the same work dir finds its finished phases."""

from __future__ import annotations

import os
from pathlib import Path

from prefect import Task

from tasks.runtime import PHASE_KEY, Paths, PhaseKey

DEFAULT_WORKDIR = "trace_runs"
"""Where ``trace`` keeps the DuckDB file, the MLflow store and checkpoints unless told otherwise."""


def resolve_workdir(workdir: str | None) -> str:
    path = Path(workdir or os.environ.get("TRACE_WORKDIR", DEFAULT_WORKDIR)).resolve()
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def bind(task: Task, workdir: str) -> Task:
    """The task with its results and cache records stored under the work dir."""
    if not isinstance(task.cache_policy, PhaseKey):
        return task
    results = Paths(Path(workdir)).results
    return task.with_options(result_storage=results,  # a Path: Prefect's local file system
                             persist_result=True,
                             cache_policy=PHASE_KEY.configure(key_storage=str(results / "keys")))
