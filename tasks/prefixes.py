"""Prefix phases (Stage 2): score every non-leaf prefix on the bare rollouts, choose K per prefix."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa
from prefect import task

from tasks import runtime
from trace_core.tree import NO_PARENT
from trace_core.allocators import PrefixSet
from trace_rl.config import TrainConfig
from trace_rl.rollout.treeio import history_text, turns_from_rows


@task(name="score-prefixes", cache_policy=runtime.PHASE_KEY)
def score_prefixes(cfg: TrainConfig, workdir: str, run_id: str, step: int) -> pa.Table:
    """p = V~(H_ijt) and the observed outcome r_ij for every non-leaf turn node (depth >= 1) of
    the step's bare rollouts; each such node lies on exactly one bare rollout."""
    rows = runtime.store(workdir).read_step(run_id, step).to_pylist()
    by_tree: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_tree[r["tree_id"]].append(r)
    out: dict[str, list] = defaultdict(list)
    histories = []
    for t, tree in sorted(by_tree.items()):
        tree.sort(key=lambda r: r["local_index"])
        question = tree[0]["text"]
        before = len(histories)
        for r in tree:
            if r["depth"] == 0 or r["is_leaf"] or r["level"] != 0:
                continue
            path, i = [], r["local_index"]
            while tree[i]["parent_index"] != NO_PARENT:
                path.append(tree[i])
                i = tree[i]["parent_index"]
            leaf = r
            while not leaf["is_leaf"]:  # follow the bare rollout down to its outcome
                leaf = next(c for c in tree if c["parent_index"] == leaf["local_index"])
            histories.append(history_text(question, turns_from_rows(path[::-1])))
            for k, v in (("tree_id", t), ("local_index", r["local_index"]), ("depth", r["depth"]),
                         ("item_id", r["item_id"]), ("observed", float(leaf["reward"])),
                         ("bare", tree[0]["allocated_k"])):
                out[k].append(v)
        if len(histories) == before:
            # Every bare rollout ended on its first turn: nothing to branch from, so the tree's
            # continuation budget goes to more rollouts from the root (the ledger stays equal).
            histories.append(history_text(question, []))
            for k, v in (("tree_id", t), ("local_index", 0), ("depth", 0),
                         ("item_id", tree[0]["item_id"]), ("observed", float("nan")),
                         ("bare", tree[0]["allocated_k"])):
                out[k].append(v)
    predictor = runtime.load_predictor(cfg, workdir, run_id, step - 1)
    p = predictor.predict(histories) if histories else np.zeros(0)
    return pa.table({**{k: out[k] for k in ("tree_id", "local_index", "depth", "item_id", "observed", "bare")},
                     "predicted_v": pa.array(np.asarray(p, dtype=np.float64))}) if histories else pa.table(
        {"tree_id": pa.array([], pa.int64()), "local_index": pa.array([], pa.int64()),
         "depth": pa.array([], pa.int64()), "item_id": pa.array([], pa.string()),
         "observed": pa.array([], pa.float64()), "bare": pa.array([], pa.int64()),
         "predicted_v": pa.array([], pa.float64())})


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
