"""Advantage estimators over one rollout tree (docs/algorithm.md, "Tree-aware policy update").

Every root-to-leaf path is a training sequence. Each estimator takes one tree as
``(parent [N], leaf_reward [N])`` (see trace_core.tree) and returns a float64 array ``[L, D]``:
L leaves in increasing id order (``Tree.leaves``), D the tree's maximum depth; entry ``[l, d]`` is
the advantage of the turn at depth d + 1 on leaf l's path and NaN where the path is shorter. The
tree is one prompt's group: the root is the prompt, so the flat baseline's group is "all leaves".
``concat_forest`` stacks the per-tree outputs of a batch.

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

from collections.abc import Callable, Sequence

import numpy as np

from trace_core.tree import ROOT, backup, is_leaf, root_to_leaf_paths

EPS = 1e-6
"""Added to std before dividing, so that an all-equal group gives advantage 0, not NaN."""


def _leaf_rows(parent: np.ndarray, leaf_reward: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(paths [L, D+1] node ids padded with -1, reward [L]) after validating the tree."""
    parent = np.asarray(parent, dtype=np.int64)
    leaf_reward = np.asarray(leaf_reward, dtype=np.float64)
    backup(parent, leaf_reward)  # validates; cheap next to the estimators
    if len(parent) < 2:
        raise ValueError("the tree has no turns: a root-only tree has nothing to train on")
    leaves = np.flatnonzero(is_leaf(parent))
    return root_to_leaf_paths(parent), leaf_reward[leaves]


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


def grpo(
    parent: np.ndarray,
    leaf_reward: np.ndarray,
    *,
    scale_by_std: bool = True,
    eps: float = EPS,
) -> np.ndarray:
    """[L, D] flat group-relative advantage over all leaves of the tree (GRPO / Dr. GRPO)."""
    paths, reward = _leaf_rows(parent, leaf_reward)
    one_group = np.zeros(len(reward), dtype=np.int64)
    return _per_turn(paths, _group_norm(reward, one_group, scale_by_std, eps))


def tree_grpo(
    parent: np.ndarray,
    leaf_reward: np.ndarray,
    *,
    scale_by_std: bool = True,
    eps: float = EPS,
) -> np.ndarray:
    """[L, D] Tree-GRPO: intra-tree (same child of the root) + inter-tree (all leaves)."""
    paths, reward = _leaf_rows(parent, leaf_reward)
    intra = _group_norm(reward, paths[:, 1], scale_by_std, eps)  # group = child of the root
    inter = _group_norm(reward, np.zeros(len(reward), dtype=np.int64), scale_by_std, eps)
    return _per_turn(paths, intra + inter)


def treepo(
    parent: np.ndarray,
    leaf_reward: np.ndarray,
    *,
    scale_by_std: bool = False,
    eps: float = EPS,
) -> np.ndarray:
    """[L, D] TreePO: mean over l's branching ancestors (and the root) of r_l - V^(ancestor)."""
    parent = np.asarray(parent, dtype=np.int64)
    paths, reward = _leaf_rows(parent, leaf_reward)
    value, _ = backup(parent, leaf_reward)  # [N] mean leaf reward below each node
    square, _ = backup(parent, np.asarray(leaf_reward, dtype=np.float64) ** 2)  # [N] mean r^2
    std = np.sqrt(np.maximum(square - value**2, 0.0))  # [N] population std of leaves below
    n_children = np.bincount(parent[1:], minlength=len(parent))  # [N]
    depth = (paths >= 0).sum(axis=1) - 1  # [L] each leaf's depth
    proper = np.arange(paths.shape[1] - 1)[None, :] < depth[:, None]  # [L, D] proper ancestors
    node = np.where(proper, paths[:, :-1], ROOT)  # [L, D]
    group = proper & ((n_children[node] >= 2) | (node == ROOT))  # [L, D] sub-group roots
    sub = reward[:, None] - value[node]  # [L, D]
    if scale_by_std:
        sub = sub / (std[node] + eps)
    leaf_advantage = np.where(group, sub, 0.0).sum(axis=1) / group.sum(axis=1)
    return _per_turn(paths, leaf_advantage)


