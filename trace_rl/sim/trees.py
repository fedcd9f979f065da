"""Rollout trees of the simulator and the predictors that score their prefixes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trace_rl.sim.model import HOMONYM, REPLAY_STEPS, Dynamics, Items, sample
from trace_core.tree import TreeBatch

# ----------------------------------------------------------------------------- trees


@dataclass
class SimStep:
    """One step's rollout trees (a ``TreeBatch``) with each node's chain state, the turn that led
    to it, the first matches taken on its path and the prediction the allocation used for it
    (NaN where none), and per tree its train item and counts."""

    trees: TreeBatch = field(default_factory=TreeBatch.empty)
    state: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int64))
    typ: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # -1 at roots
    action: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    firsts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    predicted: np.ndarray = field(default_factory=lambda: np.zeros(0))
    item: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [T] train pool index
    root_successes: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [T] from the root
    root_rollouts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [T]
    turns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [T] generated
    bare_turns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [T] of which bare

    def new_tree(self, item: int, predicted: float) -> int:
        """Open a tree for train item ``item`` (its root's prediction ``predicted``); its position."""
        self.trees = self.trees.with_new_trees(1)
        self.state = np.r_[self.state, np.zeros((1, 4), np.int64)]
        self.typ, self.action = np.r_[self.typ, -1], np.r_[self.action, -1]
        self.firsts, self.predicted = np.r_[self.firsts, 0], np.r_[self.predicted, predicted]
        self.item = np.r_[self.item, item]
        self.root_successes, self.root_rollouts = np.r_[self.root_successes, 0.0], np.r_[self.root_rollouts, 0]
        self.turns, self.bare_turns = np.r_[self.turns, 0], np.r_[self.bare_turns, 0]
        return len(self.item) - 1

    @property
    def bare_leaves(self) -> np.ndarray:
        """int64 [T]: bare rollouts per tree."""
        return self.trees.bare_outcomes()[0]


def roll_into(step: SimStep, where: list[tuple[int, bool]], dyn: Dynamics, theta: np.ndarray,
              rng: np.random.Generator) -> None:
    """Sample one rollout per (row, bare) in ``where``, in one batch, and hang each below its row
    (a tree's rollouts in the order given)."""
    if not where:
        return
    at = np.array([n for n, _ in where], np.int64)
    bare = np.array([b for _, b in where])
    tree = step.trees.tree_of_row[at]
    root = step.trees.depth[at] == 0  # rollouts from the root: unbiased draws of its value
    batch = sample(dyn, theta, step.item[tree], step.state[at], rng)
    length = batch.length.astype(np.int64)
    reward = batch.reward.astype(np.float64)
    step.trees, growth = step.trees.grow(at, length, reward, np.where(bare, 0, 1))
    on = np.arange(batch.state.shape[1])[None, :] < length[:, None]  # [C, K] the chains' turns
    typ, action = batch.typ[on], batch.action[on]
    first = np.where(on, (batch.typ == HOMONYM) & (batch.action == 1), 0).cumsum(axis=1)[on]
    step.state = growth.place(step.state, batch.state[on].astype(np.int64))
    step.typ, step.action = growth.place(step.typ, typ), growth.place(step.action, action)
    step.firsts = growth.place(step.firsts, np.repeat(step.firsts[at], length) + first)
    step.predicted = growth.place(step.predicted, np.full(int(length.sum()), np.nan))
    t = len(step.item)
    step.turns = step.turns + np.bincount(tree, weights=length, minlength=t).astype(np.int64)
    step.bare_turns = step.bare_turns + np.bincount(tree, weights=length * bare,
                                                    minlength=t).astype(np.int64)
    step.root_successes = step.root_successes + np.bincount(tree, weights=reward * root,
                                                            minlength=t)
    step.root_rollouts = step.root_rollouts + np.bincount(tree, weights=root,
                                                          minlength=t).astype(np.int64)


# ----------------------------------------------------------------------------- predictors


def features(items: Items, item: np.ndarray, state: np.ndarray, firsts: np.ndarray) -> np.ndarray:
    """[B, F] visible features of histories: the item's shown cues and hop count, and the
    prefix's progress (turn, hops found, retry flag, first matches taken, at the answer)."""
    hops = items.hops[item]
    j, s, t = state[:, 0], state[:, 1], state[:, 3]
    onehot = (hops[:, None] == np.arange(1, 9)[None, :]).astype(np.float64)  # [B, 8]
    cues = items.cues[item].astype(np.float64)  # [B, 2]
    cols = [np.ones(len(item)), cues[:, 0], cues[:, 1], t / 4.0, (hops - j) / 2.0, s,
            firsts.astype(np.float64), (j >= hops).astype(np.float64), (items.cap[item] - t) / 4.0,
            (t == 0).astype(np.float64)]
    return np.column_stack([onehot] + cols)


class LogisticPredictor:
    """Weighted logistic regression on ``features``, fit by Newton steps on a replay window."""

    def __init__(self, ridge: float = 1e-2, newton_steps: int = 4):
        self.w: np.ndarray | None = None
        self.ridge = ridge
        self.newton_steps = newton_steps
        self.replay: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def predict(self, x: np.ndarray) -> np.ndarray:
        if self.w is None:
            return np.full(len(x), 0.5)
        return 1.0 / (1.0 + np.exp(-np.clip(x @ self.w, -30, 30)))

    def fit(self, x: np.ndarray, y: np.ndarray, weight: np.ndarray) -> None:
        self.replay = (self.replay + [(x, y, weight)])[-REPLAY_STEPS:]
        xs = np.concatenate([r[0] for r in self.replay])
        ys = np.concatenate([r[1] for r in self.replay])
        ws = np.concatenate([r[2] for r in self.replay])
        ws = ws / ws.mean()
        w = np.zeros(xs.shape[1]) if self.w is None else self.w
        for _ in range(self.newton_steps):
            p = 1.0 / (1.0 + np.exp(-np.clip(xs @ w, -30, 30)))
            g = xs.T @ (ws * (p - ys)) / len(ys) + self.ridge * w
            h = (xs * (ws * p * (1 - p))[:, None]).T @ xs / len(ys) + self.ridge * np.eye(len(w))
            w = w - np.linalg.solve(h, g)
        self.w = w
