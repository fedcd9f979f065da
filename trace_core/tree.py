"""The rollout trees of a step as one struct of arrays (``TreeBatch``), and the backup of
docs/algorithm.md.

A node is a turn-level prefix history H: each tree's first node is its root (the prompt, depth 0)
and a node at depth t holds t turns. All trees of a step sit in flat arrays, tree k in rows
``offsets[k]`` to ``offsets[k + 1]``; inside a tree a node's local index is its row minus the
tree's offset and ``parent[i] < i`` (local indices, mctx's ``Tree`` layout), so a tree's rows map
one-to-one onto the storage layer's nodes table. Every operation runs on all trees at once, one
numpy pass per depth level, never one Python pass per tree.

Backup (TRACE, docs/algorithm.md, "trace_core.tree")::

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


def _ints(x: object) -> np.ndarray:
    return np.asarray(x, dtype=np.int64).reshape(-1)


def _frozen(*arrays: np.ndarray) -> None:
    for a in arrays:
        a.setflags(write=False)


class TreeBatch:
    """All rollout trees of a step in flat arrays (R rows over T trees).

    Fields (each an array over rows unless named per tree):

    * ``parent`` int64 [R]: the parent's local index in the row's tree, ``NO_PARENT`` at roots;
    * ``reward`` float64 [R]: the outcome at finished leaves, NaN elsewhere;
    * ``offsets`` int64 [T + 1]: the first row of each tree, then R;
    * ``depth`` int64 [R]: turns in the node's history (0 at roots);
    * ``level`` int64 [R]: 0 for the root and the bare rollouts' nodes, >= 1 for continuations';
    * derived: ``tree_of_row`` [R], ``up`` [R] (the parent's row, -1 at roots), ``is_leaf`` [R]
      (no children), ``roots`` [T].

    Invariants (checked on construction): every tree has >= 1 row and its first row is its root;
    ``0 <= parent[i] < local index of i`` elsewhere; ``depth`` follows the parent chain. Rewards
    are checked where they are read (``check_rewards``): a growing tree may hold a root with no
    rollout yet. Arrays are read-only; ``grow`` and ``with_new_trees`` return new batches.
    """

    def __init__(self, parent: object, reward: object | None = None, offsets: object | None = None,
                 depth: object | None = None, level: object | None = None):
        parent = _ints(parent)
        n = len(parent)
        reward = np.full(n, np.nan) if reward is None else \
            np.asarray(reward, dtype=np.float64).reshape(-1).copy()
        offsets = np.array([0, n], np.int64) if offsets is None else _ints(offsets).copy()
        if reward.shape != parent.shape:
            raise ValueError(f"reward has shape {reward.shape}, parent has {parent.shape}")
        if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != n or np.any(np.diff(offsets) < 1):
            raise ValueError(f"offsets must rise strictly from 0 to the row count {n}, "
                             f"got {offsets.tolist()[:8]}")
        sizes = np.diff(offsets)
        tree_of_row = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        local = np.arange(n, dtype=np.int64) - offsets[:-1][tree_of_row]
        is_root = local == 0
        bad = np.flatnonzero(is_root & (parent != NO_PARENT))
        if len(bad):
            raise ValueError(f"parent[{bad[0]}] must be NO_PARENT ({NO_PARENT}) at a tree's "
                             f"first row, got {parent[bad[0]]}")
        bad = np.flatnonzero(~is_root & ((parent < 0) | (parent >= local)))
        if len(bad):
            raise ValueError(f"parent[{bad[0]}] = {parent[bad[0]]} breaks 0 <= parent[i] < i")
        up = np.where(is_root, NO_PARENT, parent + offsets[:-1][tree_of_row])
        if depth is None:
            depth = _depth_of(up)
        else:
            depth = _ints(depth).copy()
            if depth.shape != parent.shape:
                raise ValueError(f"depth has shape {depth.shape}, parent has {parent.shape}")
            want = np.where(is_root, 0, depth[np.maximum(up, 0)] + 1)
            bad = np.flatnonzero(depth != want)
            if len(bad):
                raise ValueError(f"depth[{bad[0]}] = {depth[bad[0]]} but its parent chain "
                                 f"gives {_depth_of(up)[bad[0]]}")
        level = np.zeros(n, np.int64) if level is None else _ints(level).copy()
        if level.shape != parent.shape:
            raise ValueError(f"level has shape {level.shape}, parent has {parent.shape}")
        has_child = np.zeros(n, bool)
        has_child[up[up >= 0]] = True
        self.parent, self.reward, self.offsets, self.depth, self.level = (
            parent.copy(), reward, offsets, depth, level)
        self.tree_of_row, self.up, self.is_leaf = tree_of_row, up, ~has_child
        _frozen(self.parent, self.reward, self.offsets, self.depth, self.level,
                self.tree_of_row, self.up, self.is_leaf)

    # -- shape ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        """T, the number of trees."""
        return len(self.offsets) - 1

    @property
    def num_rows(self) -> int:
        return len(self.parent)

    @property
    def roots(self) -> np.ndarray:
        """int64 [T]: each tree's root row."""
        return self.offsets[:-1]

    @property
    def sizes(self) -> np.ndarray:
        """int64 [T]: rows per tree."""
        return np.diff(self.offsets)

    @property
    def local(self) -> np.ndarray:
        """int64 [R]: each row's index inside its tree."""
        return np.arange(self.num_rows) - self.offsets[:-1][self.tree_of_row]

    @property
    def leaves(self) -> np.ndarray:
        """int64 [L]: leaf rows, increasing (tree by tree; every estimator's row order)."""
        return np.flatnonzero(self.is_leaf)

    @property
    def n_children(self) -> np.ndarray:
        """int64 [R]: children per row."""
        return np.bincount(self.up[self.up >= 0], minlength=self.num_rows)

    # -- construction --------------------------------------------------------------------------

    @classmethod
    def empty(cls) -> TreeBatch:
        """No trees."""
        return cls(np.zeros(0, np.int64), offsets=[0])

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[Hashable]], rewards: Sequence[float]) -> TreeBatch:
        """One tree from turn-key paths; equal key prefixes become shared nodes.

        ``paths[k]`` lists the keys of the turns of trajectory k from the root (root excluded);
        its last node is a leaf with reward ``rewards[k]``. Keys identify turns, so two
        trajectories that share a prefix must repeat the same keys for it. Nodes are numbered in
        first-seen order, hence ``parent[i] < i``. Rewards are checked.
        """
        if len(paths) != len(rewards):
            raise ValueError(f"got {len(paths)} paths but {len(rewards)} rewards")
        ids: dict[tuple[Hashable, ...], int] = {(): ROOT}
        parent, reward = [NO_PARENT], [np.nan]
        for k, (keys, r) in enumerate(zip(paths, rewards)):
            if len(keys) == 0:
                raise ValueError(f"paths[{k}] is empty: a trajectory has at least one turn")
            prefix: tuple[Hashable, ...] = ()
            for key in keys:
                above = ids[prefix]
                prefix = prefix + (key,)
                if prefix not in ids:
                    ids[prefix] = len(parent)
                    parent.append(above)
                    reward.append(np.nan)
            leaf = ids[prefix]
            if not np.isnan(reward[leaf]):
                raise ValueError(f"paths[{k}] ends on a node that is already a leaf of another path")
            reward[leaf] = float(r)
        out = cls(parent, reward)
        out.check_rewards()
        return out

    @classmethod
    def concat(cls, batches: Sequence[TreeBatch]) -> TreeBatch:
        """The trees of ``batches`` one after another."""
        if not batches:
            return cls.empty()
        sizes = np.concatenate([b.sizes for b in batches])
        return cls(np.concatenate([b.parent for b in batches]),
                   np.concatenate([b.reward for b in batches]),
                   np.r_[0, np.cumsum(sizes)], np.concatenate([b.depth for b in batches]),
                   np.concatenate([b.level for b in batches]))

    def select(self, trees: object) -> TreeBatch:
        """The trees at positions ``trees`` (in that order) as a batch of their own."""
        trees = _ints(trees)
        rows = self.rows_of(trees)
        sizes = self.sizes[trees]
        return TreeBatch(self.parent[rows], self.reward[rows], np.r_[0, np.cumsum(sizes)],
                         self.depth[rows], self.level[rows])

    def rows_of(self, trees: object) -> np.ndarray:
        """int64: the rows of the trees at positions ``trees``, tree by tree, root first."""
        trees = _ints(trees)
        sizes = self.sizes[trees]
        starts = np.repeat(self.offsets[:-1][trees], sizes)
        return starts + np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)

    def with_new_trees(self, count: int) -> TreeBatch:
        """This batch with ``count`` root-only trees appended (rows of the old trees unchanged)."""
        n = self.num_rows
        return TreeBatch(np.r_[self.parent, np.full(count, NO_PARENT)],
                         np.r_[self.reward, np.full(count, np.nan)],
                         np.r_[self.offsets, n + 1 + np.arange(count)],
                         np.r_[self.depth, np.zeros(count, np.int64)],
                         np.r_[self.level, np.zeros(count, np.int64)])

    def grow(self, at: object, length: object, reward: object, level: object = 0
             ) -> tuple[TreeBatch, Growth]:
        """Hang one fresh chain of ``length[c]`` turns below row ``at[c]`` for every c, its last
        node a leaf with ``reward[c]``, its nodes at ``level[c]`` (a scalar for all).

        A tree's new chains follow its old rows in the order given (a continuation samples new
        turns from a stored prefix; it shares nothing with existing children). ``at`` must not
        be a finished leaf. Returns the new batch and where old and new rows went (``Growth``).
        """
        at, length = _ints(at), _ints(length)
        reward = np.asarray(reward, np.float64).reshape(-1)
        level = np.broadcast_to(_ints(level) if np.ndim(level) else np.int64(level), at.shape)
        if not (len(length) == len(reward) == len(at)):
            raise ValueError("grow: at, length and reward need one entry per chain")
        if len(at) and (at.min() < 0 or at.max() >= self.num_rows):
            raise ValueError(f"grow: row {at[(at < 0) | (at >= self.num_rows)][0]} is not a row "
                             f"of a {self.num_rows}-row batch")
        if np.any(length < 1):
            raise ValueError(f"grow: a chain needs length >= 1, got {length[length < 1][0]}")
        if np.any(~np.isnan(self.reward[at])):
            raise ValueError(f"grow: row {at[~np.isnan(self.reward[at])][0]} is a leaf "
                             "(a finished trajectory)")
        tree = self.tree_of_row[at]
        added = np.bincount(tree, weights=length, minlength=len(self)).astype(np.int64)
        offsets = np.r_[0, np.cumsum(self.sizes + added)]
        old = np.arange(self.num_rows) + (offsets[:-1] - self.offsets[:-1])[self.tree_of_row]
        # each chain's first local index: after its tree's old rows and its earlier chains
        order = np.argsort(tree, kind="stable")
        before = np.cumsum(length[order]) - length[order]  # [C] nodes of earlier chains (sorted)
        first = np.searchsorted(tree[order], tree[order])  # [C] the tree's first sorted chain
        start = np.empty(len(at), np.int64)
        start[order] = self.sizes[tree[order]] + before - before[first]
        step = np.arange(int(length.sum())) - np.repeat(np.cumsum(length) - length, length)
        local = np.repeat(start, length) + step  # [A] local index of each new node
        rows = np.repeat(offsets[:-1][tree], length) + local
        leaf_reward = np.full(len(rows), np.nan)
        leaf_reward[np.cumsum(length) - 1] = reward
        growth = Growth(old, rows, rows[np.cumsum(length) - 1] if len(at) else rows)
        grown = TreeBatch(
            growth.place(self.parent, np.where(step == 0, np.repeat(self.local[at], length),
                                               local - 1)),
            growth.place(self.reward, leaf_reward), offsets,
            growth.place(self.depth, np.repeat(self.depth[at] + 1, length) + step),
            growth.place(self.level, np.repeat(level, length)))
        return grown, growth

    # -- reading -------------------------------------------------------------------------------

    def check_rewards(self) -> None:
        """Raise ValueError unless rewards sit exactly on the leaves, in [0, 1], and no tree is
        a root alone."""
        has = ~np.isnan(self.reward)
        for mask, what in ((has & ~self.is_leaf, "has a reward but also has children"),
                           (self.is_leaf & ~has, "has no children but its reward is NaN"),
                           (has & ((self.reward < 0) | (self.reward > 1)), "has a reward outside "
                                                                             "[0, 1]")):
            bad = np.flatnonzero(mask)
            if len(bad):
                raise ValueError(f"node {self._name(bad[0])} {what} "
                                 f"({self.reward[bad[0]]})")

    def _name(self, row: int) -> str:
        k = int(self.tree_of_row[row])
        return str(row) if len(self) == 1 else f"{row - self.offsets[k]} of tree {k} (row {row})"

    def backup(self, reward: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(value [R] float64, n_leaves [R] int64): V^ and leaf counts of docs/algorithm.md.

        One pass per depth level, deepest first, adds every node's reward sum and leaf count to
        its parent (children in decreasing row order, as a reverse loop over one tree would), then
        V^ = reward sum / leaf count. ``reward`` backs up other leaf values on the same shape
        (e.g. squared rewards).
        """
        self.check_rewards()
        leaf = self.is_leaf
        total = np.where(leaf, self.reward if reward is None else reward, 0.0)
        count = leaf.astype(np.int64)
        for rows in self._levels_up():
            total += np.bincount(self.up[rows], weights=total[rows], minlength=self.num_rows)
            count += np.bincount(self.up[rows], weights=count[rows],
                                 minlength=self.num_rows).astype(np.int64)
        return total / count, count

    def reward_range(self) -> tuple[np.ndarray, np.ndarray]:
        """(lowest [R], highest [R]) leaf reward below each row (a leaf: its own; a row with no
        leaf below: +inf, -inf). A node whose two differ holds both outcomes below it: a mixed
        anchor (the store's ``mixed_anchors`` view). Same passes as ``backup``."""
        self.check_rewards()
        lo = np.where(self.is_leaf, self.reward, np.inf)
        hi = np.where(self.is_leaf, self.reward, -np.inf)
        for rows in self._levels_up():
            np.minimum.at(lo, self.up[rows], lo[rows])
            np.maximum.at(hi, self.up[rows], hi[rows])
        return lo, hi

    def _levels_up(self) -> list[np.ndarray]:
        """Non-root rows per depth level, deepest level first, each in decreasing row order."""
        order = np.lexsort((-np.arange(self.num_rows), -self.depth))
        d = self.depth[order]
        cuts = np.flatnonzero(np.diff(d)) + 1
        return [g for g in np.split(order, cuts) if len(g) and self.depth[g[0]] > 0]

    def paths(self) -> np.ndarray:
        """int64 [L, D_max + 1]: the rows on each leaf's path (root first), padded with -1.

        Rows follow ``leaves``; column d holds the node at depth d.
        """
        leaves = self.leaves
        if not len(leaves):
            return np.zeros((0, 1), np.int64)
        out = np.full((len(leaves), int(self.depth[leaves].max()) + 1), -1, np.int64)
        node = leaves.copy()
        for d in range(out.shape[1] - 1, -1, -1):
            here = self.depth[leaves] >= d
            out[here, d] = node[here]
            node = np.where(here, self.up[node], node)
        return out

    def path(self, row: int) -> list[int]:
        """The rows from the root of ``row``'s tree down to ``row`` (both included)."""
        out = [int(row)]
        while self.up[out[-1]] != NO_PARENT:
            out.append(int(self.up[out[-1]]))
        return out[::-1]

    def leaf_below(self) -> np.ndarray:
        """int64 [R]: per row, the leaf row reached by always stepping to the first (lowest)
        child; a leaf maps to itself. On a chain (a bare rollout below its root, a continuation
        below its branch point) that is the chain's one leaf."""
        out = np.arange(self.num_rows, dtype=np.int64)
        for d in range(int(self.depth.max(initial=0)), 0, -1):
            rows = np.flatnonzero(self.depth == d)[::-1]  # lowest row written last: it wins
            out[self.up[rows]] = out[rows]
        return out

    def bare_outcomes(self) -> tuple[np.ndarray, np.ndarray]:
        """([T] bare rollouts, [T] their summed rewards) per tree: the leaves at level 0."""
        leaf = self.is_leaf & (self.level == 0) & (self.depth > 0)
        tree = self.tree_of_row[leaf]
        return (np.bincount(tree, minlength=len(self)),
                np.bincount(tree, weights=self.reward[leaf], minlength=len(self)))

    def candidates(self, from_root: bool, deepest_first: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Stage 2's candidate set of every tree: (rows [K], observed outcome [K]).

        A tree's candidates are the non-leaf nodes at depth >= 1 on its bare rollouts (level 0),
        each with the outcome of the bare rollout through it (each lies on exactly one), then its
        root, when the tree has no such node (every bare rollout ended on its first turn: its
        continuation budget goes to more rollouts from the root; observed NaN if they disagree)
        or when ``from_root`` and its bare outcomes all agree (``root_prefix``: the root is then
        worth branching from). Trees in order, each tree's prefixes by row (a bare rollout's
        shallowest first; ``deepest_first`` lists each rollout's deepest first, the order the
        benchmarks' recorded seeds were run with), its root last.
        """
        outcomes = self.reward[self.is_leaf & (self.level == 0) & (self.depth > 0)]
        if np.any((outcomes != 0.0) & (outcomes != 1.0)):
            raise ValueError(f"bare rollout outcomes must be 0 or 1, got "
                             f"{sorted(set(outcomes.tolist()) - {0.0, 1.0})}")
        prefix = np.flatnonzero((self.depth > 0) & ~self.is_leaf & (self.level == 0))
        below = self.leaf_below()[prefix]
        bare, wins = self.bare_outcomes()
        agree = (bare > 0) & ((wins == 0) | (wins == bare))
        shared = np.where(agree, np.sign(wins), np.nan)  # [T] the agreeing outcome, else NaN
        has_prefix = np.bincount(self.tree_of_row[prefix], minlength=len(self)) > 0
        root = np.flatnonzero(~has_prefix | (from_root & agree))
        rows = np.r_[prefix, self.roots[root]]
        observed = np.r_[self.reward[below], shared[root]]
        tree = self.tree_of_row[rows]
        is_root = np.r_[np.zeros(len(prefix), bool), np.ones(len(root), bool)]
        keys = (-self.depth[rows], np.r_[below, self.roots[root]]) if deepest_first else (rows,)
        order = np.lexsort(keys + (is_root, tree))
        return rows[order], observed[order]


@dataclass(frozen=True)
class Growth:
    """Where ``TreeBatch.grow`` put the rows: ``old`` [R_old] the new row of each old row,
    ``new`` [A] the rows of the added nodes (chain by chain, root-side first, in the order the
    chains were given), ``leaf`` [C] each chain's leaf row."""

    old: np.ndarray
    new: np.ndarray
    leaf: np.ndarray

    def place(self, old_values: np.ndarray, new_values: np.ndarray) -> np.ndarray:
        """A per-row array of the grown batch from the old rows' values and the new nodes'."""
        old_values, new_values = np.asarray(old_values), np.asarray(new_values)
        out = np.empty((len(self.old) + len(self.new),) + old_values.shape[1:],
                       np.result_type(old_values, new_values) if old_values.dtype != object
                       else object)
        out[self.old] = old_values
        out[self.new] = new_values
        return out


def _depth_of(up: np.ndarray) -> np.ndarray:
    """int64 [R]: steps from each row up to its root (one vectorised step per depth level)."""
    depth = np.zeros(len(up), np.int64)
    node = up.copy()
    while np.any(node >= 0):
        on = node >= 0
        depth += on
        node = np.where(on, up[np.maximum(node, 0)], NO_PARENT)
    return depth


def is_leaf(parent: np.ndarray) -> np.ndarray:
    """bool [N]: True where no node of one tree names this one as parent."""
    return TreeBatch(parent).is_leaf.copy()


def validate(parent: np.ndarray, leaf_reward: np.ndarray) -> None:
    """Raise ValueError unless (parent, leaf_reward) is one well-formed rollout tree."""
    parent = np.asarray(parent)
    if parent.ndim != 1 or len(parent) == 0:
        raise ValueError(f"parent must be a non-empty 1-D array, got shape {parent.shape}")
    TreeBatch(parent, leaf_reward).check_rewards()


def backup(parent: np.ndarray, leaf_reward: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``TreeBatch.backup`` of one tree given as (parent [N], leaf_reward [N])."""
    validate(parent, leaf_reward)
    return TreeBatch(parent, leaf_reward).backup()


def root_to_leaf_paths(parent: np.ndarray) -> np.ndarray:
    """``TreeBatch.paths`` of one tree given by its parent array."""
    return TreeBatch(parent).paths()


def sibling_contrast_pairs(up: np.ndarray, value: np.ndarray) -> int:
    """Unordered pairs of siblings (children of one node) whose backed-up values differ, over
    every tree of a batch (``up``: each row's parent row, -1 at roots; one tree's parent array
    is its own)."""
    up = np.asarray(up)
    child = np.flatnonzero(up >= 0)
    # Values are leaf-count ratios; rounding makes equal ratios compare equal.
    parent, key = up[child], np.round(value[child], 9)
    order = np.lexsort((key, parent))
    parent, key = parent[order], key[order]
    siblings = np.diff(np.flatnonzero(np.r_[True, parent[1:] != parent[:-1], True]))
    same = np.diff(np.flatnonzero(np.r_[True, (parent[1:] != parent[:-1]) | (key[1:] != key[:-1]),
                                        True]))
    return int((siblings * (siblings - 1) // 2).sum() - (same * (same - 1) // 2).sum())
