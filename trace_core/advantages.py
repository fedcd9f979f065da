"""Advantage estimators over one rollout tree (docs/algorithm.md, "trace_core.advantages").

Every root-to-leaf path is a training sequence. Each estimator takes a step's trees as one
``trace_core.tree.TreeBatch`` and returns a float64 array ``[L, D]`` over all of them at once: L
leaves in row order (``TreeBatch.leaves``: tree by tree), D the batch's maximum depth; entry
``[l, d]`` is the advantage of the turn at depth d + 1 on leaf l's path and NaN where the path is
shorter. Each tree is one prompt's group: its root is the prompt, so the flat baseline's group is
"all leaves of the tree". A tree's rows of the output equal the estimator on that tree alone
(padded with NaN to the batch's depth).

Estimators (``mean`` and ``std`` over a set of leaf rewards; std is the population std;
``norm(r; G) = (r - mean_G) / (std_G + eps)``):

* ``grpo``        A_l = norm(r_l; all leaves of the tree), or r_l - mean (Dr. GRPO,
                  ``scale_by_std=False``); every turn of the path gets A_l.
* ``tree_grpo``   Tree-GRPO (Ji et al. 2025): A_l = norm(r_l; leaves of l's own tree)
                  [intra-tree] + norm(r_l; leaves of all trees of the prompt) [inter-tree].
                  Tree-GRPO grows M trees per prompt from M initial chains; here one prompt's
                  tree holds them as the subtrees below the root's children (each bare rollout
                  and its continuations), so intra-tree = the leaves under the same child of the
                  root and inter-tree = all leaves. Every turn of the path gets A_l.
* ``treepo``      TreePO (Li et al. 2025): A_l = mean over the sub-groups of l of
                  (r_l - mean_G) [/ (std_G + eps) with ``scale_by_std``], where the sub-groups are
                  the leaf sets under l's ancestors that branch (>= 2 children), plus the root's.
                  Every turn of the path gets A_l.
* ``segment``     Per-turn A(y) = V^(y) - V^(parent(y)) with V^ from ``trace_core.tree.backup``:
                  how much turn y moved the success rate of its subtree. Turns of one path differ.
* ``branch``      Per-turn A(l, y) = r_l - V^(b(y)), b(y) the nearest node above turn y (its
                  parent or higher) that branches (>= 2 children), or the root: each turn's
                  baseline is the Monte-Carlo value of the last point where the sampled paths
                  diverged before it (a state-dependent baseline). On a flat group it is r_l -
                  mean, like ``treepo``. Summed over the paths through a turn y it gives
                  n_y (V^(y) - V^(b(y))), so the pushes on the children of a branch point sum to
                  zero and a shared prefix is credited with how its subtree did against the
                  branch point above it (``treepo``'s per-leaf average is not zero-sum there).

Which one matches TRACE's description is argued in docs/algorithm.md; the default is chosen by
measurement at the config edge (``ESTIMATORS`` is the registry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from trace_core.tree import TreeBatch

EPS = 1e-6
"""Added to std before dividing, so that an all-equal group gives advantage 0, not NaN."""


def _leaf_rows(trees: TreeBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(paths [L, D+1] rows padded with -1, reward [L], tree [L]) after validating the trees."""
    trees.check_rewards()
    if np.any(trees.sizes < 2):
        raise ValueError("a tree has no turns: a root-only tree has nothing to train on")
    leaves = trees.leaves
    return trees.paths(), trees.reward[leaves], trees.tree_of_row[leaves]


def _per_turn(paths: np.ndarray, leaf_advantage: np.ndarray) -> np.ndarray:
    """[L, D]: the leaf's advantage on every turn of its path, NaN past its end."""
    turns = paths[:, 1:] >= 0  # [L, D]
    return np.where(turns, leaf_advantage[:, None], np.nan)


def _group_norm(
    reward: np.ndarray, group: np.ndarray, scale_by_std: bool, eps: float
) -> np.ndarray:
    """[L]: reward minus its group's mean, optionally over (its group's std + eps)."""
    _, idx = np.unique(group, return_inverse=True)
    count = np.bincount(idx)
    mean = np.bincount(idx, weights=reward) / count
    centred = reward - mean[idx]
    if not scale_by_std:
        return centred
    std = np.sqrt(np.bincount(idx, weights=centred**2) / count)
    return centred / (std[idx] + eps)


def grpo(trees: TreeBatch, *, scale_by_std: bool = True, eps: float = EPS) -> np.ndarray:
    """[L, D] flat group-relative advantage over all leaves of each tree (GRPO / Dr. GRPO)."""
    paths, reward, tree = _leaf_rows(trees)
    return _per_turn(paths, _group_norm(reward, tree, scale_by_std, eps))


