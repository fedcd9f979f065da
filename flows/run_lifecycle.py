"""The run around the steps of the ``train`` flow: what a run does once, before, between and after
its steps, apart from the algorithm (``flows/train.py``, ``run_step``).

* ``Run``: the work-dir lock, the checked config, the run's records in DuckDB and MLflow, the
  steps still to run, each step marked running and complete, and the run's end;
* registering the run in DuckDB and MLflow, and the disk reserve that lets a run that fills its
  disk still record its failure;
* the starting policy (the tiny policy's bootstrap subflow, or a named policy);
* which checkpoints are registered in MLflow and which are pruned between steps;
* recording a failure or an interrupt in DuckDB and MLflow without masking the original error;
* where to look when the run is done.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.runtime import flow_run

from tasks import runtime, track
from tasks.runtime import StepRef
from trace_rl.config import NEVER_HASHED, TrainConfig, check_inputs
from trace_rl.config.sections import Run as RunSection
from trace_rl.storage.locks import train_lock
from trace_rl.policy.named import resolve_policy
from trace_rl.progress import Progress
from trace_rl.storage.tracking import Tracker
from trace_rl.view.server import page_url


class Run:
    """One ``train`` run while it holds its work dir: ``with Run(config, workdir, wait) as run``
    takes the work-dir lock (before MLflow or DuckDB are set up), checks the config's inputs,
    registers the run (``register_run``); any failure from then on (the bootstrap included)
    marks the running step and the run failed in DuckDB and MLflow and re-raises the original
    error (``record_failure``). ``steps()`` are the steps still to run, each marked running;
    ``complete`` marks one complete and prunes checkpoints; ``finish`` ends the run."""

    def __init__(self, config: TrainConfig, workdir: str | None, wait: bool):
        from flows.common import prepare_workdir

        self.workdir = prepare_workdir(workdir)
        self.run_id = config.resolved_run_id
        self._lock = train_lock(self.workdir, self.run_id, wait=wait)
        self._wanted = config
        self.running: int | None = None  # the step marked running, if any

    def __enter__(self) -> "Run":
        self._lock.__enter__()
        # A phase silent for 15 s gets a line while it runs: the README promises one every 30 s.
        self.watch = Progress("train", 0, every_s=15, quiet=True)
        try:
            self.logger = get_run_logger()
            runtime.configure_threads()
            self.cfg = check_inputs(self._wanted)
            self.store = runtime.store(self.workdir)
            self.tracker = Tracker(self.workdir)
            known = self.store.get_run(self.run_id)
            self.mlflow_run_id = self.tracker.start_or_resume(
                self.run_id, run_name=track.mlflow_run_name(self.cfg),
                mlflow_run_id=(known or {}).get("mlflow_run_id"), tags=track.run_tags(self.cfg))
        except BaseException:
            self.watch.close()
            self._lock.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        try:
            if exc is not None and hasattr(self, "mlflow_run_id"):
                record_failure(self.logger, self.store, self.tracker, self.run_id, self.workdir,
                               self.running, exc)
        finally:
            self.watch.close()
            self._lock.__exit__(kind, exc, tb)

    def at(self, step: int) -> StepRef:
        return StepRef(self.workdir, self.run_id, step)

    def start(self) -> tuple[str, str, int]:
        """Register the run; (its starting policy, the policy to continue from, the first step
        to run)."""
        register_run(self.cfg, self.workdir, self.store, self.tracker, self.mlflow_run_id)
        done = self.store.last_complete_step(self.run_id)
        initial = initial_policy(self.cfg, self.workdir, self.watch)
        if done is not None and done + 1 >= self.cfg.steps:
            self.logger.info("run %s already has %d complete steps; nothing to do", self.run_id,
                             self.cfg.steps)
        return initial, initial if done is None else self.at(done).policy_dir, \
            0 if done is None else done + 1

    def steps(self, first: int) -> Any:
        """The steps from ``first`` to the last, each marked running before it is yielded.
        (Named running before the mark: a mark that is written but then fails to publish, a
        full disk, still gets the step marked failed, never left "running".)"""
        for step in range(first, self.cfg.steps):
            if self.running != step:  # not marked by the previous step's ``complete``
                self.running = step
                self.store.mark_step(self.run_id, step, "running")
            yield step

    def complete(self, step: int, metrics: dict[str, float]) -> None:
        """Mark ``step`` complete and the next one (if any) running, in one write; prune the
        checkpoints it outdates, log its line."""
        after = step + 1 if step + 1 < self.cfg.steps else None
        self.store.mark_step(self.run_id, step, "complete", metrics, then_running=after)
        self.running = after
        prune_checkpoints(self.cfg, self.workdir, self.run_id, step)
        self.logger.info("step %d: reward %.3f, effective ratio %.2f, leaves %d, %.1fs", step,
                         metrics["rollout/reward_mean"], metrics["tree/effective_ratio"],
                         metrics["rollout/leaves"], metrics["time/step_s"])

    def finish(self, log_summary: Any) -> tuple[dict[str, Any], dict[str, str]]:
        """The run's summary (``log_summary``, the bound task) and where to look; the run marked
        complete in DuckDB and MLflow."""
        where = where_to_look(self.workdir, self.run_id, self.tracker)
        summary = log_summary(self.workdir, self.mlflow_run_id, self.run_id, where)
        self.store.set_run(self.run_id, status="complete")
        self.tracker.end("FINISHED")
        return summary, where


def registered(run: RunSection, step: int) -> bool:
    """Whether step ``step``'s policy is registered in MLflow (every ``checkpoint_every`` steps
    of a config's ``run`` section, and the last step)."""
    return (step + 1) % run.checkpoint_every == 0 or step == run.steps - 1


def prune_checkpoints(cfg: TrainConfig, workdir: str, run_id: str, step: int) -> None:
    """After step ``step``: only the newest checkpoint keeps its optimiser state (what a resume
    needs), and a checkpoint that falls out of the newest ``keep_checkpoints`` (0: keep all) goes
    unless it is registered in MLflow."""
    runtime.drop_optimizer_state(workdir, run_id, step - 1)
    old = step - cfg.keep_checkpoints
    if cfg.keep_checkpoints and old >= 0 and not registered(cfg.run, old):
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
                           lambda: store.mark_failed(run_id, step)))
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
