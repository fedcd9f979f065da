"""trace_core.tree: construction, validation, backup against a naive recursion, paths, growth,
and the batched operations of ``TreeBatch`` against the same operations tree by tree."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.tree import (
    NO_PARENT,
    ROOT,
    TreeBatch,
    backup,
    is_leaf,
    root_to_leaf_paths,
)


def random_tree(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A random (parent, leaf_reward) pair: parent[i] uniform below i, rewards in {0, 1}."""
    parent = np.array([NO_PARENT] + [int(rng.integers(0, i)) for i in range(1, n)])
    leaf = is_leaf(parent)
    reward = np.where(leaf, rng.integers(0, 2, n).astype(float), np.nan)
    return parent, reward


def naive_backup(parent: np.ndarray, reward: np.ndarray) -> tuple[list[float], list[int]]:
    """Recursive definition of docs/algorithm.md: V^(leaf) = r, V^(y) = sum_c n_c V^(c) / n_y."""
    children = {i: [c for c in range(len(parent)) if parent[c] == i] for i in range(len(parent))}

    def visit(y: int) -> tuple[float, int]:
        if not children[y]:
            return float(reward[y]), 1
        parts = [visit(c) for c in children[y]]
        n = sum(k for _, k in parts)
        return sum(val * k for val, k in parts) / n, n

    out = [visit(y) for y in range(len(parent))]
    return [v for v, _ in out], [k for _, k in out]


def test_from_paths_merges_shared_prefixes_in_first_seen_order():
    tree = TreeBatch.from_paths([["a", "b"], ["a", "c"], ["d"]], [1.0, 0.0, 1.0])
    assert tree.parent.tolist() == [NO_PARENT, ROOT, 1, 1, ROOT]
    assert tree.depth.tolist() == [0, 1, 2, 2, 1]
    np.testing.assert_array_equal(tree.reward, [np.nan, np.nan, 1.0, 0.0, 1.0])
    assert tree.num_rows == 5 and len(tree) == 1
    assert tree.leaves.tolist() == [2, 3, 4]
    assert tree.n_children.tolist() == [2, 2, 0, 0, 0]
    assert tree.path(3) == [0, 1, 3]
    assert tree.path(ROOT) == [0]


def test_backup_hand_worked():
    # root -> a -> {b: 1, c: 0}; root -> d: 1.  V(a) = 1/2, V(root) = (2 * 1/2 + 1) / 3 = 2/3.
    tree = TreeBatch.from_paths([["a", "b"], ["a", "c"], ["d"]], [1, 0, 1])
    value, n = tree.backup()
    np.testing.assert_allclose(value, [2 / 3, 1 / 2, 1, 0, 1])
    assert n.tolist() == [3, 2, 1, 1, 1]


def test_backup_matches_naive_recursion_on_random_trees():
    rng = np.random.default_rng(0)
    for _ in range(200):
        parent, reward = random_tree(rng, int(rng.integers(2, 40)))
        value, n = backup(parent, reward)
        ref_value, ref_n = naive_backup(parent, reward)
        np.testing.assert_allclose(value, ref_value, rtol=0, atol=1e-12)
        assert n.tolist() == ref_n
        assert n[ROOT] == is_leaf(parent).sum()
        assert np.all((value >= 0) & (value <= 1))


def test_reward_range_is_the_lowest_and_highest_leaf_below_each_node():
    # root -> a -> {b: 1, c: 0}; root -> d: 1.
    tree = TreeBatch.from_paths([["a", "b"], ["a", "c"], ["d"]], [1, 0, 1])
    lo, hi = tree.reward_range()
    assert lo.tolist() == [0, 0, 1, 0, 1] and hi.tolist() == [1, 1, 1, 0, 1]
    rng = np.random.default_rng(1)
    for _ in range(40):
        parent, reward = random_tree(rng, int(rng.integers(2, 30)))
        lo, hi = TreeBatch(parent, reward).reward_range()
        for y in range(len(parent)):
            below = [reward[i] for i in range(len(parent)) if is_leaf(parent)[i]
                     and y in TreeBatch(parent, reward).path(i)]
            assert (lo[y], hi[y]) == (min(below), max(below))


def test_backup_accepts_fractional_rewards_in_unit_interval():
    value, n = backup(np.array([-1, 0, 0]), np.array([np.nan, 0.25, 0.75]))
    assert value[0] == pytest.approx(0.5) and n[0] == 2


