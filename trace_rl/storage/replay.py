"""The stored trees of a run as ``trace_core.replay`` input, and a replay of several allocators
over them (``trace replay``). Reads the published store on one read-only connection."""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from trace_core.allocators import Allocator, Budget
from trace_core.replay import Environment, Replay, StepInput, replay_run
from trace_core.tree import TreeBatch
from trace_rl.storage.store import TreeStore


class ReplayError(ValueError):
    """A run that cannot be replayed (unknown, or no stored trees): one line naming it."""


def stored_config(store: TreeStore, run_id: str) -> dict[str, Any]:
    """The run's config as stored in ``runs.config_json``."""
    with store.snapshot() as con:
        row = con.execute("SELECT config_json FROM runs WHERE run_id = ?", [run_id]).fetchone()
        if row is None:
            known = [r[0] for r in con.execute("SELECT run_id FROM runs ORDER BY created_at")
                     .fetchall()][-5:]
            raise ReplayError(f"run {run_id!r} is not in {store.path} (runs: {', '.join(known)})")
    return json.loads(row[0] or "{}")


def stored_steps(store: TreeStore, run_id: str) -> tuple[list[int], list[StepInput]]:
    """Per step with trees (in order): its trees as one ``TreeBatch`` and per row the score its
    allocation had (``trace_core.replay.StepInput``): a root's Stage 1 score (its
    ``predicted_v``, else its level-0 allocation row's), a prefix's Stage 2 score (its level >= 1
    allocation row's). A tree without a bare rollout or a Stage 1 score is left out; the
    step's filtered candidates (k = 0 allocation rows with a score and no tree) follow as trees
    of their root alone."""
    with store.snapshot() as con:
        nodes = con.sql(
            "SELECT step, tree_id, parent_index, depth, level, is_leaf, reward, predicted_v, "
            "node_id FROM nodes WHERE run_id = $r ORDER BY step, tree_id, local_index",
            params={"r": run_id}).to_arrow_table()
        scores = dict(con.execute("SELECT node_id, predicted_v FROM allocations WHERE run_id = ? "
                                  "AND level >= 1", [run_id]).fetchall())
        roots = dict(con.execute("SELECT node_id, predicted_v FROM allocations WHERE run_id = ? "
                                 "AND level = 0", [run_id]).fetchall())
        unsampled = con.execute(  # filtered candidates: a Stage 1 score and no tree
            "SELECT step, predicted_v FROM allocations a WHERE run_id = ? AND level = 0 AND "
            "k = 0 AND predicted_v IS NOT NULL AND NOT EXISTS (SELECT 1 FROM nodes n WHERE "
            "n.node_id = a.node_id) ORDER BY step, node_id", [run_id]).fetchall()
    col = {name: nodes.column(name).to_numpy(zero_copy_only=False) for name in
           ("step", "tree_id", "parent_index", "depth", "level")}
    leaf = nodes.column("is_leaf").to_numpy(zero_copy_only=False).astype(bool)
    reward = np.where(leaf, nodes.column("reward").cast("double").fill_null(np.nan).to_numpy(), np.nan)
    own = nodes.column("predicted_v").to_pylist()
    score = np.array([(v if v is not None else roots.get(n)) if d == 0 else scores.get(n)
                      for v, n, d in zip(own, nodes.column("node_id").to_pylist(), col["depth"])],
                     dtype=np.float64)  # None -> NaN
    order, out = [], []
    for step in np.unique(col["step"]):
        at = np.flatnonzero(col["step"] == step)
        first = np.flatnonzero(np.r_[True, np.diff(col["tree_id"][at]) != 0])
        trees = TreeBatch(col["parent_index"][at], reward[at], np.r_[first, len(at)],
                          col["depth"][at], col["level"][at])
        bare = trees.is_leaf & (trees.level == 0) & (trees.depth > 0)
        keep = np.flatnonzero((np.bincount(trees.tree_of_row[bare], minlength=len(trees)) > 0)
                              & np.isfinite(score[at][trees.roots]))
        if not len(keep):
            continue
        kept = trees.select(keep)
        extra = [v for s, v in unsampled if s == step]
        order.append(int(step))
        out.append((kept.with_new_trees(len(extra)),
                    np.r_[score[at][trees.rows_of(keep)], np.asarray(extra, np.float64)]))
    if not out:
        raise ReplayError(f"run {run_id!r} has no stored trees in {store.path}")
    return order, out


def replay_stored(store: TreeStore, run_id: str, allocators: Sequence[Allocator], budget: Budget,
                  replicates: int = 100, seed: int = 0
                  ) -> tuple[list[int], Environment, list[Replay]]:
    """Every allocator over every stored step of the run at ``budget`` (``trace_core.replay``)."""
    steps, trees = stored_steps(store, run_id)
    env, replays = replay_run(trees, allocators, budget, seed=seed, replicates=replicates)
    return steps, env, replays
