"""Prefix phases (Stage 2): score every non-leaf prefix on the bare rollouts, choose K per prefix."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa
from prefect import task

from tasks import runtime
from trace_core.allocators import PrefixSet
from trace_rl.config import TrainConfig
from trace_rl.rollout.treeio import group_trees, node_history


@task(name="score-prefixes", cache_policy=runtime.PHASE_KEY)
def score_prefixes(cfg: TrainConfig, workdir: str, run_id: str, step: int) -> pa.Table:
    """p = V~(H_ijt) and the observed outcome r_ij for every non-leaf turn node (depth >= 1) of
    the step's bare rollouts; each such node lies on exactly one bare rollout."""
    trees = group_trees(runtime.store(workdir).read_step(run_id, step).to_pylist())
    out: dict[str, list] = defaultdict(list)
    histories = []
    for t, tree in trees.items():
        before = len(histories)
        for r in tree:
            if r["depth"] == 0 or r["is_leaf"] or r["level"] != 0:
                continue
            leaf = r
            while not leaf["is_leaf"]:  # follow the bare rollout down to its outcome
                leaf = next(c for c in tree if c["parent_index"] == leaf["local_index"])
            histories.append(node_history(tree, r["local_index"]))
            for k, v in (("tree_id", t), ("local_index", r["local_index"]), ("depth", r["depth"]),
                         ("item_id", r["item_id"]), ("observed", float(leaf["reward"])),
                         ("bare", tree[0]["allocated_k"])):
                out[k].append(v)
        if len(histories) == before:
            # Every bare rollout ended on its first turn: nothing to branch from, so the tree's
            # continuation budget goes to more rollouts from the root (the ledger stays equal).
            histories.append(node_history(tree, 0))
            for k, v in (("tree_id", t), ("local_index", 0), ("depth", 0),
                         ("item_id", tree[0]["item_id"]), ("observed", float("nan")),
                         ("bare", tree[0]["allocated_k"])):
                out[k].append(v)
    predictor = runtime.load_predictor(cfg, workdir, run_id, step - 1)
    p = predictor.predict(histories) if histories else np.zeros(0)
    return pa.table({"tree_id": pa.array(out["tree_id"], pa.int64()),
                     "local_index": pa.array(out["local_index"], pa.int64()),
                     "depth": pa.array(out["depth"], pa.int64()),
                     "item_id": pa.array(out["item_id"], pa.string()),
                     "observed": pa.array(out["observed"], pa.float64()),
                     "bare": pa.array(out["bare"], pa.int64()),
                     "predicted_v": pa.array(np.asarray(p, dtype=np.float64))})


@task(name="allocate-prefixes", cache_policy=runtime.PHASE_KEY)
def allocate_prefixes(cfg: TrainConfig, run_id: str, step: int, scored: pa.Table) -> pa.Table:
    """K per prefix, tree by tree (no cross-prompt waiting): budget m_i * N for tree i."""
    allocator = runtime.allocator_for(cfg)
    budget = runtime.budget_for(cfg)
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
        if rows[idx[0]]["depth"] == 0:  # root fallback of score_prefixes
            k[idx[0]] = leaves
            continue
        prefixes = PrefixSet(predicted=np.asarray([rows[i]["predicted_v"] for i in idx]),
                             observed=np.asarray([rows[i]["observed"] for i in idx]))
        k[idx] = allocator.allocate_prefixes(prefixes, leaves, rng)
    return scored.append_column("k", pa.array(k))