def tree_grpo(trees: TreeBatch, *, scale_by_std: bool = True, eps: float = EPS) -> np.ndarray:
    """[L, D] Tree-GRPO: intra-tree (same child of the root) + inter-tree (all leaves)."""
    paths, reward, tree = _leaf_rows(trees)
    intra = _group_norm(reward, paths[:, 1], scale_by_std, eps)  # group = child of the root
    inter = _group_norm(reward, tree, scale_by_std, eps)
    return _per_turn(paths, intra + inter)


def treepo(trees: TreeBatch, *, scale_by_std: bool = False, eps: float = EPS) -> np.ndarray:
    """[L, D] TreePO: mean over l's branching ancestors (and the root) of r_l - V^(ancestor)."""
    paths, reward, tree = _leaf_rows(trees)
    value, _ = trees.backup()  # [R] mean leaf reward below each node
    square, _ = trees.backup(trees.reward**2)  # [R] mean r^2
    std = np.sqrt(np.maximum(square - value**2, 0.0))  # [R] population std of leaves below
    n_children = trees.n_children  # [R]
    depth = (paths >= 0).sum(axis=1) - 1  # [L] each leaf's depth
    proper = np.arange(paths.shape[1] - 1)[None, :] < depth[:, None]  # [L, D] proper ancestors
    node = np.where(proper, paths[:, :-1], trees.roots[tree][:, None])  # [L, D]
    group = proper & ((n_children[node] >= 2) | (trees.depth[node] == 0))  # [L, D] sub-groups
    sub = reward[:, None] - value[node]  # [L, D]
    if scale_by_std:
        sub = sub / (std[node] + eps)
    leaf_advantage = np.where(group, sub, 0.0).sum(axis=1) / group.sum(axis=1)
    return _per_turn(paths, leaf_advantage)


def segment(trees: TreeBatch) -> np.ndarray:
    """[L, D] per-turn A(y) = V^(y) - V^(parent(y))."""
    paths, _, _ = _leaf_rows(trees)
    value, _ = trees.backup()
    here, up = paths[:, 1:], paths[:, :-1]  # [L, D] the turn's node and its parent
    return np.where(here >= 0, value[np.maximum(here, 0)] - value[np.maximum(up, 0)], np.nan)


def branch(trees: TreeBatch, root_value: np.ndarray | None = None) -> np.ndarray:
    """[L, D] per-turn r_l - V^(nearest branching ancestor of the turn, or the root).

    ``root_value`` ([T], one per tree): the baseline where that ancestor is the root, instead of
    the tree's own V^(root) (a value the samples did not make, such as the predictor's V~(prompt)
    or the exact V). Turns above a tree's first branch point are then credited
    n (V^(first branch point) - root_value) together instead of zero: with one bare rollout and
    its continuations, the shared first turns otherwise carry no signal at all."""
    paths, reward, _ = _leaf_rows(trees)
    value, _ = trees.backup()  # [R]
    if root_value is not None:
        root_value = np.asarray(root_value, dtype=np.float64)
        if root_value.shape != (len(trees.roots),) or not np.all(np.isfinite(root_value)):
            raise ValueError(f"branch: root_value must hold one finite value per tree "
                             f"({len(trees.roots)}), got shape {root_value.shape}")
        value = value.copy()
        value[trees.roots] = root_value
    n_children = trees.n_children  # [R]
    anchor = np.arange(trees.num_rows)  # [R] nearest branching node at or above (roots: self)
    for d in range(1, int(trees.depth.max(initial=0)) + 1):  # parents' levels come first
        rows = np.flatnonzero(trees.depth == d)
        anchor[rows] = np.where(n_children[rows] >= 2, rows, anchor[trees.up[rows]])
    up = paths[:, :-1]  # [L, D] the node each turn starts from
    base = value[anchor[np.maximum(up, 0)]]  # [L, D]
    return np.where(paths[:, 1:] >= 0, reward[:, None] - base, np.nan)


def centred(trees: TreeBatch, a: np.ndarray) -> np.ndarray:
    """[L, D]: per-turn advantages ``a`` of ``trees`` shifted, tree by tree, so that each tree's
    leaves' advantages (each path's mean over its turns) sum to zero.

    Tokens every path of a tree shares (the turn format: ``<think>``, the tool-call syntax) then
    get no net push from that tree. ``grpo`` and ``tree_grpo`` are zero-sum already; ``treepo``'s
    average over a varying number of sub-groups per leaf is not (a leaf under a branched prefix
    averages two centred terms, a leaf elsewhere one), and a tree-wide net push on the format
    tokens is what broke the policy in a learning-benchmark run, which is why ``branch``, zero-sum
    at every branch point, is the default estimator.
    """
    a = np.asarray(a, dtype=np.float64)
    if a.size == 0:
        return a
    tree = trees.tree_of_row[trees.leaves]  # [L]
    path_mean = np.nanmean(a, axis=1)  # [L]
    shift = np.bincount(tree, weights=path_mean) / np.bincount(tree)  # [T] (no leaf: not read)
    return a - shift[tree][:, None]


