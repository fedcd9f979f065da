"""BFCL's warm-start traces (``trace_rl.policy.warmstart``): a single-turn item's gold calls."""

from __future__ import annotations

import random

from trace_rl.envs.base import Action, Environment, TaskItem
from trace_rl.envs.bfcl.constants import SINGLE_TURN


def bfcl_trace(env: Environment, item: TaskItem, rng: random.Random, recovery: bool,
               config: object) -> tuple[list[Action], list[str]] | None:
    """A single-turn BFCL item's gold answer (the environment's own expert calls, graded by its
    AST checker when the trace is rendered), with an empty thought. None for a multi-turn item
    (its traces run to thousands of tokens) and for ``recovery``: a single-turn item has one
    turn, so there is no bad step to recover from. Thoughts do not apply."""
    if recovery or item.meta.get("category") not in SINGLE_TURN:
        return None
    actions = list(env.expert_actions(item))
    return actions, [""] * len(actions)