@pytest.mark.parametrize(
    ("parent", "reward", "message"),
    [
        ([-1, 0, 0], [np.nan, 1.0, np.nan], "no children"),  # internal by reward, no children
        ([-1, 0, 1], [np.nan, 1.0, 0.0], "has children"),  # a leaf reward on an internal node
        ([-1, 0, 0], [np.nan, 1.5, 0.0], "outside"),
        ([-1, 2, 0], [np.nan, 1.0, np.nan], "parent"),  # parent[1] = 2 breaks parent[i] < i
        ([0, 0], [np.nan, 1.0], "NO_PARENT"),
        ([-1, 0], [np.nan, 1.0, 0.0], "shape"),
    ],
)
def test_backup_rejects_malformed_trees(parent, reward, message):
    with pytest.raises(ValueError, match=message):
        backup(np.array(parent), np.array(reward))


def test_from_paths_rejects_bad_input():
    with pytest.raises(ValueError, match="has children"):
        TreeBatch.from_paths([["a"], ["a", "b"]], [1, 0])  # "a" is a leaf and an internal node
    with pytest.raises(ValueError, match="already a leaf"):
        TreeBatch.from_paths([["a"], ["a"]], [1, 0])
    with pytest.raises(ValueError, match="outside"):
        TreeBatch.from_paths([["a"]], [2.0])
    with pytest.raises(ValueError, match="empty"):
        TreeBatch.from_paths([[]], [1.0])
    with pytest.raises(ValueError, match="2 paths but 1 rewards"):
        TreeBatch.from_paths([["a"], ["b"]], [1.0])


def test_tree_rejects_inconsistent_depth():
    with pytest.raises(ValueError, match="depth"):
        TreeBatch(np.array([-1, 0, 1]), np.array([np.nan, np.nan, 1.0]), depth=np.array([0, 1, 1]))


def test_grow_adds_a_fresh_chain_and_backup_sees_it():
    tree = TreeBatch.from_paths([["a", "b"], ["c"]], [1, 1])
    grown, growth = tree.grow([1], [2], [0.0], level=1)
    leaf = int(growth.leaf[0])
    assert leaf == grown.num_rows - 1 == 5
    assert grown.path(leaf) == [0, 1, 4, 5]
    assert grown.depth[leaf] == 3 and grown.level.tolist() == [0, 0, 0, 0, 1, 1]
    value, n = grown.backup()
    assert n[1] == 2 and value[1] == pytest.approx(0.5)
    assert value[ROOT] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="is a leaf"):
        grown.grow([leaf], [1], [1.0])
    with pytest.raises(ValueError, match="length"):
        grown.grow([1], [0], [1.0])
    with pytest.raises(ValueError, match="not a row"):
        grown.grow([99], [1], [1.0])


def test_root_to_leaf_paths_matches_path_per_leaf():
    rng = np.random.default_rng(1)
    for _ in range(100):
        parent, reward = random_tree(rng, int(rng.integers(2, 30)))
        tree = TreeBatch(parent, reward, depth=_depths(parent))
        paths = root_to_leaf_paths(parent)
        assert paths.shape == (len(tree.leaves), int(tree.depth.max()) + 1)
        for row, leaf in zip(paths, tree.leaves):
            expected = tree.path(int(leaf))
            assert row[: len(expected)].tolist() == expected
            assert np.all(row[len(expected) :] == -1)


def _depths(parent: np.ndarray) -> np.ndarray:
    depth = np.zeros(len(parent), dtype=np.int64)
    for i in range(1, len(parent)):
        depth[i] = depth[parent[i]] + 1
    return depth


def test_leaf_below_follows_first_children_to_a_leaf():
    # root 0 with chains 0-1-2 and 0-3-4-5, and node 1 branching again: 1-6
    parent = np.array([NO_PARENT, 0, 1, 0, 3, 4, 1])
    assert TreeBatch(parent).leaf_below().tolist() == [2, 2, 2, 5, 5, 5, 6]


def test_leaf_below_matches_a_search_for_children_on_random_trees():
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 40):
        parent, _ = random_tree(rng, n)
        want = []
        for i in range(n):
            while (kids := np.flatnonzero(parent == i)).size:
                i = int(kids[0])
            want.append(i)
        assert TreeBatch(parent).leaf_below().tolist() == want


# ----------------------------------------------------------------- a batch of trees


def two_trees() -> TreeBatch:
    """Tree 0: root -> a -> {b: 1, c: 0}; root -> d: 1 (rows 0-4). Tree 1: the chain
    root -> x -> y -> z: 0 (rows 5-8)."""
    return TreeBatch.concat([TreeBatch.from_paths([["a", "b"], ["a", "c"], ["d"]], [1, 0, 1]),
                             TreeBatch.from_paths([["x", "y", "z"]], [0])])