def per_node(trees: TreeBatch, a: np.ndarray) -> np.ndarray:
    """[L, D]: per-turn advantages ``a`` of ``trees`` with each turn's entry divided by n_y,
    the number of leaves under the turn's node y (the paths that share the turn).

    Every root-to-leaf path is a training sequence, so a turn shared by n_y paths is pushed n_y
    times: a prefix continued K times weighs K + 1 sampled turns although it was sampled once,
    and where the allocation chose which prefixes to continue, that weight follows the
    allocation. Divided by n_y, the pushes a turn gets over its paths sum to their mean (for
    ``branch``: V^(y) - V^(b(y)), the turn's own advantage), so every sampled turn counts once.
    Flat groups are unchanged (each turn lies on one path).
    """
    a = np.asarray(a, dtype=np.float64)
    _, n = trees.backup()  # [R] leaves below each node
    turns = trees.paths()[:, 1:]  # [L, D] the node of each turn
    if a.shape != turns.shape:
        raise ValueError(f"per_node: advantages of shape {a.shape} do not match the trees' "
                         f"paths {turns.shape}")
    return np.where(turns >= 0, a / n[np.maximum(turns, 0)], np.nan)


Estimator = Callable[[TreeBatch], np.ndarray]

ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo,
    "tree_grpo": tree_grpo,
    "treepo": treepo,
    "segment": segment,
    "branch": branch,
}
"""Name -> estimator (default keyword arguments); the config edge picks one by name."""


def advantages(trees: TreeBatch, estimator: str, *, centre: bool = False,
               turns_once: bool = False, root_value: np.ndarray | None = None) -> np.ndarray:
    """[L, D] the configured advantages of every path of ``trees``: the estimator, then
    ``centred`` (``centre``) and ``per_node`` (``turns_once``), as the policy update reads them;
    ``root_value``: ``branch``'s baseline at the roots (``branch``)."""
    if root_value is not None:
        if estimator != "branch":
            raise ValueError(f"root_value is a baseline of the branch estimator, not {estimator!r}")
        a = branch(trees, root_value)
    else:
        a = ESTIMATORS[estimator](trees)
    if centre:
        a = centred(trees, a)
    if turns_once:
        a = per_node(trees, a)
    return a


@dataclass(frozen=True)
class PathAdvantages:
    """The policy update's view of a step: every root-to-leaf path of its trees that has a turn,
    as rows of the step's ``TreeBatch``, with the advantage of each of its turns."""

    rows: np.ndarray
    """every path's rows, root first, path after path"""
    ends: np.ndarray
    """[L] where each path's rows end in ``rows``"""
    turn_advantages: np.ndarray
    """every path's turn advantages (one per row after the root), path after path"""
    turn_ends: np.ndarray
    """[L] where each path's advantages end in ``turn_advantages``"""
    nodes: np.ndarray
    """rows that at least one path takes as a turn"""
    node_mean: np.ndarray
    """the mean advantage of each of ``nodes`` over the paths through it"""


def path_advantages(trees: TreeBatch, estimator: str, *, centre: bool = False,
                    turns_once: bool = False) -> PathAdvantages:
    """``advantages`` of the trees of ``trees`` that have a turn (a root alone has nothing to
    train), flattened path by path onto the rows of ``trees``, with each node's mean advantage
    over the paths through it."""
    turned = np.flatnonzero(trees.sizes >= 2)
    mine = trees.select(turned)
    a = advantages(mine, estimator, centre=centre, turns_once=turns_once)  # [L, D]
    paths = mine.paths()  # [L, D+1] rows of ``mine``
    back = trees.rows_of(turned)  # the batch's row of each row of ``mine``
    on = paths >= 0
    turns = on[:, 1:]
    turn_rows = back[paths[:, 1:][turns]]
    node_sum = np.bincount(turn_rows, weights=a[turns], minlength=trees.num_rows)
    node_cnt = np.bincount(turn_rows, minlength=trees.num_rows)
    nodes = np.flatnonzero(node_cnt)
    return PathAdvantages(rows=back[paths[on]], ends=np.cumsum(on.sum(axis=1)),
                          turn_advantages=a[turns], turn_ends=np.cumsum(turns.sum(axis=1)),
                          nodes=nodes, node_mean=node_sum[nodes] / node_cnt[nodes])
