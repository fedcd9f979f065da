"""The ``train`` flow: TRACE's RL loop, one step as a sequence of named, cached phases.

    sample roots -> score roots -> allocate roots -> expand level 0 -> persist -> score prefixes
    -> allocate prefixes -> expand level 1 -> persist -> backup -> fit predictor -> advantages
    -> policy update -> sync weights -> log

Before the first step and after the last, the policy is evaluated on held-out items (paired:
same items, same sampling seeds; ``TrainConfig.eval_items``), and the run ends with a summary of
what it achieved (``tasks.track.run_summary``): printed by the CLI, the flow run's Markdown
artifact, ``eval/`` metrics and a reward curve in MLflow.

With ``joint_split`` (TRACE), "allocate prefixes" splits the rest of the budget between
continuations and prompts not yet rolled out; the latter are one more level-0 wave.

Every allocator and baseline is a config choice of this same flow. A run is identified by its run
id; running the flow again with the same id resumes after the last complete step, and the phases
of an interrupted step that had finished are cache hits (nodes have deterministic ids, so nothing
is duplicated).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from prefect import flow, get_run_logger

from flows import run_lifecycle as life
from flows.common import (announced, bind, NAMES_ITS_TASK_RUN, RELEASES_ENGINES,
                          resolve_workdir, train_run_name)
from tasks import evaluate, expand, learn, prefixes, roots, runtime, track
from trace_core.allocators import Allocator, RootPool
from trace_core.waves import outcome_counts, refill_wave
from trace_rl.config import TrainConfig, check_inputs
from trace_rl.progress import Progress
from trace_rl.storage.locks import train_lock
from trace_rl.storage.tracking import Tracker


@dataclass(frozen=True)
class StepTasks:
    """The step's tasks, one per phase, bound to the work dir (results and cache records kept
    there, so a re-run finds its finished phases). With a watch, each call first names its phase
    there, so a phase that runs long (an update on a busy machine) is reported while it runs."""

    sample_roots: Any
    score_roots: Any
    allocate_roots: Any
    expand_roots: Any
    persist_level: Any
    score_prefixes: Any
    allocate_prefixes: Any
    allocate_joint: Any
    expand_prefixes: Any
    backup: Any
    fit_predictor: Any
    tree_advantages: Any
    policy_update: Any
    sync_weights: Any
    tree_metrics: Any
    prediction_metrics: Any
    log_step: Any

    @classmethod
    def bound(cls, workdir: str, watch: Progress | None = None, where: str = "") -> "StepTasks":
        def wrap(task: Any) -> Any:
            bound = bind(track.named(task), workdir)
            return bound if watch is None else _watched(bound, watch, f"{where}{task.name}")

        return cls(sample_roots=wrap(roots.sample_roots), score_roots=wrap(roots.score_roots),
                   allocate_roots=wrap(roots.allocate_roots),
                   expand_roots=wrap(expand.expand_roots),
                   persist_level=wrap(expand.persist_level),
                   score_prefixes=wrap(prefixes.score_prefixes),
                   allocate_prefixes=wrap(prefixes.allocate_prefixes),
                   allocate_joint=wrap(prefixes.allocate_joint),
                   expand_prefixes=wrap(expand.expand_prefixes), backup=wrap(learn.backup),
                   fit_predictor=wrap(learn.fit_predictor),
                   tree_advantages=wrap(learn.tree_advantages),
                   policy_update=wrap(learn.policy_update), sync_weights=wrap(learn.sync_weights),
                   tree_metrics=wrap(track.tree_metrics),
                   prediction_metrics=wrap(track.prediction_metrics),
                   log_step=wrap(track.log_step))


def _watched(task: Any, watch: Progress, phase: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        watch.note(phase)
        return task(*args, **kwargs)
    return call


def run_step(cfg: TrainConfig, workdir: str, run_id: str, step: int, policy_dir: str,
             mlflow_run_id: str, watch: Progress | None = None) -> tuple[str, dict[str, float]]:
    """One TRACE step (docs/architecture.md); returns the new policy directory and the step's
    metrics. One allocator and one candidate pool serve every allocation of the step."""
    t = StepTasks.bound(workdir, watch, f"step {step}: ")
    t0 = time.perf_counter()
    allocator = runtime.allocator_for(cfg)
    # Stage 1: the root pool, its predicted values, the bare-rollout counts.
    ids = t.sample_roots(cfg, run_id, step)
    scored = t.score_roots(cfg, allocator, workdir, run_id, step, ids)
    pool = roots.root_pool(scored)
    allocation = t.allocate_roots(cfg, allocator, run_id, step, scored, pool)
    # Level 0: bare rollouts, rewards, persisted (then DAPO's refill waves).
    counts, waves = _bare_rollouts(t, cfg, allocator, workdir, run_id, step, policy_dir, scored,
                                   pool, allocation)
    # Stage 2: score the prefixes, allocate continuations (or, jointly, fresh prompts too). The
    # level-0 trees are read once and handed on (a fresh wave adds trees, none of them chosen).
    bare = runtime.step_trees(workdir, run_id, step)
    scored_prefixes = t.score_prefixes(cfg, allocator, workdir, run_id, step, bare)
    fresh_leaves = 0
    if allocator.splits_jointly:
        chosen, fresh = t.allocate_joint(cfg, allocator, run_id, step, scored_prefixes, scored,
                                         pool, counts.tolist(), cfg.budget.total - int(counts.sum()))
        fresh_leaves = int(pc.sum(fresh.column("m")).as_py() or 0)
        if fresh_leaves:  # bare rollouts of prompts not yet rolled out: one more level-0 wave
            _expand_wave(t, cfg, workdir, run_id, step, policy_dir, fresh, waves)
            waves += 1
    else:
        chosen = t.allocate_prefixes(cfg, allocator, run_id, step, scored_prefixes)
    # Level 1: continuations from the chosen prefixes, rewards, persisted.
    if int(pc.sum(chosen.column("k")).as_py() or 0) > 0:
        level1 = t.expand_prefixes(cfg, workdir, run_id, step, 1, policy_dir, chosen, bare)
        t.persist_level(workdir, run_id, step, 1, level1)
    t_rollout = time.perf_counter() - t0
    # Learning: backup targets, predictor, tree advantages, policy update, weight sync, log, on
    # the step's finished trees, read once.
    trees = runtime.step_trees(workdir, run_id, step)
    t.backup(workdir, run_id, step, trees=trees)
    pred_stats = t.fit_predictor(cfg, workdir, run_id, step, trees)
    paths = t.tree_advantages(cfg, workdir, run_id, step, trees)
    update = t.policy_update(cfg, workdir, run_id, step, policy_dir, paths, trees)
    # this work dir's checkpoint: a cached result names the work dir it was written in
    new_policy = str(runtime.Paths(Path(workdir)).policy_dir(run_id, step))
    sync_s = t.sync_weights(cfg, new_policy, step)
    metrics = {**t.tree_metrics(workdir, run_id, step), **pred_stats,
               **t.prediction_metrics(workdir, run_id, step), **update["stats"],
               **_allocation_metrics(scored, scored_prefixes, chosen, waves, fresh_leaves),
               "time/rollout_s": t_rollout, "time/sync_s": sync_s,
               "time/step_s": time.perf_counter() - t0}
    plot = cfg.plot_every > 0 and step % cfg.plot_every == 0
    register = life.registered(cfg, step)
    t.log_step(workdir, mlflow_run_id, run_id, step, metrics, new_policy,
               str(runtime.Paths(Path(workdir)).predictor_file(run_id, step)), plot, register)
    return new_policy, metrics


def _expand_wave(t: StepTasks, cfg: TrainConfig, workdir: str, run_id: str, step: int,
                 policy_dir: str, allocation: pa.Table, wave: int) -> pa.Table:
    """Bare rollouts of one level-0 wave (``allocation``'s column ``m``), persisted; its nodes."""
    level = t.expand_roots(cfg, run_id, step, 0, policy_dir, allocation, wave)
    t.persist_level(workdir, run_id, step, 0, level, wave)
    return level["nodes"]


def _bare_rollouts(t: StepTasks, cfg: TrainConfig, allocator: Allocator, workdir: str,
                   run_id: str, step: int, policy_dir: str, scored: pa.Table, pool: RootPool,
                   allocation: pa.Table) -> tuple[np.ndarray, int]:
    """Level 0: the allocated bare rollouts, then a refill wave while the allocator asks for
    one after seeing the outcomes (DAPO; ``trace_core.waves.refill_wave``). Returns [P] rollouts
    per candidate and the number of waves run."""
    rng = np.random.default_rng([cfg.seed, step, 4])
    counts = np.zeros(pool.size, dtype=np.int64)
    mixed = np.zeros(pool.size, dtype=bool)
    wave = 0
    while allocation is not None:
        nodes = _expand_wave(t, cfg, workdir, run_id, step, policy_dir, allocation, wave)
        c, m = outcome_counts(nodes.column("tree_id").to_numpy(), nodes.column("reward").to_numpy(),
                              nodes.column("is_leaf").to_numpy(), pool.size, wave * pool.size)
        counts, mixed, wave = counts + c, mixed | m, wave + 1
        extra = refill_wave(allocator, pool, counts, mixed, cfg.budget, rng)
        allocation = None if extra is None else roots.with_counts(scored, extra)
    return counts, wave


def _allocation_metrics(scored: pa.Table, scored_prefixes: pa.Table, chosen: pa.Table,
                        waves: int, fresh_leaves: int) -> dict[str, float]:
    """``alloc/`` metrics of a step: the outcome correlations its allocations used, prefixes
    continued, level-0 waves after the first (refills and the joint split's fresh prompts)."""
    depth = scored_prefixes.column("depth").to_numpy()
    rho_prefix = scored_prefixes.column("correlation").to_numpy()[depth >= 1]
    return {"alloc/rho_root": float(scored.column("correlation")[0].as_py() if len(scored) else 0.0),
            "alloc/rho_prefix": float(np.mean(rho_prefix)) if rho_prefix.size else 0.0,
            "alloc/prefixes_expanded": float(np.count_nonzero(chosen.column("k").to_numpy())),
            "alloc/refill_waves": float(waves - 1), "alloc/fresh_leaves": float(fresh_leaves)}


@flow(name="train", log_prints=True, flow_run_name=announced(train_run_name), **RELEASES_ENGINES,
      **NAMES_ITS_TASK_RUN)
def train(config: TrainConfig = TrainConfig(), workdir: str | None = None,
          wait: bool = False) -> dict[str, Any]:
    """Train a policy with TRACE (or a baseline allocator) and return a summary.

    Prefect validates ``config`` before the flow run starts, so the UI's run form is typed and
    refuses a bad value. One run trains a work dir at a time: the work-dir lock is taken before
    MLflow or DuckDB are set up. The config's inputs (data files, policy directory) are checked
    before the run is registered; from then on any failure (the bootstrap included) marks the
    running step and the run failed in DuckDB and MLflow and re-raises the original error, and
    running the flow again resumes after the last complete step. The flow run is named after the
    run id and its steps (a name typed in the form's Run Name is replaced: name a run with
    config's run_name).

    Args:
        config: The run (a TrainConfig): family, policy, allocator, budget and the rest.
        workdir: Where the run's DuckDB file, MLflow store and checkpoints go (default
            trace_runs, under the directory the worker runs in).
        wait: If another run holds the work dir: wait for it to finish (true) or fail at once
            naming it (false).
    """
    with train_lock(resolve_workdir(workdir), config.resolved_run_id, wait=wait):
        return _train(config, workdir)


def _train(cfg: TrainConfig, workdir: str | None) -> dict[str, Any]:
    """The body of ``train``, run while the work-dir lock is held."""
    logger = get_run_logger()
    runtime.configure_threads()
    cfg = check_inputs(cfg)
    workdir = resolve_workdir(workdir)
    run_id = cfg.resolved_run_id
    store = runtime.store(workdir)
    tracker = Tracker(workdir)
    known = store.get_run(run_id)
    mlflow_run_id = tracker.start_or_resume(run_id, run_name=track.mlflow_run_name(cfg),
                                            mlflow_run_id=(known or {}).get("mlflow_run_id"),
                                            tags=track.run_tags(cfg))
    running = None  # the step marked running, if any
    history = []
    # A phase silent for 15 s gets a line while it runs: the README promises one every 30 s.
    watch = Progress("train", 0, every_s=15, quiet=True)
    held_out = _watched(bind(track.named(evaluate.evaluate_policy), workdir), watch,
                        "held-out evaluation")
    try:
        life.register_run(cfg, workdir, store, tracker, mlflow_run_id)
        done = store.last_complete_step(run_id)
        start = 0 if done is None else done + 1
        initial = life.initial_policy(cfg, workdir, watch)
        policy_dir = initial if done is None else \
            str(runtime.Paths(Path(workdir)).policy_dir(run_id, done))
        if start >= cfg.steps:
            logger.info("run %s already has %d complete steps; nothing to do", run_id, cfg.steps)
        skip = evaluate.bootstrap_items(initial)
        if cfg.eval_items:  # a stored evaluation (a resumed run) is read back, not redone
            before = held_out(cfg, workdir, run_id, 0, initial, skip)
            logger.info("held-out accuracy before training: %.3f (%d items x %d samples)",
                        before["accuracy"], before["items"], before["samples"])
        for step in range(start, cfg.steps):
            # Named running before the mark: a mark that is written but then fails to publish
            # (a full disk) still gets the step marked failed, never left "running".
            running = step
            store.mark_step(run_id, step, "running")
            policy_dir, metrics = run_step(cfg, workdir, run_id, step, policy_dir, mlflow_run_id,
                                           watch)
            store.mark_step(run_id, step, "complete", metrics)
            running = None
            life.prune_checkpoints(cfg, workdir, run_id, step)
            history.append(metrics)
            _say_step(logger, step, metrics)
        if cfg.eval_items:
            held_out(cfg, workdir, run_id, cfg.steps, policy_dir, skip)
        where = life.where_to_look(workdir, run_id, tracker)
        summary = _watched(bind(track.log_summary, workdir), watch, "summary")(
            workdir, mlflow_run_id, run_id, where)
        store.set_run(run_id, status="complete")
        tracker.end("FINISHED")
    except BaseException as exc:
        life.record_failure(logger, store, tracker, run_id, workdir, running, exc)
        raise
    finally:
        watch.close()
    return {"run_id": run_id, "workdir": workdir, "policy_dir": policy_dir,
            "mlflow_run_id": mlflow_run_id, "steps_run": len(history),
            "last_metrics": history[-1] if history else {}, "summary": summary, "where": where}


def _say_step(logger: Any, step: int, metrics: dict[str, float]) -> None:
    """The log line of a finished step."""
    logger.info("step %d: reward %.3f, effective ratio %.2f, leaves %d, %.1fs", step,
                metrics["rollout/reward_mean"], metrics["tree/effective_ratio"],
                metrics["rollout/leaves"], metrics["time/step_s"])


