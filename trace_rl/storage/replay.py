"""The stored trees of a run as ``trace_core.replay`` input, and a replay of several allocators
over them (``trace replay``). Reads the published store on one read-only connection."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any, Sequence

from trace_core.allocators import Allocator, Budget
from trace_core.replay import Environment, Replay, StoredPrefix, StoredRollout, StoredTree, replay_run
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


def stored_steps(store: TreeStore, run_id: str) -> tuple[list[int], list[list[StoredTree]]]:
    """Per step with trees (in order): each tree's Stage 1 score, its bare rollouts (level 0)
    with the prefixes on them, their Stage 2 scores and the outcomes of the continuations
    started at each (level >= 1), and the continuations started at the root."""
    with store.snapshot() as con:
        nodes = con.execute(
            "SELECT step, tree_id, local_index, parent_index, depth, level, is_leaf, reward, "
            "predicted_v, node_id FROM nodes WHERE run_id = ? ORDER BY step, tree_id, "
            "local_index", [run_id]).fetchall()
        scores = dict(con.execute("SELECT node_id, predicted_v FROM allocations WHERE run_id = ? "
                                  "AND level >= 1", [run_id]).fetchall())
        roots = dict(con.execute("SELECT node_id, predicted_v FROM allocations WHERE run_id = ? "
                                 "AND level = 0", [run_id]).fetchall())
        unsampled = con.execute(  # filtered candidates: a Stage 1 score and no tree
            "SELECT step, predicted_v FROM allocations a WHERE run_id = ? AND level = 0 AND "
            "k = 0 AND predicted_v IS NOT NULL AND NOT EXISTS (SELECT 1 FROM nodes n WHERE "
            "n.node_id = a.node_id) ORDER BY step, node_id", [run_id]).fetchall()
    by_tree: dict[tuple[int, int], list[tuple]] = defaultdict(list)
    for row in nodes:
        by_tree[row[0], row[1]].append(row)
    steps: dict[int, list[StoredTree]] = defaultdict(list)
    for (step, _), rows in sorted(by_tree.items()):
        tree = _stored_tree(rows, scores, roots)
        if tree is not None:
            steps[step].append(tree)
    for step, v in unsampled:
        if step in steps:
            steps[step].append(StoredTree(predicted=float(v), bare=()))
    if not steps:
        raise ReplayError(f"run {run_id!r} has no stored trees in {store.path}")
    order = sorted(steps)
    return order, [steps[s] for s in order]


def _stored_tree(rows: list[tuple], scores: dict, roots: dict) -> StoredTree | None:
    slot = {r[2]: r for r in rows}
    kids: dict[int, list[int]] = defaultdict(list)
    for r in rows:
        if r[3] >= 0:
            kids[r[3]].append(r[2])
    root = slot.get(0)
    if root is None:
        return None
    v = root[8] if root[8] is not None else roots.get(root[9])

    def outcome(i: int) -> float:  # follow one line of same-level children to its leaf
        node = slot[i]
        while not node[6]:
            nxt = [c for c in kids[node[2]] if slot[c][5] == node[5]]
            if not nxt:
                return math.nan
            node = slot[nxt[0]]
        return float(node[7])

    def continuations(i: int) -> tuple[float, ...]:
        got = [outcome(c) for c in kids[i] if slot[c][5] > slot[i][5]]  # started at i
        return tuple(x for x in got if not math.isnan(x))

    bare = []
    for leaf in (r for r in rows if r[6] and r[5] == 0):
        path, i = [], leaf[3]
        while i > 0:
            path.append(slot[i])
            i = slot[i][3]
        prefixes = tuple(StoredPrefix(depth=n[4], predicted=_score(scores, n[9]),
                                      continuations=continuations(n[2]))
                         for n in reversed(path))
        bare.append(StoredRollout(float(leaf[7]), prefixes))
    if not bare or v is None:
        return None
    return StoredTree(predicted=float(v), bare=tuple(bare), root_continuations=continuations(0))


def _score(scores: dict, node_id: str) -> float:
    p = scores.get(node_id)
    return math.nan if p is None else float(p)


def replay_stored(store: TreeStore, run_id: str, allocators: Sequence[Allocator], budget: Budget,
                  replicates: int = 100, seed: int = 0
                  ) -> tuple[list[int], Environment, list[Replay]]:
    """Every allocator over every stored step of the run at ``budget`` (``trace_core.replay``)."""
    steps, trees = stored_steps(store, run_id)
    env, replays = replay_run(trees, allocators, budget, seed=seed, replicates=replicates)
    return steps, env, replays
