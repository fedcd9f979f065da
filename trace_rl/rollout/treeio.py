"""Episodes <-> the ``nodes`` table, one rollout tree per root prompt, as columns end to end.

A tree's nodes get local indices in the order they are created: the root (the prompt) is 0, the
bare rollouts' turns follow at level 0, continuations' turns are appended at level 1. Because
``parent[i] < i`` holds by construction, a step's rows (ordered by tree, then slot) are exactly
the rows of ``trace_core.tree.TreeBatch``.

Writing: ``LevelBatch`` appends a level's new nodes column by column (``storage.schema.NODE_INPUT``)
and hands the store one Arrow table. Reading: ``StepTrees`` wraps a step's Arrow table (the
store's ``read_step``, ordered by tree and slot) as numpy columns with each tree a contiguous
slice: its tree structure converted once into a ``trace_core.tree.TreeBatch`` (``batch``), which
every tree operation runs on, and the text columns for histories and replayed turns. Neither
turns a node into a Python dict: at a few thousand leaves per step the per-node dicts were the
bookkeeping that dominated a step's overhead.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trace_core.tree import NO_PARENT, TreeBatch
from trace_rl.rollout.types import Action, Episode, Turn
from trace_rl.storage.schema import NODE_INPUT, NODE_INPUT_SCHEMA


class LevelBatch:
    """The new nodes of one tree level, as columns in ``storage.schema.NODE_INPUT`` form (the
    store derives node ids from ``(run_id, step, tree_id, local_index)``). Trees are opened with
    ``open_tree`` (a new tree, or a stored one whose rows continue after ``first_index``); the
    root keeps the prompt's token ids in ``obs_token_ids``: they are context, never trained on."""

    def __init__(self, family: str, allocator: str):
        self.family = family
        self.allocator = allocator
        self.columns: dict[str, list[Any]] = {name: [] for name in NODE_INPUT}
        self._next: dict[int, int] = {}
        self._item: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.columns["tree_id"])

    def open_tree(self, tree_id: int, item_id: str, first_index: int = 0) -> None:
        """Start appending to tree ``tree_id``: its next node gets local index ``first_index``."""
        if tree_id in self._next:
            raise ValueError(f"tree {tree_id} is already open in this batch")
        self._next[tree_id] = first_index
        self._item[tree_id] = item_id

    def add_root(self, tree_id: int, prompt_ids: Sequence[int], question: str,
                 predicted_v: float | None, allocated_k: int) -> int:
        if self._next.get(tree_id) != 0:
            raise ValueError(f"tree {tree_id}: the root is node 0 of a newly opened tree")
        return self._add(tree_id, NO_PARENT, depth=0, text=question, action=None,
                         observation=None, gen_ids=(), obs_ids=prompt_ids, logprobs=(),
                         tool_called=False, error=False, predicted_v=predicted_v,
                         allocated_k=allocated_k)

    def add_episode(self, tree_id: int, start_index: int, start_depth: int, ep: Episode) -> int:
        """Append the episode's new turns (after its replayed prefix) below node ``start_index``
        of tree ``tree_id``; return the leaf's local index."""
        parent = start_index
        new_turns = ep.turns[ep.prefix_turns:]
        if not new_turns:
            raise ValueError(f"episode of {ep.item_id} has no new turns below node {start_index} "
                             f"of tree {tree_id}")
        for t, turn in enumerate(new_turns):
            is_last = t == len(new_turns) - 1
            parent = self._add(tree_id, parent, depth=start_depth + t + 1, text=turn.text,
                               action=turn.action, observation=turn.obs_text,
                               gen_ids=turn.gen_ids, obs_ids=turn.obs_ids,
                               logprobs=turn.gen_logprobs, tool_called=turn.tool_called,
                               error=turn.error, predicted_v=None, allocated_k=0,
                               reward=(float(ep.reward or 0.0) if is_last else None))
        return parent

    def _add(self, tree_id: int, parent: int, *, depth: int, text: str, action: Action | None,
             observation: str | None, gen_ids: Sequence[int], obs_ids: Sequence[int],
             logprobs: Sequence[float], tool_called: bool, error: bool,
             predicted_v: float | None, allocated_k: int, reward: float | None = None) -> int:
        if tree_id not in self._next:
            raise ValueError(f"tree {tree_id} is not open in this batch (call open_tree first)")
        index = self._next[tree_id]
        self._next[tree_id] = index + 1
        values = dict(
            tree_id=tree_id, local_index=index, parent_index=parent, depth=depth,
            item_id=self._item[tree_id], is_leaf=reward is not None, family=self.family,
            text=text, action_json=json.dumps(action.to_json()) if action is not None else None,
            observation=observation, gen_token_ids=[int(x) for x in gen_ids],
            obs_token_ids=[int(x) for x in obs_ids], gen_logprobs=[float(x) for x in logprobs],
            tool_called=tool_called, error=error, predicted_v=predicted_v,
            allocated_k=allocated_k, reward=reward, value=None, n_leaves=None, advantage=None,
            allocator=self.allocator)
        for name, column in self.columns.items():
            column.append(values[name])
        return index

    def table(self) -> pa.Table:
        """The batch as the store's node input, ordered by tree and slot."""
        t = pa.table({name: pa.array(col, NODE_INPUT[name][0])
                      for name, col in self.columns.items()}, schema=NODE_INPUT_SCHEMA)
        return t.sort_by([("tree_id", "ascending"), ("local_index", "ascending")])


