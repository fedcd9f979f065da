"""The ``retrain-latest`` flow behind the scheduled retraining deployment.

A cron schedule fires with fixed parameters, yet each firing must start from the best policy
there is when it runs. This flow resolves that at run time from the work dir's MLflow model
registry: the version of ``<experiment>-policy`` with the alias ``champion``, which only an
evaluation that beats the previous champion on the held-out split moves (``Tracker.promote``,
at the end of every train run). A 1-step smoke run or a GRPO baseline finished after the best
run does not become the start point unless it did better. The champion is downloaded from the
registry to ``<workdir>/registry/<model>-v<version>`` (kept: the same version gives the same
path, so the same config hash and run id) and ``train`` runs as a subflow with ``policy`` set to
its Hugging Face directory. A firing that finds the same champion as the last one resumes that
run instead of training twice.

With no champion yet (the first firing), the config's own ``policy`` is used.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.common import announced, prepare_workdir, run_config
from flows.train import train
from trace_rl.config import TrainConfig, config_from_mapping
from trace_rl.storage.tracking import Tracker


def champion_checkpoint(workdir: str | Path) -> tuple[str, str] | None:
    """(policy directory, version) of the registry's ``champion`` policy in ``workdir``,
    downloaded from the registry if it is not yet; None if there is no champion (no store, or no
    train run has been evaluated after training)."""
    workdir = Path(workdir)
    if not (workdir / "mlflow.db").exists():
        return None
    tracker = Tracker(workdir)
    champ = tracker.champion("policy")
    if champ is None:
        return None
    name = tracker.model_name("policy")
    dest = workdir / "registry" / f"{name}-v{champ.version}"
    if not (dest / "model" / "config.json").exists():
        # the version's source is runs:/<run>/<path>; read it through this store's client
        # (a models:/ URI would go to the process's global registry, not this work dir's)
        prefix = f"runs:/{champ.run_id}/"
        if not champ.source.startswith(prefix):
            raise ValueError(f"{name} v{champ.version}: source {champ.source!r} is not an "
                             f"artifact of its run {champ.run_id}")
        tmp = dest.with_name(dest.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        got = Path(tracker.client.download_artifacts(champ.run_id, champ.source[len(prefix):],
                                                     str(tmp)))
        shutil.rmtree(dest, ignore_errors=True)
        got.rename(dest)
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest / "model"), champ.version


def retrain_run_name() -> str:
    """The retrain-latest flow run's name: the config's run name and when the run was due, e.g.
    ``retrain-latest trace-default 2026-12-05 03:00 UTC``, instead of Prefect's random two words."""
    from prefect.runtime import flow_run

    cfg = run_config()
    name = "(invalid config)" if cfg is None else cfg.run_name
    return f"retrain-latest {name} {flow_run.scheduled_start_time:%Y-%m-%d %H:%M} UTC"


@flow(name="retrain-latest", log_prints=True, flow_run_name=announced(retrain_run_name))
def retrain_latest(config: TrainConfig = TrainConfig(), workdir: str | None = None) -> dict[str, Any]:
    """Train from the registry's champion policy: the best held-out score so far.

    Returns train's summary plus ``started_from`` and ``champion_version``.

    Args:
        config: The run to train (a TrainConfig); its policy is replaced by the registry's
            champion, and used only while there is none. Leave run_id empty.
        workdir: The work dir whose MLflow registry holds the champion, and where the run's
            DuckDB file, MLflow store and checkpoints go (default trace_runs).
    """
    cfg = config
    if cfg.run_id:
        raise ValueError(f"retrain_latest: config sets run_id={cfg.run_id!r}, which would pin every "
                         f"firing to one run; leave run_id empty so each checkpoint starts a new run")
    workdir = prepare_workdir(workdir)
    found = champion_checkpoint(workdir)
    start = found[0] if found else cfg.policy
    said = (f"registry champion {Tracker(workdir).model_name('policy')} v{found[1]} ({found[0]})"
            if found else f"config policy {cfg.policy!r} (no champion in the registry yet)")
    get_run_logger().info("retrain-latest in %s: starting from %s", workdir, said)
    summary = train(config=config_from_mapping({**cfg.to_dict(), "policy": start}, "retrain_latest"),
                    workdir=workdir)
    return {**summary, "started_from": start, "champion_version": found[1] if found else None}
