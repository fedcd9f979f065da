"""The ``train`` flow: TRACE's RL loop, one step as a sequence of named, cached phases.

    candidate pool -> allocate roots (scored, then Stage 1) -> expand roots (level 0, persisted;
    DAPO's refill waves) -> allocate prefixes (scored, then Stage 2; with ``joint_split``: or
    fresh prompts, one more level-0 wave) -> expand prefixes (level 1, persisted) -> tree advantages (the
    backup, then each path's advantages) -> fit predictor, beside the policy update -> sync
    weights -> log step (the tree metrics, then MLflow)

Before the first step and after the last, the policy is evaluated on held-out items (paired:
same items, same sampling seeds; ``TrainConfig.eval_items``), and the run ends with a summary of
what it achieved (``tasks.reports.run_summary``): printed by the CLI, the flow run's Markdown
artifact, ``eval/`` metrics and a reward curve in MLflow. What a run does around its steps (the
lock, its records, failures, pruning) is ``flows.run_lifecycle``.

Every allocator and baseline is a config choice of this same flow. A run is identified by its run
id; running the flow again with the same id resumes after the last complete step, and the phases
of an interrupted step that had finished are cache hits (nodes have deterministic ids, so nothing
is duplicated).
"""

from __future__ import annotations

import time
from concurrent.futures import wait
from typing import Any

import numpy as np
from prefect import flow

from flows import run_lifecycle as life
from flows.common import announced, NAMES_ITS_TASK_RUN, Phases, RELEASES_ENGINES, train_run_name
from tasks import evaluate, runtime, track
from tasks.roots import candidate_pool, root_pool, with_counts
from tasks.runtime import StepRef
from trace_core.allocators import Allocator
from trace_core.seeds import Phase, phase_rng
from trace_core.waves import refill_wave
from trace_rl.config import TrainConfig
from trace_rl.progress import Progress
from trace_rl.storage import background


def run_step(cfg: TrainConfig, at: StepRef, policy_dir: str, mlflow_run_id: str,
             watch: Progress | None = None) -> tuple[str, dict[str, float]]:
    """One TRACE step (docs/architecture.md); returns the new policy directory and the step's
    metrics. One allocator serves every allocation of the step."""
    do = Phases(at.workdir, watch, f"step {at.step}: ")
    t0 = time.perf_counter()
    allocator = runtime.allocator_for(cfg.allocation)
    # Stage 1: the candidate pool (a seeded draw), its values (or a Monte-Carlo oracle's) and
    # bare rollouts per prompt; level 0: the bare rollouts (and refill waves).
    roots = candidate_pool(cfg, at.step)
    mc_roots = do.measure_roots(cfg, at, policy_dir, roots) if cfg.oracle_rollouts else None
    pool = do.allocate_roots(cfg, allocator, at, roots, mc_roots)
    counts, waves = _bare_rollouts(do, cfg, allocator, at, policy_dir, pool)
    # Stage 2 on the level-0 trees (read once), its values the predictor's (or a Monte-Carlo
    # oracle's): continuations, and any fresh prompts.
    bare = runtime.step_trees(at)
    mc_prefixes = do.measure_prefixes(cfg, allocator, at, policy_dir, bare) \
        if cfg.oracle_rollouts else None
    chosen, fresh = do.allocate_prefixes(cfg, allocator, at, pool, counts.tolist(), bare,
                                         mc_prefixes)
    if np.any(fresh.column("m").to_numpy() > 0):  # fresh prompts: one more level-0 wave
        do.expand_roots(cfg, at, policy_dir, fresh, waves)
        waves += 1
    if np.any(chosen.column("k").to_numpy() > 0):  # level 1: the continuations
        do.expand_prefixes(cfg, at, policy_dir, chosen, bare)
    t_rollout = time.perf_counter() - t0
    # Learning, on the step's finished trees (read once).
    trees = runtime.step_trees(at)
    paths = do.tree_advantages(cfg, at, trees)  # the backup, then each path's advantages
    # The predictor's fit (~50 ms) beside the update, on the core the update leaves idle.
    fitting = do.beside("fit_predictor", cfg, at, trees)
    try:
        update = do.policy_update(cfg, at, policy_dir, paths, trees)
    finally:
        wait([fitting])  # the fit's task run ends within the step, whatever the update did
    predictor = fitting.result()
    sync_s = do.sync_weights(cfg.engine, cfg.cluster_section, at.run_id, at.policy_dir, at.step)
    metrics = {**predictor, **update["stats"], **track.allocation_metrics(fresh, chosen, waves),
               **track.oracle_metrics(mc_roots, mc_prefixes), "time/rollout_s": t_rollout,
               "time/sync_s": sync_s, "time/step_s": time.perf_counter() - t0}
    # the step's tree figures (on its trees) join them; MLflow logging in the background
    return at.policy_dir, do.log_step(at, mlflow_run_id, metrics, cfg.plot_every > 0 and
                                      at.step % cfg.plot_every == 0,
                                      life.registered(cfg.run, at.step), trees)


def _bare_rollouts(do: Phases, cfg: TrainConfig, allocator: Allocator, at: StepRef,
                   policy_dir: str, allocation: Any) -> tuple[np.ndarray, int]:
    """Level 0: the allocated bare rollouts (``allocation``: ``allocate_roots``' table), then a
    refill wave while the allocator asks for one after seeing the outcomes (DAPO;
    ``trace_core.waves.refill_wave``). Returns [P] rollouts per candidate and the number of
    waves run."""
    rng, pool, plan = phase_rng(cfg.seed, at.step, Phase.REFILL), root_pool(allocation), allocation
    counts, mixed, wave = np.zeros(pool.size, dtype=np.int64), np.zeros(pool.size, bool), 0
    while allocation is not None:
        c, m = do.expand_roots(cfg, at, policy_dir, allocation, wave)
        counts, mixed, wave = counts + c, mixed | m, wave + 1
        extra = refill_wave(allocator, pool, counts, mixed, cfg.budget, rng)
        allocation = None if extra is None else with_counts(plan, extra)
    return counts, wave


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
    with life.Run(config, workdir, wait) as run:
        cfg, do, history = run.cfg, Phases(run.workdir, run.watch), []
        initial, policy_dir, first = run.start()
        skip = evaluate.bootstrap_items(initial)
        if cfg.eval_items:  # a stored evaluation (a resumed run) is read back, not redone
            before = do.evaluate_policy(cfg, run.workdir, run.run_id, 0, initial, skip)
            run.logger.info("held-out accuracy before training: %.3f (%d items x %d samples)",
                            before["accuracy"], before["items"], before["samples"])
        with run.store.held():  # the steps' marks and short phases share a connection (``Phases``)
            for step in run.steps(first):
                with background.deferred(run.workdir):  # its logging starts after its mark
                    policy_dir, metrics = run_step(cfg, run.at(step), policy_dir,
                                                   run.mlflow_run_id, run.watch)
                    run.complete(step, metrics)
                history.append(metrics)
        if cfg.eval_items:
            do.evaluate_policy(cfg, run.workdir, run.run_id, cfg.steps, policy_dir, skip)
        summary, where = run.finish(do.log_summary)
    return {"run_id": run.run_id, "workdir": run.workdir, "policy_dir": policy_dir,
            "mlflow_run_id": run.mlflow_run_id, "steps_run": len(history),
            "last_metrics": history[-1] if history else {}, "summary": summary, "where": where}
