"""Prefix phases (Stage 2): score every non-leaf prefix on the bare rollouts, choose K per prefix
(per tree, or jointly with fresh prompts across the step)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from prefect import task

from tasks import runtime
from tasks.correlation import outcome_correlation
from tasks.roots import with_counts
from trace_core.allocators import Allocator, PrefixSet, RootPool, allocate_per_tree
from trace_core.waves import split_jointly
from trace_rl.config import TrainConfig
from trace_rl.rollout.treeio import StepTrees


@task(name="score-prefixes", cache_policy=runtime.PHASE_KEY)
def score_prefixes(cfg: TrainConfig, allocator: Allocator, workdir: str, run_id: str,
                   step: int, trees: StepTrees | None = None) -> pa.Table:
    """p = V~(H_ijt) and the observed outcome r_ij for every non-leaf turn node (depth >= 1) of
    the step's bare rollouts; each such node lies on exactly one bare rollout. Each row also
    carries rho for its depth (``outcome_correlation``) and ``seen``, the rollouts below it that
    had the observed outcome (1, or the bare rollouts of a root). When the allocator
    branches from the root (TRACE), the root of a tree whose bare rollouts agree is a candidate
    too (depth 0, observed = the shared outcome). ``trees``: the step's level-0 trees as the
    flow read them (else read here)."""
    trees = runtime.step_trees(workdir, run_id, step, trees)
    from_root = allocator.branches_from_root
    rho = outcome_correlation(cfg, allocator, workdir, run_id, step)
    # Every bare rollout ended on its first turn: nothing to branch from, so the tree's
    # continuation budget goes to more rollouts from the root (the ledger stays equal); TRACE also
    # offers an agreeing root (``TreeBatch.candidates``).
    at, observed = trees.batch.candidates(from_root)
    depth = trees.depth[at]
    bare = trees.floats("allocated_k")[trees.offsets[trees.tree_of_row[at]]].astype(np.int64)
    histories = [trees.history(int(r)) for r in at]
    item = trees.column("item_id")
    predictor = runtime.load_predictor(cfg, workdir, run_id, step - 1)
    p = predictor.predict(histories) if histories else np.zeros(0)
    return pa.table({"tree_id": pa.array(trees.tree_ids[trees.tree_of_row[at]], pa.int64()),
                     "local_index": pa.array(at - trees.offsets[trees.tree_of_row[at]], pa.int64()),
                     "depth": pa.array(depth, pa.int64()),
                     "item_id": pa.array([item[r] for r in at], pa.string()),
                     "observed": pa.array(observed, pa.float64()),
                     "bare": pa.array(bare, pa.int64()),
                     "seen": pa.array(np.where(depth == 0, bare, 1), pa.int64()),
                     "correlation": pa.array([rho.at(int(d)) for d in depth], pa.float64()),
                     "predicted_v": pa.array(np.asarray(p, dtype=np.float64))})


@task(name="allocate-prefixes", cache_policy=runtime.PHASE_KEY)
def allocate_prefixes(cfg: TrainConfig, allocator: Allocator, run_id: str, step: int,
                      scored: pa.Table) -> pa.Table:
    """K per prefix, tree by tree (no cross-prompt waiting): budget m_i * N for tree i."""
    rng = np.random.default_rng([cfg.seed, step, 3])
    col = {name: scored.column(name).to_numpy() for name in
           ("tree_id", "depth", "bare", "predicted_v", "observed", "correlation", "seen")}
    prefixes = PrefixSet(predicted=col["predicted_v"], observed=col["observed"],
                         correlation=col["correlation"], seen=col["seen"].astype(np.int64))
    k = allocate_per_tree(allocator, col["tree_id"], prefixes, col["depth"], col["bare"],
                          cfg.budget, rng)
    return scored.append_column("k", pa.array(k))


@task(name="allocate-joint", cache_policy=runtime.PHASE_KEY)
def allocate_joint(cfg: TrainConfig, allocator: Allocator, run_id: str, step: int,
                   scored: pa.Table, roots: pa.Table, pool: RootPool, counts: list[int],
                   leaves: int) -> tuple[pa.Table, pa.Table]:
    """The joint split (``TrainConfig.joint_split``, ``trace_core.waves.split_jointly``):
    ``leaves`` between continuations of the step's prefixes (``scored``, from
    ``score_prefixes``) and bare rollouts of the candidates of ``pool`` (``roots``, the table
    it was read from) that have no rollout yet (``counts``, per candidate). Returns (``scored``
    with K per prefix, ``roots`` with m per candidate)."""
    rng = np.random.default_rng([cfg.seed, step, 5])
    prefixes = PrefixSet(predicted=scored.column("predicted_v").to_numpy(),
                         observed=scored.column("observed").to_numpy(),
                         correlation=scored.column("correlation").to_numpy(),
                         seen=scored.column("seen").to_numpy())
    m, k = split_jointly(allocator, prefixes, pool, np.asarray(counts), leaves, rng)
    return scored.append_column("k", pa.array(k)), with_counts(roots, m)