def segment(parent: np.ndarray, leaf_reward: np.ndarray) -> np.ndarray:
    """[L, D] per-turn A(y) = V^(y) - V^(parent(y))."""
    paths, _ = _leaf_rows(parent, leaf_reward)
    value, _ = backup(parent, leaf_reward)
    here, up = paths[:, 1:], paths[:, :-1]  # [L, D] the turn's node and its parent
    return np.where(here >= 0, value[np.maximum(here, 0)] - value[np.maximum(up, 0)], np.nan)


def branch(parent: np.ndarray, leaf_reward: np.ndarray) -> np.ndarray:
    """[L, D] per-turn r_l - V^(nearest branching ancestor of the turn, or the root)."""
    parent = np.asarray(parent, dtype=np.int64)
    paths, reward = _leaf_rows(parent, leaf_reward)
    value, _ = backup(parent, leaf_reward)  # [N]
    n_children = np.bincount(parent[1:], minlength=len(parent))  # [N]
    anchor = np.zeros(len(parent), dtype=np.int64)  # [N] nearest branching node at or above
    for i in range(1, len(parent)):  # parents precede children
        anchor[i] = i if n_children[i] >= 2 else anchor[parent[i]]
    up = paths[:, :-1]  # [L, D] the node each turn starts from
    base = value[anchor[np.maximum(up, 0)]]  # [L, D]
    return np.where(paths[:, 1:] >= 0, reward[:, None] - base, np.nan)


def centred(a: np.ndarray) -> np.ndarray:
    """[L, D]: one tree's per-turn advantages shifted so that the leaves' advantages (each path's
    mean over its turns) sum to zero.

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
    return a - np.nanmean(np.nanmean(a, axis=1))


def per_node(parent: np.ndarray, leaf_reward: np.ndarray, a: np.ndarray) -> np.ndarray:
    """[L, D]: one tree's per-turn advantages ``a`` with each turn's entry divided by n_y, the
    number of leaves under the turn's node y (the paths that share the turn).

    Every root-to-leaf path is a training sequence, so a turn shared by n_y paths is pushed n_y
    times: a prefix continued K times weighs K + 1 sampled turns although it was sampled once,
    and where the allocation chose which prefixes to continue, that weight follows the
    allocation. Divided by n_y, the pushes a turn gets over its paths sum to their mean (for
    ``branch``: V^(y) - V^(b(y)), the turn's own advantage), so every sampled turn counts once.
    Flat groups are unchanged (each turn lies on one path).
    """
    a = np.asarray(a, dtype=np.float64)
    parent = np.asarray(parent, dtype=np.int64)
    _, n = backup(parent, leaf_reward)  # [N] leaves below each node
    turns = root_to_leaf_paths(parent)[:, 1:]  # [L, D] the node of each turn
    if a.shape != turns.shape:
        raise ValueError(f"per_node: advantages of shape {a.shape} do not match the tree's paths {turns.shape}")
    return np.where(turns >= 0, a / n[np.maximum(turns, 0)], np.nan)


def concat_forest(per_tree: Sequence[np.ndarray]) -> np.ndarray:
    """[sum L, max D]: per-tree estimator outputs stacked, shorter trees padded with NaN."""
    if not per_tree:
        return np.zeros((0, 0))
    width = max(a.shape[1] for a in per_tree)
    padded = [
        np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=np.nan) for a in per_tree
    ]
    return np.concatenate(padded, axis=0)


Estimator = Callable[[np.ndarray, np.ndarray], np.ndarray]

ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo,
    "tree_grpo": tree_grpo,
    "treepo": treepo,
    "segment": segment,
    "branch": branch,
}
"""Name -> estimator (default keyword arguments); the config edge picks one by name."""