def history_text(question: str, turns: Sequence[Turn]) -> str:
    """The predictor's view of a prefix: the question, then each turn's text and observation."""
    return _history(question, [(t.text, t.obs_text) for t in turns])


def _history(question: str, turns: Sequence[tuple[str, str | None]]) -> str:
    parts = [f"Q: {question}"]
    for text, obs in turns:
        parts.append(text)
        if obs:
            parts.append(f"Obs: {obs}")
    return "\n".join(parts)


class StepTrees:
    """A step's stored nodes (``TreeStore.read_step``: ordered by tree, then slot) as columns.

    ``batch`` is the step's trees as trace_core's ``TreeBatch`` (tree ``k``, id ``tree_ids[k]``,
    is rows ``offsets[k]`` to ``offsets[k + 1]``; its local index is the row minus
    ``offsets[k]``); the tree arrays below are the batch's. Text columns are converted once,
    when first used.
    """

    def __init__(self, table: pa.Table):
        self.table = table
        n = table.num_rows
        tree_id = _ints(table, "tree_id")
        local = _ints(table, "local_index")
        starts = np.flatnonzero(np.r_[True, tree_id[1:] != tree_id[:-1]]) if n else np.zeros(0, int)
        self.tree_ids = tree_id[starts]
        """int64 [T]: the trees' ids, increasing."""
        sizes = np.diff(np.r_[starts, n])
        if np.any(np.diff(self.tree_ids) <= 0) or not np.array_equal(
                local, np.arange(n) - np.repeat(starts, sizes)):
            raise ValueError("StepTrees: rows must be ordered by tree_id, then local_index "
                             "without gaps (TreeStore.read_step's order)")
        is_leaf = table.column("is_leaf").to_numpy(zero_copy_only=False).astype(bool)
        self.batch = TreeBatch(
            _ints(table, "parent_index"), np.where(is_leaf, _floats(table, "reward"), np.nan),
            np.r_[starts, n], _ints(table, "depth"),
            _ints(table, "level") if "level" in table.column_names else np.zeros(n, int))
        b = self.batch
        self.offsets, self.tree_of_row, self.parent, self.depth, self.level = (
            b.offsets, b.tree_of_row, b.parent, b.depth, b.level)
        self.is_leaf, self.reward = b.is_leaf, b.reward
        self._lists: dict[str, list[Any]] = {}

    def __len__(self) -> int:
        return len(self.tree_ids)

    def positions(self, tree_ids: np.ndarray) -> np.ndarray:
        """int64: the position k of each of ``tree_ids`` among this step's trees."""
        tree_ids = np.asarray(tree_ids, dtype=np.int64)
        at = np.searchsorted(self.tree_ids, tree_ids)
        found = at < len(self.tree_ids)
        found[found] = self.tree_ids[at[found]] == tree_ids[found]
        if not found.all():
            raise ValueError(f"no stored tree has id {sorted(set(tree_ids[~found].tolist()))} in "
                             f"this step (its trees: {len(self)})")
        return at

    def rows(self, k: int) -> np.ndarray:
        """int64: the rows of tree ``k``, root first."""
        return np.arange(self.offsets[k], self.offsets[k + 1])

    def column(self, name: str) -> list[Any]:
        """A column as a Python list (converted once)."""
        if name not in self._lists:
            self._lists[name] = self.table.column(name).to_pylist()
        return self._lists[name]

    def floats(self, name: str) -> np.ndarray:
        """A numeric column as float64, NaN where null."""
        return _floats(self.table, name)

    def history(self, row: int) -> str:
        """The predictor's input for node ``row``: the question and the turns down to it."""
        path = self.batch.path(row)
        text, obs = self.column("text"), self.column("observation")
        return _history(text[path[0]], [(text[i], obs[i]) for i in path[1:]])

    def turns(self, row: int) -> list[Turn]:
        """The stored turns from below the root down to node ``row``, to replay as a prefix."""
        c = {name: self.column(name) for name in ("gen_token_ids", "gen_logprobs", "text",
                                                  "action_json", "observation", "obs_token_ids",
                                                  "tool_called", "error")}
        return [Turn(gen_ids=list(c["gen_token_ids"][i]), gen_logprobs=list(c["gen_logprobs"][i]),
                     text=c["text"][i], action=Action.from_json(json.loads(c["action_json"][i])),
                     obs_text=c["observation"][i], obs_ids=list(c["obs_token_ids"][i]),
                     tool_called=bool(c["tool_called"][i]), error=bool(c["error"][i]))
                for i in self.batch.path(row)[1:]]

    def allocation_scores(self, scores: pa.Table) -> np.ndarray:
        """float64 [R]: the prediction each node's allocation used, NaN where none: a root's
        Stage 1 score (its ``predicted_v``), a prefix's Stage 2 score (``scores``: node_id,
        predicted_v, the allocations table's level-1 rows)."""
        at = pc.index_in(self.table.column("node_id"), value_set=scores.column("node_id"))
        stage2 = pc.take(scores.column("predicted_v").cast(pa.float64()), at)
        out = stage2.fill_null(np.nan).to_numpy(zero_copy_only=False).astype(np.float64)
        roots = self.offsets[:-1]
        out[self.depth == 0] = self.floats("predicted_v")[roots][self.tree_of_row[self.depth == 0]]
        return out

    def predictor_examples(self, value: np.ndarray | None = None, n_leaves: np.ndarray | None = None
                           ) -> tuple[list[str], np.ndarray, np.ndarray]:
        """(histories, targets V^, weights n) of every backed-up internal node (roots and
        prefixes): what the predictor is fit on. ``value``, ``n_leaves``: the backup's
        (``TreeBatch.backup``), else the stored columns."""
        value = self.floats("value") if value is None else value
        n_leaves = self.floats("n_leaves") if n_leaves is None else n_leaves.astype(np.float64)
        rows = np.flatnonzero(~self.is_leaf & ~np.isnan(value))
        return [self.history(int(r)) for r in rows], value[rows], n_leaves[rows]


def _ints(table: pa.Table, name: str) -> np.ndarray:
    col = table.column(name)
    if col.null_count:
        raise ValueError(f"column {name!r} has {col.null_count} null(s)")
    return col.to_numpy().astype(np.int64)


def _floats(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).cast(pa.float64()).fill_null(np.nan).to_numpy()
