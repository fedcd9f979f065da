"""Prefix phases (Stage 2): score every non-leaf prefix on the bare rollouts, choose K per prefix
(per tree, or jointly with fresh prompts across the step)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa
from prefect import task

from tasks import runtime
from tasks.correlation import outcome_correlation
from tasks.roots import with_counts
from trace_core.allocators import Allocator, PrefixSet, RootPool, root_prefix
from trace_core.waves import split_jointly
from trace_rl.config import TrainConfig
from trace_rl.rollout.treeio import group_trees, node_history


@task(name="score-prefixes", cache_policy=runtime.PHASE_KEY)
def score_prefixes(cfg: TrainConfig, allocator: Allocator, workdir: str, run_id: str,
                   step: int) -> pa.Table:
    """p = V~(H_ijt) and the observed outcome r_ij for every non-leaf turn node (depth >= 1) of
    the step's bare rollouts; each such node lies on exactly one bare rollout. Each row also
    carries rho for its depth (``outcome_correlation``) and ``seen``, the rollouts below it that
    had the observed outcome (1, or the bare rollouts of a root). When the allocator
    branches from the root (TRACE), the root of a tree whose bare rollouts agree is a candidate
    too (depth 0, observed = the shared outcome)."""
    trees = group_trees(runtime.store(workdir).read_step(run_id, step).to_pylist())
    from_root = allocator.branches_from_root
    rho = outcome_correlation(cfg, allocator, workdir, run_id, step)
    out: dict[str, list] = defaultdict(list)
    histories = []

    def add(tree: list[dict], t: int, node: dict, observed: float) -> None:
        histories.append(node_history(tree, node["local_index"]))
        seen = tree[0]["allocated_k"] if node["depth"] == 0 else 1  # rollouts below that agree
        for k, v in (("tree_id", t), ("local_index", node["local_index"]), ("depth", node["depth"]),
                     ("item_id", node["item_id"]), ("observed", observed),
                     ("bare", tree[0]["allocated_k"]), ("seen", seen),
                     ("correlation", rho.at(node["depth"]))):
            out[k].append(v)

    for t, tree in trees.items():
        before = len(histories)
        bare = [float(r["reward"]) for r in tree if r["is_leaf"] and r["level"] == 0]
        for r in tree:
            if r["depth"] == 0 or r["is_leaf"] or r["level"] != 0:
                continue
            leaf = r
            while not leaf["is_leaf"]:  # follow the bare rollout down to its outcome
                leaf = next(c for c in tree if c["parent_index"] == leaf["local_index"])
            add(tree, t, r, float(leaf["reward"]))
        shared = root_prefix(bare)
        if len(histories) == before:
            # Every bare rollout ended on its first turn: nothing to branch from, so the tree's
            # continuation budget goes to more rollouts from the root (the ledger stays equal).
            # Observed: the bare rollouts' shared outcome, NaN when they are mixed.
            add(tree, t, tree[0], float("nan") if shared is None else shared)
        elif from_root and shared is not None:
            add(tree, t, tree[0], shared)
    predictor = runtime.load_predictor(cfg, workdir, run_id, step - 1)
    p = predictor.predict(histories) if histories else np.zeros(0)
    return pa.table({"tree_id": pa.array(out["tree_id"], pa.int64()),
                     "local_index": pa.array(out["local_index"], pa.int64()),
                     "depth": pa.array(out["depth"], pa.int64()),
                     "item_id": pa.array(out["item_id"], pa.string()),
                     "observed": pa.array(out["observed"], pa.float64()),
                     "bare": pa.array(out["bare"], pa.int64()),
                     "seen": pa.array(out["seen"], pa.int64()),
                     "correlation": pa.array(out["correlation"], pa.float64()),
                     "predicted_v": pa.array(np.asarray(p, dtype=np.float64))})


@task(name="allocate-prefixes", cache_policy=runtime.PHASE_KEY)
def allocate_prefixes(cfg: TrainConfig, allocator: Allocator, run_id: str, step: int,
                      scored: pa.Table) -> pa.Table:
    """K per prefix, tree by tree (no cross-prompt waiting): budget m_i * N for tree i."""
    budget = cfg.budget
    rng = np.random.default_rng([cfg.seed, step, 3])
    rows = scored.to_pylist()
    k = np.zeros(len(rows), dtype=np.int64)
    by_tree: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        by_tree[r["tree_id"]].append(i)
    for t, idx in sorted(by_tree.items()):
        leaves = allocator.tree_leaves(rows[idx[0]]["bare"], budget)
        if leaves <= 0:
            continue
        if len(idx) == 1 and rows[idx[0]]["depth"] == 0:  # root fallback of score_prefixes
            k[idx[0]] = leaves
            continue
        prefixes = PrefixSet(predicted=np.asarray([rows[i]["predicted_v"] for i in idx]),
                             observed=np.asarray([rows[i]["observed"] for i in idx]),
                             correlation=np.asarray([rows[i]["correlation"] for i in idx]),
                             seen=np.asarray([rows[i]["seen"] for i in idx], dtype=np.int64))
        k[idx] = allocator.allocate_prefixes(prefixes, leaves, rng)
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