def test_a_batch_of_two_trees_hand_worked():
    trees = two_trees()
    assert len(trees) == 2 and trees.offsets.tolist() == [0, 5, 9]
    assert trees.up.tolist() == [-1, 0, 1, 1, 0, -1, 5, 6, 7]
    assert trees.parent.tolist() == [-1, 0, 1, 1, 0, -1, 0, 1, 2]
    value, n = trees.backup()
    np.testing.assert_allclose(value, [2 / 3, 1 / 2, 1, 0, 1, 0, 0, 0, 0])
    assert n.tolist() == [3, 2, 1, 1, 1, 1, 1, 1, 1]
    assert trees.paths().tolist() == [[0, 1, 2, -1], [0, 1, 3, -1], [0, 4, -1, -1], [5, 6, 7, 8]]
    assert trees.leaf_below().tolist() == [2, 2, 2, 3, 4, 8, 8, 8, 8]
    # Stage 2: tree 0's prefix a (its bare rollout a-b won; its root is mixed), tree 1's x and y
    # (lost), and tree 1's root, whose bare rollouts agree, when offered from the root.
    rows, observed = trees.candidates(from_root=False)
    assert rows.tolist() == [1, 6, 7] and observed.tolist() == [1, 0, 0]
    rows, observed = trees.candidates(from_root=True)
    assert rows.tolist() == [1, 6, 7, 5] and observed.tolist() == [1, 0, 0, 0]
    assert trees.candidates(from_root=True, deepest_first=True)[0].tolist() == [1, 7, 6, 5]
    assert trees.select([1]).parent.tolist() == [-1, 0, 1, 2]


def test_growing_a_batch_keeps_each_trees_rows_contiguous():
    trees = two_trees().with_new_trees(1)  # tree 2: a root with no rollout yet
    assert trees.offsets.tolist() == [0, 5, 9, 10]
    # root continuation of tree 1, a continuation of tree 0's a, and a bare rollout of tree 2
    grown, growth = trees.grow([5, 1, 9], [1, 2, 3], [1.0, 0.0, 1.0], level=[1, 1, 0])
    assert grown.offsets.tolist() == [0, 7, 12, 16]
    assert growth.old.tolist() == [0, 1, 2, 3, 4, 7, 8, 9, 10, 12]
    assert growth.new.tolist() == [11, 5, 6, 13, 14, 15]  # chain by chain, in the order given
    assert growth.leaf.tolist() == [11, 6, 15]
    assert grown.parent[5:7].tolist() == [1, 5] and grown.parent[11] == 0
    assert grown.parent[12:].tolist() == [-1, 0, 1, 2] and grown.depth[12:].tolist() == [0, 1, 2, 3]
    assert grown.level.tolist() == [0] * 5 + [1, 1] + [0] * 4 + [1] + [0] * 4
    value, n = grown.backup()
    assert n[grown.roots].tolist() == [4, 2, 1]
    np.testing.assert_allclose(value[grown.roots], [1 / 2, 1 / 2, 1])
    side = growth.place(np.arange(trees.num_rows), -np.arange(1, 7))
    assert side.tolist() == [0, 1, 2, 3, 4, -2, -3, 5, 6, 7, 8, -1, 9, -4, -5, -6]


@st.composite
def batches(draw):
    """A list of 1-5 random trees (parent, reward) with rewards in {0, 1/2, 1}."""
    out = []
    for _ in range(draw(st.integers(1, 5))):
        n = draw(st.integers(2, 14))
        parent = np.array([NO_PARENT] + [draw(st.integers(0, i - 1)) for i in range(1, n)])
        leaf = is_leaf(parent)
        reward = np.array([draw(st.sampled_from([0.0, 0.5, 1.0])) if leaf[i] else np.nan
                           for i in range(n)])
        out.append((parent, reward))
    return out


@settings(max_examples=150, deadline=None)
@given(batches())
def test_batched_backup_paths_and_leaf_below_equal_the_per_tree_results(trees):
    batch = TreeBatch.concat([TreeBatch(p, r) for p, r in trees])
    value, n = batch.backup()
    paths = batch.paths()
    below = batch.leaf_below()
    row = 0
    for k, (parent, reward) in enumerate(trees):
        s = slice(batch.offsets[k], batch.offsets[k + 1])
        ref_value, ref_n = naive_backup(parent, reward)
        np.testing.assert_allclose(value[s], ref_value, rtol=0, atol=1e-12)
        assert n[s].tolist() == ref_n
        for leaf in np.flatnonzero(is_leaf(parent)):
            expected = [batch.offsets[k] + i for i in _path(parent, leaf)]
            assert paths[row, : len(expected)].tolist() == expected
            assert np.all(paths[row, len(expected):] == -1)
            row += 1
        for i in range(len(parent)):
            j = i
            while (kids := np.flatnonzero(parent == j)).size:
                j = int(kids[0])
            assert below[batch.offsets[k] + i] == batch.offsets[k] + j
    assert row == len(paths)


def _path(parent: np.ndarray, i: int) -> list[int]:
    out = [int(i)]
    while parent[out[-1]] != NO_PARENT:
        out.append(int(parent[out[-1]]))
    return out[::-1]
