"""The rollout tree as a struct of arrays, and the backup of docs/algorithm.md.

A node is a turn-level prefix history H: node 0 is the root (the prompt, depth 0) and a node at
depth t holds t turns. Arrays are indexed by node id with ``parent[i] < i`` (mctx's ``Tree``
layout), so a reverse loop over ids visits children before parents and is a bottom-up pass. The
arrays map one-to-one onto the storage layer's nodes table.

Backup (TRACE, docs/algorithm.md, "Backup targets")::

    V^(leaf) = r,        V^(y) = sum_{c child of y} n_c V^(c) / n_y,

with n_y the number of leaves below y, i.e. V^(y) is the success rate of the leaves under y.
No departure from the paper.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

ROOT = 0
NO_PARENT = -1


@dataclass(frozen=True)
class Tree:
    """One rollout tree. All arrays have length ``num_nodes``."""

    parent: np.ndarray
    """int64 [N]: parent node id; ``NO_PARENT`` at the root, ``parent[i] < i`` elsewhere."""
    depth: np.ndarray
    """int64 [N]: number of turns in the node's history (0 at the root)."""
    leaf_reward: np.ndarray
    """float64 [N]: the outcome reward at leaves, NaN at internal nodes."""

    def __post_init__(self) -> None:
        parent = np.asarray(self.parent, dtype=np.int64)
        depth = np.asarray(self.depth, dtype=np.int64)
        reward = np.asarray(self.leaf_reward, dtype=np.float64)
        validate(parent, reward)
        if depth.shape != parent.shape:
            raise ValueError(f"depth has shape {depth.shape}, parent has {parent.shape}")
        expected = np.zeros_like(depth)
        for i in range(1, len(parent)):
            expected[i] = expected[parent[i]] + 1
        if not np.array_equal(depth, expected):
            bad = int(np.flatnonzero(depth != expected)[0])
            raise ValueError(
                f"depth[{bad}] = {depth[bad]} but its parent chain gives {expected[bad]}"
            )
        object.__setattr__(self, "parent", parent)
        object.__setattr__(self, "depth", depth)
        object.__setattr__(self, "leaf_reward", reward)

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    @property
    def is_leaf(self) -> np.ndarray:
        """bool [N]: nodes without children."""
        return is_leaf(self.parent)

    @property
    def leaves(self) -> np.ndarray:
        """int64 [L]: leaf ids in increasing order (the row order of every estimator's output)."""
        return np.flatnonzero(self.is_leaf)

    def children(self, i: int) -> np.ndarray:
        """int64: ids of the children of node ``i``, increasing."""
        return np.flatnonzero(self.parent == i)

    def path(self, i: int) -> list[int]:
        """Node ids from the root down to node ``i`` (both included)."""
        out = [int(i)]
        while self.parent[out[-1]] != NO_PARENT:
            out.append(int(self.parent[out[-1]]))
        return out[::-1]

    @classmethod
    def from_paths(
        cls, paths: Sequence[Sequence[Hashable]], rewards: Sequence[float]
    ) -> Tree:
        """Build a tree from turn-key paths; equal key prefixes become shared nodes.

        ``paths[k]`` lists the keys of the turns of trajectory k from the root (root excluded); its
        last node is a leaf with reward ``rewards[k]``. Keys identify turns, so two trajectories
        that share a prefix must repeat the same keys for it. Nodes are numbered in first-seen
        order, hence ``parent[i] < i``.
        """
        if len(paths) != len(rewards):
            raise ValueError(f"got {len(paths)} paths but {len(rewards)} rewards")
        ids: dict[tuple[Hashable, ...], int] = {(): ROOT}
        parent, depth, reward = [NO_PARENT], [0], [np.nan]
        for k, (keys, r) in enumerate(zip(paths, rewards)):
            if len(keys) == 0:
                raise ValueError(f"paths[{k}] is empty: a trajectory has at least one turn")
            prefix: tuple[Hashable, ...] = ()
            for key in keys:
                up = ids[prefix]
                prefix = prefix + (key,)
                if prefix not in ids:
                    ids[prefix] = len(parent)
                    parent.append(up)
                    depth.append(len(prefix))
                    reward.append(np.nan)
            leaf = ids[prefix]
            if not np.isnan(reward[leaf]):
                raise ValueError(
                    f"paths[{k}] ends on a node that is already a leaf of another path"
                )
            reward[leaf] = float(r)
        return cls(np.array(parent), np.array(depth), np.array(reward))


def extend(tree: Tree, parent_node: int, n_new: int, reward: float) -> tuple[Tree, int]:
    """Append a continuation of ``n_new`` turns below ``parent_node``; return (tree, leaf id).

    The continuation is a fresh chain (it shares nothing with existing children), as Stage 2's
    continuations sample new turns from a stored prefix. ``parent_node`` must be internal: a
    leaf is a finished trajectory and cannot be continued.
    """
    if not 0 <= parent_node < tree.num_nodes:
        raise ValueError(f"parent_node {parent_node} is not a node of a {tree.num_nodes}-node tree")
    if n_new < 1:
        raise ValueError(f"n_new must be >= 1, got {n_new}")
    if not np.isnan(tree.leaf_reward[parent_node]):
        raise ValueError(f"parent_node {parent_node} is a leaf (a finished trajectory)")
    start = tree.num_nodes
    new_parent = np.concatenate([[parent_node], np.arange(start, start + n_new - 1)])  # [n_new]
    new_depth = tree.depth[parent_node] + 1 + np.arange(n_new)  # [n_new]
    new_reward = np.full(n_new, np.nan)
    new_reward[-1] = reward
    grown = Tree(
        np.concatenate([tree.parent, new_parent]),
        np.concatenate([tree.depth, new_depth]),
        np.concatenate([tree.leaf_reward, new_reward]),
    )
    return grown, start + n_new - 1


