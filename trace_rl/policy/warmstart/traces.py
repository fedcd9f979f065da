"""The warm start's training data: ReAct traces of a family's training items, written by the trace
builder the family registered (``trace_rl.envs.registry.Warmstart``: gold traces, and recovery
traces that make a bad step first); and the training and measured items, kept apart by id and by
question."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Iterator, Sequence

from trace_rl.envs.base import Action, Environment, TaskItem
from trace_rl.envs.registry import spec

if TYPE_CHECKING:
    from trace_rl.policy.warmstart.config import WarmstartConfig


def build_traces(config: WarmstartConfig, env: Environment, items: Sequence[TaskItem],
                 rng: random.Random) -> Iterator[tuple[TaskItem, list[Action], list[str], str]]:
    """(item, actions, thoughts, kind) per trace: a gold trace per item, and a recovery trace
    for a share ``config.recovery`` of them."""
    recipe = spec(config.family).warmstart
    if recipe is None:
        raise ValueError(f"warmstart: family {config.family!r} registered no trace builder")
    build = recipe.trace
    for item in items:
        for kind in ("gold", "recovery"):
            if kind == "recovery" and rng.random() >= config.recovery:
                continue
            made = build(env, item, rng, kind == "recovery", config)
            if made is not None:
                yield item, made[0], made[1], kind


def load_split_items(config: WarmstartConfig, env: Environment
                     ) -> tuple[list[TaskItem], list[TaskItem]]:
    """(training items, measured items): the ``+``-joined parts of ``train_split`` in order (the
    first ``train_items`` of them), and the first ``eval_items`` of ``eval_split``.
    ``ValueError`` when an item of the measured split is among the training items (by id, and by
    question, as ids alone may repeat across files): traces never come from evaluation items."""
    train: list[TaskItem] = []
    for part in config.train_splits:
        train.extend(env.load(part))
    if config.train_items:
        train = train[:config.train_items]
    held = env.load(config.eval_split) if config.eval_split else []
    ids, questions = {it.id for it in train}, {it.question for it in train}
    shared = [it.id for it in held if it.id in ids or it.question in questions]
    if shared:
        raise ValueError(f"warmstart: {len(shared)} item(s) of eval_split={config.eval_split!r} "
                         f"are in train_split={config.train_split!r} (e.g. {shared[0]!r}); "
                         "traces are never built from evaluation items")
    return train, held[:config.eval_items]
