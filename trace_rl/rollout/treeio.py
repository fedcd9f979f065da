"""Episodes <-> rows of the ``nodes`` table, one rollout tree per root prompt.

A tree's nodes get local indices in the order they are created: the root (the prompt) is 0, the
bare rollouts' turns follow at level 0, continuations' turns are appended at level 1. Because
``parent[i] < i`` holds by construction, the local indices are exactly the struct-of-arrays index
of ``trace_core.tree`` and a table of a tree maps one-to-one onto its arrays.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa

from trace_core.tree import NO_PARENT
from trace_rl.rollout.types import Action, Episode, Turn
from trace_rl.storage.schema import NODE_INPUT

@dataclass
class TreeRows:
    """Rows of one tree being built, in ``storage.schema.NODE_INPUT`` form (the store derives
    node ids from ``(run_id, step, tree_id, local_index)``). The root keeps the prompt's token ids
    in ``obs_token_ids``: they are context, never trained on."""

    tree_id: int
    item_id: str
    family: str
    allocator: str
    rows: list[dict[str, Any]]
    first_index: int = 0
    """Local index of the first row added here (continuations append after stored nodes)."""

    @property
    def next_index(self) -> int:
        return self.first_index + len(self.rows)

    def add_root(self, prompt_ids: Sequence[int], question: str, predicted_v: float | None,
                 allocated_k: int) -> int:
        assert self.next_index == 0, "the root is node 0"
        return self._add(NO_PARENT, depth=0, text=question, action=None, observation=None,
                         gen_ids=(), obs_ids=prompt_ids, logprobs=(), tool_called=False,
                         error=False, predicted_v=predicted_v, allocated_k=allocated_k)

    def add_episode(self, start_index: int, start_depth: int, ep: Episode) -> int:
        """Append the episode's new turns (after its replayed prefix) below node ``start_index``;
        return the leaf's local index."""
        parent = start_index
        new_turns = ep.turns[ep.prefix_turns:]
        if not new_turns:
            raise ValueError(f"episode of {ep.item_id} has no new turns below node {start_index}")
        for t, turn in enumerate(new_turns):
            is_last = t == len(new_turns) - 1
            parent = self._add(parent, depth=start_depth + t + 1, text=turn.text,
                               action=turn.action, observation=turn.obs_text, gen_ids=turn.gen_ids,
                               obs_ids=turn.obs_ids, logprobs=turn.gen_logprobs,
                               tool_called=turn.tool_called, error=turn.error, predicted_v=None,
                               allocated_k=0, reward=(float(ep.reward or 0.0) if is_last else None))
        return parent

    def _add(self, parent: int, *, depth: int, text: str, action: Action | None,
             observation: str | None, gen_ids: Sequence[int], obs_ids: Sequence[int],
             logprobs: Sequence[float], tool_called: bool, error: bool, predicted_v: float | None,
             allocated_k: int, reward: float | None = None) -> int:
        index = self.next_index
        self.rows.append(dict(
            tree_id=self.tree_id, local_index=index, parent_index=parent, depth=depth,
            item_id=self.item_id, is_leaf=reward is not None, family=self.family, text=text,
            action_json=json.dumps(action.to_json()) if action is not None else None,
            observation=observation, gen_token_ids=[int(x) for x in gen_ids],
            obs_token_ids=[int(x) for x in obs_ids], gen_logprobs=[float(x) for x in logprobs],
            tool_called=tool_called, error=error, predicted_v=predicted_v,
            allocated_k=allocated_k, reward=reward, value=None, n_leaves=None, advantage=None,
            allocator=self.allocator,
        ))
        return index


def to_table(rows: Iterable[dict[str, Any]]) -> pa.Table:
    schema = pa.schema([(name, typ) for name, (typ, _) in NODE_INPUT.items()])
    return pa.Table.from_pylist(list(rows), schema=schema)


def turns_from_rows(rows: Sequence[dict[str, Any]]) -> list[Turn]:
    """Rebuild the stored turns of a prefix (rows ordered root-first, root excluded)."""
    turns = []
    for r in rows:
        turns.append(Turn(
            gen_ids=list(r["gen_token_ids"]), gen_logprobs=list(r["gen_logprobs"]), text=r["text"],
            action=Action.from_json(json.loads(r["action_json"])), obs_text=r["observation"],
            obs_ids=list(r["obs_token_ids"]), tool_called=bool(r["tool_called"]),
            error=bool(r["error"]),
        ))
    return turns


def history_text(question: str, turns: Sequence[Turn]) -> str:
    """The predictor's view of a prefix: the question, then each turn's text and observation."""
    parts = [f"Q: {question}"]
    for t in turns:
        parts.append(t.text)
        if t.obs_text:
            parts.append(f"Obs: {t.obs_text}")
    return "\n".join(parts)


def parent_array(table: pa.Table) -> np.ndarray:
    """``parent`` of ``trace_core.tree`` for ONE tree's rows ordered by local index."""
    idx = np.asarray(table.column("local_index").to_pylist(), dtype=np.int64)
    if not np.array_equal(idx, np.arange(len(idx))):
        raise ValueError(f"tree {table.column('tree_id')[0]}: rows must be ordered by local_index "
                         "without gaps")
    return np.asarray(table.column("parent_index").to_pylist(), dtype=np.int64)


def group_trees(rows: Iterable[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    """A step's rows as trees: tree id -> rows in local-index order (trace_core's arrays)."""
    trees: dict[int, list[Mapping[str, Any]]] = {}
    for r in rows:
        trees.setdefault(r["tree_id"], []).append(r)
    for tree in trees.values():
        tree.sort(key=lambda r: r["local_index"])
    return dict(sorted(trees.items()))


def prefix_rows(tree: Sequence[Mapping[str, Any]], index: int) -> list[Mapping[str, Any]]:
    """The turn rows from below the root down to node ``index``, root first."""
    path = []
    while tree[index]["parent_index"] != NO_PARENT:
        path.append(tree[index])
        index = tree[index]["parent_index"]
    return path[::-1]


def node_history(tree: Sequence[Mapping[str, Any]], index: int) -> str:
    """The predictor's input for node ``index``: the question and the turns up to it."""
    return history_text(tree[0]["text"], turns_from_rows(prefix_rows(tree, index)))


def predictor_examples(trees: Iterable[Sequence[Mapping[str, Any]]]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(histories, targets V^, weights n) of every backed-up internal node (roots and prefixes):
    what the predictor is fit on."""
    hist, y, w = [], [], []
    for tree in trees:
        for r in tree:
            if r["is_leaf"] or r["value"] is None:
                continue
            hist.append(node_history(tree, r["local_index"]))
            y.append(r["value"])
            w.append(r["n_leaves"])
    return hist, np.asarray(y, dtype=np.float64), np.asarray(w, dtype=np.float64)