def is_leaf(parent: np.ndarray) -> np.ndarray:
    """bool [N]: True where no node names this one as parent."""
    parent = np.asarray(parent)
    has_child = np.zeros(len(parent), dtype=bool)
    has_child[parent[parent != NO_PARENT]] = True
    return ~has_child


def validate(parent: np.ndarray, leaf_reward: np.ndarray) -> None:
    """Raise ValueError unless (parent, leaf_reward) is a well-formed rollout tree."""
    parent = np.asarray(parent)
    leaf_reward = np.asarray(leaf_reward, dtype=np.float64)
    if parent.ndim != 1 or len(parent) == 0:
        raise ValueError(f"parent must be a non-empty 1-D array, got shape {parent.shape}")
    if leaf_reward.shape != parent.shape:
        raise ValueError(f"leaf_reward has shape {leaf_reward.shape}, parent has {parent.shape}")
    if parent[ROOT] != NO_PARENT:
        raise ValueError(f"parent[0] must be NO_PARENT ({NO_PARENT}), got {parent[ROOT]}")
    ids = np.arange(len(parent))
    bad = np.flatnonzero((parent[1:] < 0) | (parent[1:] >= ids[1:])) + 1
    if len(bad):
        raise ValueError(f"parent[{bad[0]}] = {parent[bad[0]]} breaks 0 <= parent[i] < i")
    leaf = is_leaf(parent)
    has_reward = ~np.isnan(leaf_reward)
    bad = np.flatnonzero(has_reward & ~leaf)
    if len(bad):
        raise ValueError(f"node {bad[0]} has a reward but also has children")
    bad = np.flatnonzero(leaf & ~has_reward)
    if len(bad):
        raise ValueError(f"node {bad[0]} has no children but its leaf_reward is NaN")
    bad = np.flatnonzero(has_reward & ((leaf_reward < 0) | (leaf_reward > 1)))
    if len(bad):
        raise ValueError(f"leaf_reward[{bad[0]}] = {leaf_reward[bad[0]]} is outside [0, 1]")


def backup(parent: np.ndarray, leaf_reward: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (value [N] float64, n_leaves [N] int64): V^ and leaf counts of docs/algorithm.md.

    A reverse pass over ids accumulates each node's reward sum and leaf count into its parent
    (children have larger ids than parents), then V^ = reward sum / leaf count.
    """
    parent = np.asarray(parent, dtype=np.int64)
    leaf_reward = np.asarray(leaf_reward, dtype=np.float64)
    validate(parent, leaf_reward)
    leaf = ~np.isnan(leaf_reward)
    total = np.where(leaf, leaf_reward, 0.0)  # [N] reward summed over the leaves below
    count = leaf.astype(np.int64)  # [N] leaves below
    # One node per depth level at a time would vectorise further; the plain reverse loop is
    # already O(N) and trees here hold at most a few thousand nodes.
    for i in range(len(parent) - 1, 0, -1):
        total[parent[i]] += total[i]
        count[parent[i]] += count[i]
    return total / count, count


def root_to_leaf_paths(parent: np.ndarray) -> np.ndarray:
    """int64 [L, D_max + 1]: node ids on each leaf's path (root first), padded with -1.

    Rows follow increasing leaf id; column d holds the node at depth d.
    """
    parent = np.asarray(parent, dtype=np.int64)
    depth = depths(parent)
    leaves = np.flatnonzero(is_leaf(parent))
    out = np.full((len(leaves), int(depth[leaves].max()) + 1), -1, dtype=np.int64)
    node = leaves.copy()  # [L] walks up one level per iteration
    for d in range(out.shape[1] - 1, -1, -1):
        here = depth[leaves] >= d
        out[here, d] = node[here]
        node = np.where(here, parent[node], node)  # the root steps to NO_PARENT, never read again
    return out


def leaf_below(parent: np.ndarray) -> np.ndarray:
    """int64 [N]: per node, the leaf reached by always stepping to the first (lowest-id) child;
    a leaf maps to itself. On a chain (a bare rollout below its root, a continuation below its
    branch point) that is the chain's one leaf, found from the parent array in one pass per depth
    level instead of a search for children.
    """
    parent = np.asarray(parent, dtype=np.int64)
    depth = depths(parent)
    out = np.arange(len(parent), dtype=np.int64)
    for d in range(int(depth.max(initial=0)), 0, -1):
        nodes = np.flatnonzero(depth == d)[::-1]  # lowest id written last: the first child wins
        out[parent[nodes]] = out[nodes]
    return out


def depths(parent: np.ndarray) -> np.ndarray:
    """int64 [N]: each node's depth from the parent array (``parent[i] < i``, one forward pass)."""
    parent = np.asarray(parent, dtype=np.int64)
    depth = np.zeros(len(parent), dtype=np.int64)
    for i in range(1, len(parent)):
        depth[i] = depth[parent[i]] + 1
    return depth
