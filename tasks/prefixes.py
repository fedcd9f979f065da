"""Stage 2, one task: score every candidate prefix on the bare rollouts (``score_prefixes``), then
choose K per prefix and any fresh prompts (``allocate_prefixes``; ``trace_core.waves.continuations``)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from prefect import task

from tasks import runtime
from tasks.correlation import outcome_correlation
from tasks.roots import root_pool, with_counts
from tasks.runtime import StepRef
from trace_core.allocators import Allocator, PrefixSet
from trace_core.seeds import Phase, phase_rng
from trace_core.waves import continuations
from trace_rl.config import TrainConfig
from trace_rl.rollout.treeio import StepTrees


def score_prefixes(cfg: TrainConfig, allocator: Allocator, at: StepRef,
                   trees: StepTrees | None = None, measured: pa.Table | None = None) -> pa.Table:
    """p = V~(H_ijt) and the observed outcome r_ij of every Stage 2 candidate of the step's bare
    rollouts (``TreeBatch.candidates``), with its tree's bare rollouts, ``seen`` (the rollouts
    below it that had the observed outcome: 1, or a root's bare rollouts) and rho for its depth
    (``outcome_correlation``). ``trees``: the step's level-0 trees as the flow read them. With
    ``measured`` (``measure_prefixes``, same order), p is the Monte-Carlo oracle's success rate
    instead of the predictor's."""
    trees = runtime.step_trees(at, trees)
    rho = outcome_correlation(cfg, allocator, at.workdir, at.run_id, at.step)
    at_rows, observed = trees.batch.candidates(allocator.branches_from_root)
    tree, depth = trees.tree_of_row[at_rows], trees.depth[at_rows]
    bare = trees.floats("allocated_k")[trees.offsets[tree]].astype(np.int64)
    histories = [trees.history(int(r)) for r in at_rows]
    if measured is not None:
        if len(measured) != len(at_rows):
            raise ValueError(f"score_prefixes: {len(measured)} measured, {len(at_rows)} candidates")
        p = measured.column("successes").to_numpy() / measured.column("rollouts").to_numpy()
    else:
        p = runtime.load_predictor(cfg.predictor, cfg.seed, at.workdir, at.run_id,
                                   at.step - 1).predict(histories) if histories else np.zeros(0)
    item = trees.column("item_id")
    return pa.table({"tree_id": pa.array(trees.tree_ids[tree], pa.int64()),
                     "local_index": pa.array(at_rows - trees.offsets[tree], pa.int64()),
                     "depth": pa.array(depth, pa.int64()),
                     "item_id": pa.array([item[r] for r in at_rows], pa.string()),
                     "observed": pa.array(observed, pa.float64()),
                     "bare": pa.array(bare, pa.int64()),
                     "seen": pa.array(np.where(depth == 0, bare, 1), pa.int64()),
                     "correlation": pa.array([rho.at(int(d)) for d in depth], pa.float64()),
                     "predicted_v": pa.array(np.asarray(p, dtype=np.float64))})


@task(name="allocate-prefixes", cache_policy=runtime.PHASE_KEY)
def allocate_prefixes(cfg: TrainConfig, allocator: Allocator, at: StepRef, roots: pa.Table,
                      counts: list[int], trees: StepTrees | None = None,
                      measured: pa.Table | None = None) -> tuple[pa.Table, pa.Table]:
    """Stage 2 (``trace_core.waves.continuations``) on the step's bare rollouts (``trees``, as
    the flow read them): every candidate prefix scored (``score_prefixes``; ``measured``: the
    Monte-Carlo oracle's), K per prefix and, where the allocator splits jointly, bare rollouts of
    candidates of ``roots`` (``allocate_roots``' table) not yet rolled out (``counts``, per
    candidate). Returns (the scored prefixes with ``k``, ``roots`` with ``m``: all 0 unless fresh
    prompts were bought). Scoring and allocating are one task run (both cheap; cached together)."""
    return choose_prefixes(cfg, allocator, at, score_prefixes(cfg, allocator, at, trees, measured),
                           roots, counts)


def choose_prefixes(cfg: TrainConfig, allocator: Allocator, at: StepRef, scored: pa.Table,
                    roots: pa.Table, counts: list[int]) -> tuple[pa.Table, pa.Table]:
    """``allocate_prefixes`` after the scoring: K per prefix of ``scored`` (``score_prefixes``)
    and any fresh prompts of ``roots``."""
    rng = phase_rng(cfg.seed, at.step, Phase.JOINT if allocator.splits_jointly else Phase.PREFIXES)
    col = {name: scored.column(name).to_numpy() for name in
           ("tree_id", "depth", "bare", "predicted_v", "observed", "correlation", "seen")}
    prefixes = PrefixSet(predicted=col["predicted_v"], observed=col["observed"],
                         correlation=col["correlation"], seen=col["seen"].astype(np.int64))
    k, m = continuations(allocator, prefixes, col["tree_id"], col["depth"], col["bare"],
                         root_pool(roots), np.asarray(counts), cfg.budget, rng)
    return scored.append_column("k", pa.array(k)), with_counts(roots, m)
