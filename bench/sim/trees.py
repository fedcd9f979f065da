"""Rollout trees of the simulator and the predictors that score their prefixes."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from bench.sim.model import HOMONYM, REPLAY_STEPS, Batch, Dynamics, Items, sample
from trace_core.allocators import bare_prefixes

# ----------------------------------------------------------------------------- trees


@dataclass
class SimTree:
    """One prompt's rollout tree (node 0 the root; parent < child) with each node's state."""

    item: int  # index into the train pool
    parent: list[int] = field(default_factory=lambda: [-1])
    state: list[tuple[int, int, int, int]] = field(default_factory=lambda: [(0, 0, 0, 0)])
    typ: list[int] = field(default_factory=lambda: [-1])  # the turn that led to the node
    action: list[int] = field(default_factory=lambda: [-1])
    firsts: list[int] = field(default_factory=lambda: [0])  # first matches taken on the path
    level: list[int] = field(default_factory=lambda: [0])  # 0 bare rollouts, 1 continuations
    reward: list[float] = field(default_factory=lambda: [np.nan])
    bare_leaves: list[int] = field(default_factory=list)
    root_successes: float = 0.0  # outcomes of rollouts started at the root (unbiased draws)
    root_rollouts: int = 0
    turns: int = 0  # generated turns
    bare_turns: int = 0  # of which in bare rollouts (from the root)

    def add(self, at: int, batch: Batch, r: int, bare: bool) -> None:
        node = at
        for k in range(int(batch.length[r])):
            self.parent.append(node)
            self.state.append(tuple(int(x) for x in batch.state[r, k]))
            ty, a = int(batch.typ[r, k]), int(batch.action[r, k])
            self.typ.append(ty)
            self.action.append(a)
            self.firsts.append(self.firsts[node] + int(ty == HOMONYM and a == 1))
            self.level.append(0 if bare else 1)
            self.reward.append(np.nan)
            node = len(self.parent) - 1
        self.reward[node] = float(batch.reward[r])
        self.turns += int(batch.length[r])
        if bare:
            self.bare_turns += int(batch.length[r])
            self.bare_leaves.append(node)
        if at == 0:
            self.root_successes += float(batch.reward[r])
            self.root_rollouts += 1

    def prefixes(self, from_root: bool) -> tuple[list[int], np.ndarray]:
        """Stage 2's candidates (``trace_core.allocators.bare_prefixes``)."""
        return bare_prefixes(self.parent, self.reward, self.bare_leaves, from_root)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.parent, np.int64), np.asarray(self.reward, np.float64)


def roll_into(trees: list[SimTree], where: list[tuple[int, int, bool]], dyn: Dynamics,
              theta: np.ndarray, rng: np.random.Generator) -> None:
    """Sample one rollout per (tree index, node, bare) in ``where``, in one batch."""
    if not where:
        return
    item = np.array([trees[k].item for k, _, _ in where])
    start = np.array([trees[k].state[n] for k, n, _ in where], np.int64)
    batch = sample(dyn, theta, item, start, rng)
    for r, (k, node, bare) in enumerate(where):
        trees[k].add(node, batch, r, bare)


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
