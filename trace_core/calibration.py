"""How far a node's outcomes are from independent coin flips of its prediction, from stored trees.

TRACE's allocation formulas (``trace_core.allocation``) read a prediction v = V~(H) as the success
probability of every rollout from H. A predictor that is right on average but cannot tell nodes
apart (at depth 1 of a one-call task, which numbers went into the call decides the outcome, and a
bag of n-grams cannot check them) predicts ~0.5 for nodes whose true V is near 0 or 1: it is
calibrated, yet two rollouts from one node agree far more often than two coin flips of 0.5. The
allocation then overrates how often continuations flip an observed outcome.

This module measures that as the intra-class correlation rho of outcomes given the prediction:
V ~ Beta(mean v, concentration 1/rho - 1), so that for two rollouts of one node
P(disagree) = 2 v (1 - v) (1 - rho), and for a continuation of a node whose rollout ended in r,
P(continuation != r) = (1 - q)(1 - rho) with q = r v + (1 - r)(1 - v). From a step's trees:

* roots (depth 0): the bare rollouts of a root are exchangeable draws whatever Stage 1 chose (it
  saw only v), so each root with m >= 2 bare rollouts gives its share of disagreeing pairs,
  s (m - s) / C(m, 2), against the expected 2 v (1 - v);
* prefixes (depth >= 1): each continuation leaf of a prefix gives 1[its reward != r] against
  the expected 1 - q. Stage 2 chose the prefix from (v, r) only, and the formula conditions on
  both, so the choice does not bias it.

rho^_d = 1 - sum(observed disagreements) / sum(expected ones) per depth d, clipped to
[0, ``MAX_CORRELATION``]. The estimate is a method of moments, no fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from trace_core.tree import TreeBatch, validate

MAX_CORRELATION = 0.95
"""Upper clip of an estimate: rho -> 1 would make the allocation treat every observed outcome as
certain to repeat."""


@dataclass(frozen=True)
class Term:
    """One node's evidence: its depth, the disagreements seen and those expected at rho = 0, over
    ``units`` draws (a root: 1, its share of disagreeing pairs; a prefix: its continuations)."""

    depth: int
    observed: float
    expected: float
    units: float = 1.0


def tree_terms(parent: np.ndarray, leaf_reward: np.ndarray, level: np.ndarray,
               predicted: np.ndarray) -> list[Term]:
    """``batch_terms`` of one stored tree given as arrays (node 0 the root)."""
    n = len(parent)
    if not (len(leaf_reward) == len(level) == len(predicted) == n):
        raise ValueError("tree_terms: parent, leaf_reward, level and predicted must have one entry "
                         "per node")
    validate(parent, leaf_reward)
    return batch_terms(TreeBatch(parent, leaf_reward, level=level), predicted)


def batch_terms(trees: TreeBatch, predicted: np.ndarray) -> list[Term]:
    """The evidence of every tree of a batch, tree by tree (each tree's root term first, then
    its prefixes' by row), from one pass over all trees.

    ``trees.level``: 0 for nodes of bare rollouts, >= 1 for continuation nodes; ``predicted``
    [R]: the prediction the allocation used for a node (the root's Stage 1 score, a prefix's
    Stage 2 score), NaN where none was made. Leaves need a reward in {0, 1}.
    """
    predicted = np.asarray(predicted, dtype=np.float64)
    if predicted.shape != (trees.num_rows,):
        raise ValueError(f"batch_terms: predicted has shape {predicted.shape}, the trees "
                         f"{trees.num_rows} rows")
    trees.check_rewards()
    reward, leaves = trees.reward, trees.leaves
    bad = leaves[~np.isin(reward[leaves], (0.0, 1.0))]
    if len(bad):
        raise ValueError(f"tree_terms: leaf {bad[0]} has reward {reward[bad[0]]}, not 0 or 1")
    size = len(trees)
    tree, y = trees.tree_of_row[leaves], reward[leaves]  # [L]
    bare = trees.level[leaves] == 0  # [L]
    m = np.bincount(tree[bare], minlength=size)
    s = np.bincount(tree[bare], weights=y[bare], minlength=size)
    v = predicted[trees.roots]
    found: list[tuple[int, Term]] = [
        (int(trees.roots[k]), Term(0, s[k] * (m[k] - s[k]) / (m[k] * (m[k] - 1) / 2),
                                   2.0 * v[k] * (1.0 - v[k])))
        for k in np.flatnonzero(np.isfinite(v) & (m >= 2))]
    n_cont, cont_wins, n_own, own = _below(trees)
    prefix = _scored(trees, predicted) & (n_cont > 0) & (n_own == 1)
    for r in np.flatnonzero(prefix):
        p, q_r = predicted[r], own[r]
        q = q_r * p + (1.0 - q_r) * (1.0 - p)
        flips = n_cont[r] - cont_wins[r] if q_r == 1.0 else cont_wins[r]
        found.append((int(r), Term(int(trees.depth[r]), float(flips), int(n_cont[r]) * (1.0 - q),
                                   float(n_cont[r]))))
    return [t for _, t in sorted(found, key=lambda x: x[0])]


def _below(trees: TreeBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row [R]: the continuation leaves below it and their successes, the bare-rollout
    leaves below it and their successes (a prefix on a bare rollout has one: its outcome)."""
    leaves, rows = trees.leaves, trees.num_rows
    y, bare = trees.reward[leaves], trees.level[leaves] == 0  # [L]
    paths = trees.paths()  # [L, D+1]; leaf l lies below node y iff y is on its path
    on = paths >= 0
    node = paths[on]  # every (leaf, node above it) pair
    which = np.repeat(np.arange(len(leaves)), on.sum(axis=1))  # its leaf
    cont = ~bare[which]
    return (np.bincount(node[cont], minlength=rows),
            np.bincount(node[cont], weights=y[which][cont], minlength=rows),
            np.bincount(node[~cont], minlength=rows),
            np.bincount(node[~cont], weights=y[which][~cont], minlength=rows))


def _scored(trees: TreeBatch, predicted: np.ndarray) -> np.ndarray:
    """bool [R]: prefixes on bare rollouts (depth >= 1) that carry a prediction."""
    return ~trees.is_leaf & (trees.level == 0) & np.isfinite(predicted) & (trees.depth > 0)


@dataclass(frozen=True)
class Correlation:
    """Per-depth estimates; depths with too little evidence fall back to the pooled prefixes
    (depth >= 1), and to 0 (independent outcomes, the paper's formulas) with none."""

    by_depth: dict[int, float] = field(default_factory=dict)
    prefixes: float = 0.0
    evidence: dict[int, int] = field(default_factory=dict)

    @property
    def prefix_evidence(self) -> int:
        """Terms behind the estimates of depth >= 1."""
        return sum(n for d, n in self.evidence.items() if d >= 1)

    def at(self, depth: int) -> float:
        if depth in self.by_depth:
            return self.by_depth[depth]
        return self.prefixes if depth >= 1 else 0.0


def _ratio(terms: list[Term]) -> float:
    expected = sum(t.expected for t in terms)
    if expected <= 0:
        return 0.0
    rho = 1.0 - sum(t.observed for t in terms) / expected
    return float(np.clip(rho, 0.0, MAX_CORRELATION))


def estimate(terms: Iterable[Term], *, min_terms: int = 16) -> Correlation:
    """rho^ per depth with at least ``min_terms`` terms, and pooled over depth >= 1 if those
    reach it."""
    if min_terms < 1:
        raise ValueError(f"min_terms must be >= 1, got {min_terms}")
    grouped: dict[int, list[Term]] = {}
    for t in terms:
        grouped.setdefault(t.depth, []).append(t)
    by_depth = {d: _ratio(ts) for d, ts in grouped.items() if len(ts) >= min_terms}
    pooled = [t for d, ts in grouped.items() if d >= 1 for t in ts]
    prefixes = _ratio(pooled) if len(pooled) >= min_terms else 0.0
    return Correlation(by_depth, prefixes, {d: len(ts) for d, ts in grouped.items()})


def outcome_pairs(parent: np.ndarray, leaf_reward: np.ndarray, level: np.ndarray,
                  predicted: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``batch_pairs`` of one stored tree given as arrays (as in ``tree_terms``)."""
    if not (len(leaf_reward) == len(level) == len(predicted) == len(parent)):
        raise ValueError("outcome_pairs: parent, leaf_reward, level and predicted must have one "
                         "entry per node")
    validate(parent, leaf_reward)
    return batch_pairs(TreeBatch(parent, leaf_reward, level=level), predicted)


def batch_pairs(trees: TreeBatch, predicted: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What a batch of stored trees says of the predictions its allocation used, as (prediction,
    outcome) pairs, tree by tree (``predicted`` as in ``batch_terms``):

    * roots: each root's Stage 1 prediction against each of its bare rollouts' rewards;
    * prefixes: each scored bare-rollout prefix at depth >= 1 (Stage 2's prediction) against the
      reward of the bare rollout it lies on.

    Both are the pairs a ranking metric (AUC) or Brier score of the allocation's inputs reads;
    the continuations are left out (they are what the predictions chose)."""
    predicted = np.asarray(predicted, dtype=np.float64)
    trees.check_rewards()
    leaves = trees.leaves
    root = trees.roots[trees.tree_of_row[leaves]]  # [L] each leaf's root row
    pick = leaves[(trees.level[leaves] == 0) & np.isfinite(predicted[root])]
    _, _, n_own, own = _below(trees)
    scored = np.flatnonzero(_scored(trees, predicted) & (n_own == 1))
    return (predicted[trees.roots[trees.tree_of_row[pick]]], trees.reward[pick],
            predicted[scored], own[scored])
