"""The step's random streams: one per (run seed, step, phase), so a phase's draws depend on
nothing but which phase of which step of which run it is (a resumed step redraws the same).

The phase numbers are part of every stored tree: changing one changes the trees a seed grows.
"""

from __future__ import annotations

import threading
from enum import IntEnum

import numpy as np


GLOBAL_TORCH_RNG = threading.RLock()
"""Held while seeding or drawing from torch's global CPU generator (the predictor's init, the
policy trainer's construction): the train flow fits the predictor beside the policy update, and
two threads' seeds and draws interleaved would make a seed's run depend on their timing."""


class Phase(IntEnum):
    """The phases of a step that draw from a numpy generator, with their stream numbers."""

    POOL = 1
    """the candidate pool: which prompts of the train split a step offers"""
    ROOTS = 2
    """Stage 1: bare rollouts per candidate"""
    PREFIXES = 3
    """Stage 2, tree by tree: continuations per prefix"""
    REFILL = 4
    """refill waves of bare rollouts (DAPO)"""
    JOINT = 5
    """Stage 2's joint split of the continuation budget with fresh prompts"""


def phase_rng(seed: int, step: int, phase: Phase) -> np.random.Generator:
    """The generator of ``phase`` in step ``step`` of a run seeded ``seed``."""
    return np.random.default_rng([seed, step, int(phase)])


def rollout_seed(seed: int, step: int, level: int, wave: int = 0) -> int:
    """The engine's sampling seed of one level (and, at level 0, one wave) of a step."""
    return seed * 100_003 + step * 17 + level + 7919 * wave


def oracle_seed(seed: int, step: int, stage: int) -> int:
    """The engine's sampling seed of a step's Monte-Carlo oracle rollouts for Stage 1 or 2
    (``TrainConfig.oracle_rollouts``): a level of their own after the tree's two, so the oracle's
    draws are fixed per (run seed, step, stage) and apart from the rollouts the step keeps."""
    return rollout_seed(seed, step, 1 + stage)


def update_seed(seed: int, step: int) -> int:
    """The torch generator seed of a step's policy update (micro-batch order)."""
    return seed * 7919 + step
