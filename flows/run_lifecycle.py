"""The run around the steps of the ``train`` flow: what a run does once, before, between and after
its steps, apart from the algorithm (``flows/train.py``, ``run_step``).

* registering the run in DuckDB and MLflow, and the disk reserve that lets a run that fills its
  disk still record its failure;
* the starting policy (the tiny policy's bootstrap subflow, or a named policy);
* which checkpoints are registered in MLflow and which are pruned between steps;
* recording a failure or an interrupt in DuckDB and MLflow without masking the original error;
* where to look when the run is done.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect.runtime import flow_run

from tasks import runtime, track
from trace_rl.config import TrainConfig
from trace_rl.config import NEVER_HASHED
from trace_rl.policy.named import resolve_policy
from trace_rl.progress import Progress
from trace_rl.storage.tracking import Tracker
from trace_rl.view.server import page_url


def registered(cfg: TrainConfig, step: int) -> bool:
    """Whether step ``step``'s policy is registered in MLflow (every ``checkpoint_every`` steps
    and the last step)."""
    return (step + 1) % cfg.checkpoint_every == 0 or step == cfg.steps - 1


def prune_checkpoints(cfg: TrainConfig, workdir: str, run_id: str, step: int) -> None:
    """After step ``step``: only the newest checkpoint keeps its optimiser state (what a resume
    needs), and a checkpoint that falls out of the newest ``keep_checkpoints`` (0: keep all) goes
    unless it is registered in MLflow."""
    runtime.drop_optimizer_state(workdir, run_id, step - 1)
    old = step - cfg.keep_checkpoints
    if cfg.keep_checkpoints and old >= 0 and not registered(cfg, old):
        runtime.drop_checkpoint(workdir, run_id, old)


RESERVE_BYTES = 16 << 20
"""Space each work dir holds back (the file ``.failure-reserve``) so that a run that fills its
disk can still record its failure: the handler frees it before writing (a DuckDB update and an
MLflow status change need a few hundred KB; 16 MiB leaves room for DuckDB's checkpoint)."""


def hold_reserve(workdir: str) -> Path:
    """Write the reserve file if it is not whole (a failure freed it, or a first run)."""
    path = Path(workdir) / ".failure-reserve"
    if path.exists() and path.stat().st_size == RESERVE_BYTES:
        return path
    chunk = bytes(1 << 20)
    with path.open("wb") as fh:  # real blocks, not a sparse file: the space must be taken
        for _ in range(RESERVE_BYTES // len(chunk)):
            fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
    return path


def record_failure(logger: Any, store: Any, tracker: Tracker, run_id: str, workdir: str,
                    step: int | None, exc: BaseException) -> None:
    """Mark the running step and the run failed (``killed`` on an interrupt) in DuckDB and
    MLflow, best-effort: each record that cannot be written is logged and skipped, so that the
    original error, logged here first and re-raised by the caller, is never replaced by a
    secondary one (e.g. "No space left on device" from the store while the disk is full)."""
    killed = isinstance(exc, (KeyboardInterrupt, SystemExit))
    where = "outside a step (set-up, bootstrap or wrap-up)" if step is None else f"at step {step}"
    logger.error("run %s %s %s: %s: %s", run_id, "killed" if killed else "failed", where,
                 type(exc).__name__, exc)
    (Path(workdir) / ".failure-reserve").unlink(missing_ok=True)  # room for the records below
    records = [("the run's MLflow status", lambda: tracker.end("KILLED" if killed else "FAILED")),
               ("the run's status in DuckDB",
                lambda: store.set_run(run_id, status="killed" if killed else "failed"))]
    if step is not None:
        records.insert(0, (f"step {step}'s status in DuckDB",
                           lambda: store.mark_step(run_id, step, "failed")))
    for what, record in records:
        try:
            record()
        except Exception as secondary:  # noqa: BLE001 -- the original error must win
            logger.warning("could not record the failure in %s (%s: %s); the run's error is "
                           "the one above", what, type(secondary).__name__, secondary)


def register_run(cfg: TrainConfig, workdir: str, store: Any, tracker: Tracker,
                  mlflow_run_id: str) -> None:
    """Register the run in DuckDB (new, or set running again), set the disk reserve aside, and
    log its config and data sets to MLflow."""
    run_id = cfg.resolved_run_id
    store.init_run(run_id, cfg.to_dict(), mlflow_run_id=mlflow_run_id,
                   prefect_flow_run_id=str(flow_run.get_id() or ""))
    hold_reserve(workdir)
    # a run may resume on another cluster or with another checkpoint retention (not in the run
    # id): those fields are tags, not immutable params
    tracker.log_config(cfg.to_dict(), mutable=NEVER_HASHED)
    track.log_datasets(cfg, workdir, mlflow_run_id, run_id)


def initial_policy(cfg: TrainConfig, workdir: str, watch: Progress) -> str:
    """The policy the run starts from: the tiny policy, bootstrapped by SFT on the family (once
    per work dir, cached), or a named policy or model directory."""
    watch.note(None)  # the bootstrap (or a named policy's first build) reports its own progress
    if cfg.policy != "tiny":
        return resolve_policy(cfg.policy)
    from flows.bootstrap import bootstrap  # only the tiny policy needs the SFT bootstrap

    made = bootstrap(cfg.family, cfg.difficulty, workdir, cfg.seed, mix=cfg.extra.get("mix"),
                     options=cfg.family_options() or None)
    # Prefect links a subflow's return value to the subflow run by object identity, and a task
    # given that very object records a `flow_run` task input, which the UI of the pinned Prefect
    # cannot render (the flow run's Task Runs tab stays empty). The tasks get an equal string
    # that is a new object (str of a Path), so their inputs are plain values.
    return str(Path(made))


def where_to_look(workdir: str, run_id: str, tracker: Tracker) -> dict[str, str]:
    """Commands that open what a run left behind (printed by the CLI, in the flow's artifact)."""
    return {"MLflow UI": tracker.ui_command,
            "MLflow run (on that UI)": tracker.ui_url(),
            "Rollout trees": f"trace view --workdir {workdir}",
            "Rollout trees of the run (on that server)": page_url(run_id),
            "SQL on the trees": f"trace sql --workdir {workdir} \"SELECT step, level, count(*) AS "
                                f"nodes, avg(reward) AS reward FROM nodes WHERE run_id = "
                                f"'{run_id}' GROUP BY ALL ORDER BY ALL\"",
            "SQL on the evaluations": f"trace sql --workdir {workdir} \"SELECT step, accuracy, "
                                      f"ci_low, ci_high FROM evals WHERE run_id = '{run_id}'\""}
