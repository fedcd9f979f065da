"""Episodes <-> rows of the ``nodes`` table, one rollout tree per root prompt.

A tree's nodes get local indices in the order they are created: the root (the prompt) is 0, the
bare rollouts' turns follow at level 0, continuations' turns are appended at level 1. Because
``parent[i] < i`` holds by construction, the local indices are exactly the struct-of-arrays index
of ``trace_core.tree`` and a table of a tree maps one-to-one onto its arrays.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

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
