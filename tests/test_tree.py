"""trace_core.tree: construction, validation, backup against a naive recursion, paths."""

import numpy as np
import pytest

from trace_core.tree import (
    NO_PARENT,
    ROOT,
    Tree,
    backup,
    extend,
    is_leaf,
    leaf_below,
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
    tree = Tree.from_paths([["a", "b"], ["a", "c"], ["d"]], [1.0, 0.0, 1.0])
    assert tree.parent.tolist() == [NO_PARENT, ROOT, 1, 1, ROOT]
    assert tree.depth.tolist() == [0, 1, 2, 2, 1]
    np.testing.assert_array_equal(tree.leaf_reward, [np.nan, np.nan, 1.0, 0.0, 1.0])
    assert tree.num_nodes == 5
    assert tree.leaves.tolist() == [2, 3, 4]
    assert tree.children(1).tolist() == [2, 3]
    assert tree.children(2).tolist() == []
    assert tree.path(3) == [0, 1, 3]
    assert tree.path(ROOT) == [0]


def test_backup_hand_worked():
    # root -> a -> {b: 1, c: 0}; root -> d: 1.  V(a) = 1/2, V(root) = (2 * 1/2 + 1) / 3 = 2/3.
    tree = Tree.from_paths([["a", "b"], ["a", "c"], ["d"]], [1, 0, 1])
    value, n = backup(tree.parent, tree.leaf_reward)
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
        Tree.from_paths([["a"], ["a", "b"]], [1, 0])  # "a" is a leaf and an internal node
    with pytest.raises(ValueError, match="already a leaf"):
        Tree.from_paths([["a"], ["a"]], [1, 0])
    with pytest.raises(ValueError, match="outside"):
        Tree.from_paths([["a"]], [2.0])
    with pytest.raises(ValueError, match="empty"):
        Tree.from_paths([[]], [1.0])
    with pytest.raises(ValueError, match="2 paths but 1 rewards"):
        Tree.from_paths([["a"], ["b"]], [1.0])


def test_tree_rejects_inconsistent_depth():
    with pytest.raises(ValueError, match="depth"):
        Tree(np.array([-1, 0, 1]), np.array([0, 1, 1]), np.array([np.nan, np.nan, 1.0]))


def test_extend_adds_a_fresh_chain_and_backup_sees_it():
    tree = Tree.from_paths([["a", "b"], ["c"]], [1, 1])
    grown, leaf = extend(tree, 1, 2, 0.0)
    assert leaf == grown.num_nodes - 1 == 5
    assert grown.path(leaf) == [0, 1, 4, 5]
    assert grown.depth[leaf] == 3
    value, n = backup(grown.parent, grown.leaf_reward)
    assert n[1] == 2 and value[1] == pytest.approx(0.5)
    assert value[ROOT] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="is a leaf"):
        extend(grown, leaf, 1, 1.0)
    with pytest.raises(ValueError, match="n_new"):
        extend(grown, 1, 0, 1.0)
    with pytest.raises(ValueError, match="not a node"):
        extend(grown, 99, 1, 1.0)


def test_root_to_leaf_paths_matches_path_per_leaf():
    rng = np.random.default_rng(1)
    for _ in range(100):
        parent, reward = random_tree(rng, int(rng.integers(2, 30)))
        tree = Tree(parent, _depths(parent), reward)
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
    assert leaf_below(parent).tolist() == [2, 2, 2, 5, 5, 5, 6]


def test_leaf_below_matches_a_search_for_children_on_random_trees():
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 40):
        parent, _ = random_tree(rng, n)
        want = []
        for i in range(n):
            while (kids := np.flatnonzero(parent == i)).size:
                i = int(kids[0])
            want.append(i)
        assert leaf_below(parent).tolist() == want
