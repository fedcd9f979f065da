"""The ``retrain-latest`` flow behind the scheduled retraining deployment.

A cron schedule fires with fixed parameters, yet each firing must start from whatever checkpoint is
newest when it runs. This flow resolves that at run time: a *lineage* is the set of train runs that
share a ``run_name``; the newest complete step of any of them (by finish time, from the DuckDB
``steps`` table) names the checkpoint ``checkpoints/<run_id>/policy-step<NNNN>``. The flow then
runs ``train`` as a subflow with ``policy`` set to that directory. Since the policy is part of the
config hash, every new checkpoint gives a new run id (``<run_name>-<hash>``); a firing that finds
the same checkpoint as the last one resumes that run instead of training twice.

With no checkpoint in the lineage yet (the first firing), the config's own ``policy`` is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.common import resolve_workdir
from flows.train import train
from tasks.runtime import Paths
from trace_rl.config import TrainConfig, config_from_mapping
from trace_rl.storage.store import DB_FILENAME, TreeStore


def latest_checkpoint(workdir: str | Path, run_name: str) -> str | None:
    """The policy directory of the most recently finished complete step among the runs named
    ``run_name`` in ``workdir``, or None if there is none (no database, no such run, no complete
    step, or its checkpoint directory is gone)."""
    workdir = Path(workdir)
    if not (workdir / DB_FILENAME).exists():
        return None
    rows = TreeStore(workdir, create=False).query(
        "SELECT s.run_id, s.step FROM steps s JOIN runs r USING (run_id) "
        "WHERE s.status = 'complete' AND json_extract_string(r.config_json, '$.run_name') = $name "
        "ORDER BY s.finished_at DESC, s.step DESC LIMIT 1", {"name": run_name}).to_pylist()
    if not rows:
        return None
    path = Paths(workdir).policy_dir(rows[0]["run_id"], rows[0]["step"])
    return str(path) if path.is_dir() else None


@flow(name="retrain-latest", log_prints=True)
def retrain_latest(config: TrainConfig = TrainConfig(), workdir: str | None = None) -> dict[str, Any]:
    """Train ``config`` starting from the newest checkpoint of its ``run_name`` lineage in
    ``workdir`` (or from ``config['policy']`` when the lineage has none); returns train's summary
    plus ``started_from``."""
    cfg = config
    if cfg.run_id:
        raise ValueError(f"retrain_latest: config sets run_id={cfg.run_id!r}, which would pin every "
                         f"firing to one run; leave run_id empty so each checkpoint starts a new run")
    workdir = resolve_workdir(workdir)
    latest = latest_checkpoint(workdir, cfg.run_name)
    start = latest or cfg.policy
    get_run_logger().info("lineage %r in %s: starting from %s", cfg.run_name, workdir,
                          latest or f"config policy {cfg.policy!r} (no checkpoint yet)")
    summary = train(config=config_from_mapping({**cfg.to_dict(), "policy": start}, "retrain_latest"),
                    workdir=workdir)
    return {**summary, "started_from": start}
