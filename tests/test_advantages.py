"""trace_core.advantages: each estimator against a plain Python loop on random trees, plus
hand-worked trees."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trace_core.advantages import (
    ESTIMATORS,
    advantages,
    branch,
    grpo,
    segment,
    tree_grpo,
    treepo,
)
from trace_core.tree import NO_PARENT, TreeBatch, is_leaf

EPS = 1e-6


def random_tree(rng, n):
    parent = np.array([NO_PARENT] + [int(rng.integers(0, i)) for i in range(1, n)])
    reward = np.where(is_leaf(parent), rng.integers(0, 2, n).astype(float), np.nan)
    return parent, reward


# ----------------------------------------------------------------- naive references (plain loops)


class Naive:
    def __init__(self, parent, reward):
        self.parent = [int(p) for p in parent]
        self.reward = [float(r) for r in reward]
        self.n = len(self.parent)
        self.kids = [[c for c in range(self.n) if self.parent[c] == y] for y in range(self.n)]
        self.leaves = [y for y in range(self.n) if not self.kids[y]]

    def path(self, y):
        out = [y]
        while self.parent[out[-1]] != NO_PARENT:
            out.append(self.parent[out[-1]])
        return out[::-1]

    def leaves_under(self, y):
        return [l for l in self.leaves if y in self.path(l)]

    def value(self, y):
        rs = [self.reward[l] for l in self.leaves_under(y)]
        return sum(rs) / len(rs)

    @staticmethod
    def norm(r, group, scale):
        mean = sum(group) / len(group)
        std = math.sqrt(sum((g - mean) ** 2 for g in group) / len(group))
        return (r - mean) / (std + EPS) if scale else r - mean

    def table(self, per_leaf_turns):
        depth = max(len(self.path(l)) - 1 for l in self.leaves)
        out = np.full((len(self.leaves), depth), np.nan)
        for row, l in enumerate(self.leaves):
            turns = per_leaf_turns(l)
            out[row, : len(turns)] = turns
        return out

    def grpo(self, scale):
        group = [self.reward[l] for l in self.leaves]
        return self.table(
            lambda l: [self.norm(self.reward[l], group, scale)] * (len(self.path(l)) - 1)
        )

    def tree_grpo(self, scale):
        def adv(l):
            top = self.path(l)[1]
            own = [self.reward[k] for k in self.leaves if self.path(k)[1] == top]
            every = [self.reward[k] for k in self.leaves]
            a = self.norm(self.reward[l], own, scale) + self.norm(self.reward[l], every, scale)
            return [a] * (len(self.path(l)) - 1)

        return self.table(adv)

    def treepo(self, scale):
        def adv(l):
            subs = []
            for y in self.path(l)[:-1]:
                if y == 0 or len(self.kids[y]) >= 2:
                    group = [self.reward[k] for k in self.leaves_under(y)]
                    subs.append(self.norm(self.reward[l], group, scale))
            return [sum(subs) / len(subs)] * (len(self.path(l)) - 1)

        return self.table(adv)

    def segment(self):
        def adv(l):
            p = self.path(l)
            return [self.value(p[d + 1]) - self.value(p[d]) for d in range(len(p) - 1)]

        return self.table(adv)

    def branch(self):
        def anchor(y):  # nearest node at or above y with >= 2 children, or the root
            while y != 0 and len(self.kids[y]) < 2:
                y = self.parent[y]
            return y

        def adv(l):
            p = self.path(l)
            return [self.reward[l] - self.value(anchor(p[d])) for d in range(len(p) - 1)]

        return self.table(adv)


@pytest.mark.parametrize("scale", [True, False])
def test_estimators_match_naive_loops_on_random_trees(scale):
    rng = np.random.default_rng(0 if scale else 1)
    for _ in range(80):
        parent, reward = random_tree(rng, int(rng.integers(2, 25)))
        ref = Naive(parent, reward)
        cases = [
            (grpo(TreeBatch(parent, reward), scale_by_std=scale), ref.grpo(scale)),
            (tree_grpo(TreeBatch(parent, reward), scale_by_std=scale), ref.tree_grpo(scale)),
            (treepo(TreeBatch(parent, reward), scale_by_std=scale), ref.treepo(scale)),
            (segment(TreeBatch(parent, reward)), ref.segment()),
            (branch(TreeBatch(parent, reward)), ref.branch()),
        ]
        for got, expected in cases:
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-9)


@pytest.fixture
def hand_tree():
    """root -> a -> {a1: 1, a2: 0}; root -> b -> b1 -> {b11: 0, b12: 0}.

    Node ids: 0 root, 1 a, 2 a1, 3 a2, 4 b, 5 b1, 6 b11, 7 b12. Leaves (rows): a1, a2, b11, b12.
    V^: root 1/4, a 1/2, b 0, b1 0.
    """
    return TreeBatch.from_paths(
        [["a", "a1"], ["a", "a2"], ["b", "b1", "b11"], ["b", "b1", "b12"]], [1, 0, 0, 0]
    )


def test_grpo_hand_worked(hand_tree):
    # mean 1/4, std sqrt(3)/4: leaf a1 gets (3/4)/(sqrt(3)/4) = sqrt(3), the others -1/sqrt(3).
    a = grpo(hand_tree)
    s3 = math.sqrt(3)
    np.testing.assert_allclose(a[:, 0], [s3, -1 / s3, -1 / s3, -1 / s3], rtol=1e-5)
    assert np.isnan(a[0, 2]) and np.isnan(a[1, 2]) and a[2, 2] == a[2, 0]
    b = grpo(hand_tree, scale_by_std=False)
    np.testing.assert_allclose(b[:, 0], [0.75, -0.25, -0.25, -0.25])


def test_tree_grpo_hand_worked(hand_tree):
    # intra: under a, {1, 0} -> +1, -1; under b, {0, 0} -> 0. inter as GRPO.
    a = tree_grpo(hand_tree, scale_by_std=False)
    np.testing.assert_allclose(a[:, 0], [0.5 + 0.75, -0.5 - 0.25, -0.25, -0.25])


def test_treepo_hand_worked(hand_tree):
    # a1: groups root (1/4) and a (1/2): mean(3/4, 1/2) = 5/8. a2: mean(-1/4, -1/2) = -3/8.
    # b11: b has one child, so only root and b1 (0): mean(-1/4, 0) = -1/8.
    a = treepo(hand_tree)
    np.testing.assert_allclose(a[:, 0], [5 / 8, -3 / 8, -1 / 8, -1 / 8])


def test_segment_hand_worked(hand_tree):
    a = segment(hand_tree)
    np.testing.assert_allclose(a[0, :2], [0.5 - 0.25, 1 - 0.5])
    np.testing.assert_allclose(a[2], [0 - 0.25, 0, 0])
    assert np.isnan(a[0, 2])


def test_branch_hand_worked(hand_tree):
    # a1 and a2: turn 1 from the root (V^ 1/4), turn 2 from a (branches, V^ 1/2). b11: turns 1
    # and 2 start below the root and at b (one child: its baseline is the root's), turn 3 at b1.
    a = branch(hand_tree)
    np.testing.assert_allclose(a[0, :2], [1 - 0.25, 1 - 0.5])
    np.testing.assert_allclose(a[1, :2], [0 - 0.25, 0 - 0.5])
    np.testing.assert_allclose(a[2], [0 - 0.25, 0 - 0.25, 0 - 0])
    assert np.isnan(a[0, 2])


def test_branch_pushes_on_a_branch_points_children_sum_to_zero():
    """Summed over the paths through a turn y, branch gives n_y (V^(y) - V^(b(y))); over the
    children of any branching node those totals cancel. On a flat group it is r - mean."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        parent, reward = random_tree(rng, int(rng.integers(3, 30)))
        a = branch(TreeBatch(parent, reward))
        ref = Naive(parent, reward)
        paths = np.array([ref.path(l) + [-1] * (a.shape[1] + 1 - len(ref.path(l)))
                          for l in ref.leaves])
        total = np.zeros(len(parent))  # per turn node: its advantage summed over its paths
        for row, path in enumerate(paths):
            for d in range(a.shape[1]):
                if path[d + 1] >= 0:
                    total[path[d + 1]] += a[row, d]
        for y in range(len(parent)):
            if len(ref.kids[y]) >= 2:
                assert abs(sum(total[c] for c in ref.kids[y])) < 1e-9
    flat = TreeBatch.from_paths([["a"], ["b"], ["c"], ["d"]], [1, 0, 0, 1])
    np.testing.assert_allclose(branch(flat),
                               grpo(flat, scale_by_std=False))


def test_branch_with_a_root_value_credits_the_shared_first_turns():
    """One bare turn a, then three continuations (1, 0, 1): with the tree's own V^(root) = 2/3 the
    shared turn a gets r - 2/3 on each path, summing to zero; with a root value of 1/2 (a
    predictor's, or the exact V) it gets r - 1/2, summing to 3 (2/3 - 1/2) = 0.5. The turns below
    a's branch point keep their baseline V^(a); a second tree keeps its own root value."""
    one = TreeBatch.from_paths([["a", "b"], ["a", "c"], ["a", "d"]], [1, 0, 1])
    plain, valued = branch(one), branch(one, np.array([0.5]))
    np.testing.assert_allclose(plain[:, 0], [1 / 3, -2 / 3, 1 / 3])
    np.testing.assert_allclose(valued[:, 0], [0.5, -0.5, 0.5])
    assert valued[:, 0].sum() == pytest.approx(3 * (2 / 3 - 1 / 2))
    np.testing.assert_allclose(valued[:, 1], plain[:, 1])  # below the branch point: V^(a)
    two = TreeBatch.concat([one, TreeBatch.from_paths([["x"], ["y"]], [1, 0])])
    both = advantages(two, "branch", root_value=np.array([0.5, 0.25]))
    np.testing.assert_allclose(both[3:, 0], [0.75, -0.25])  # tree 2: r - 1/4 (a flat group)
    with pytest.raises(ValueError, match="one finite value per tree"):
        branch(two, np.array([0.5]))
    with pytest.raises(ValueError, match="baseline of the branch estimator"):
        advantages(two, "treepo", root_value=np.array([0.5, 0.25]))


def test_all_equal_rewards_give_zero_advantage():
    tree = TreeBatch.from_paths([["a"], ["b", "c"], ["b", "d"]], [1, 1, 1])
    for name, estimator in ESTIMATORS.items():
        a = estimator(tree)
        assert np.all(a[~np.isnan(a)] == 0), name


def test_estimators_validate_the_tree():
    with pytest.raises(ValueError, match="no children"):
        grpo(TreeBatch(np.array([-1, 0, 0]), np.array([np.nan, 1.0, np.nan])))
    with pytest.raises(ValueError, match="no turns"):
        treepo(TreeBatch(np.array([-1]), np.array([1.0])))


def test_centred_makes_treepo_zero_sum_and_leaves_flat_groups_alone():
    from trace_core.advantages import centred, grpo, treepo

    # root -> a (-> a1 r=1, -> a2 r=1 continuation), root -> b (-> b1 r=0): a branched prefix.
    parent = np.array([-1, 0, 1, 1, 0, 4])
    reward = np.array([np.nan, np.nan, 1.0, 1.0, np.nan, 0.0])
    a = treepo(TreeBatch(parent, reward))
    assert np.nansum(a[:, 0]) != pytest.approx(0.0)  # treepo is not zero-sum here
    c = centred(TreeBatch(parent, reward), a)
    assert np.nansum(np.nanmean(c, axis=1)) == pytest.approx(0.0)
    assert np.allclose(c - a, (c - a)[0, 0], equal_nan=True)  # one shift for the whole tree
    flat = np.array([-1, 0, 0, 0])
    r = np.array([np.nan, 1.0, 0.0, 0.0])
    flat = TreeBatch(flat, r)
    assert np.allclose(centred(flat, treepo(flat)), treepo(flat))
    assert np.allclose(centred(flat, grpo(flat)), grpo(flat))


def test_per_node_counts_each_sampled_turn_once():
    from trace_core.advantages import per_node

    # root -> a (-> a1 r=1, -> a2 r=0, -> a3 r=0: a prefix continued twice), root -> b (r=1).
    parent = np.array([-1, 0, 1, 1, 1, 0])
    reward = np.array([np.nan, np.nan, 1.0, 0.0, 0.0, 1.0])
    a = branch(TreeBatch(parent, reward))  # V^(root) = 0.5, V^(a) = 1/3
    w = per_node(TreeBatch(parent, reward), a)
    # The turn "a" lies on three paths: each push is a third, and together they give
    # V^(a) - V^(root), the turn's own advantage, once.
    assert np.allclose(w[:3, 0], a[:3, 0] / 3)
    assert w[:3, 0].sum() == pytest.approx(1 / 3 - 0.5)
    # Turns on one path (the continuations, the bare rollout "b") keep their advantage.
    np.testing.assert_allclose(w[:3, 1], a[:3, 1])
    assert w[3, 0] == a[3, 0] == pytest.approx(0.5)
    assert np.isnan(w[3, 1])


def test_per_node_sums_to_the_mean_push_on_random_trees_and_leaves_flat_groups_alone():
    from trace_core.advantages import per_node
    from trace_core.tree import backup, root_to_leaf_paths

    rng = np.random.default_rng(5)
    for _ in range(40):
        parent, reward = random_tree(rng, int(rng.integers(3, 14)))
        a = branch(TreeBatch(parent, reward))
        w = per_node(TreeBatch(parent, reward), a)
        turns = root_to_leaf_paths(parent)[:, 1:]
        _, n = backup(parent, reward)
        for y in np.unique(turns[turns >= 0]):
            on = turns == y
            assert on.sum() == n[y]
            assert w[on].sum() == pytest.approx(a[on].mean())
    flat = TreeBatch.from_paths([["a", "b"], ["c"], ["d", "e"]], [1, 0, 0])
    a = branch(flat)
    np.testing.assert_array_equal(per_node(flat, a), a)
    with pytest.raises(ValueError, match="do not match"):
        per_node(flat, a[:, :1])


# ----------------------------------------------------------------- a batch of trees


def test_estimators_on_a_batch_of_two_trees_hand_worked():
    """Tree 0: root -> a -> {b: 1, c: 0}; root -> d: 1. Tree 1: root -> x -> y -> z: 0. Each
    tree is its own group; the output has the batch's depth, 3."""
    trees = TreeBatch.concat([TreeBatch.from_paths([["a", "b"], ["a", "c"], ["d"]], [1, 0, 1]),
                              TreeBatch.from_paths([["x", "y", "z"]], [0])])
    a = branch(trees)  # V^: root 2/3, a 1/2; tree 1 all 0
    nan = np.nan
    np.testing.assert_allclose(a, [[1 / 3, 1 / 2, nan], [-2 / 3, -1 / 2, nan], [1 / 3, nan, nan],
                                   [0, 0, 0]])
    g = grpo(trees, scale_by_std=False)  # tree 0's mean 2/3, tree 1's 0
    np.testing.assert_allclose(g[:, 0], [1 / 3, -2 / 3, 1 / 3, 0])
    w = advantages(trees, "branch", turns_once=True)  # turn a lies on two paths
    np.testing.assert_allclose(w[:2, 0], [1 / 6, -1 / 3])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5), st.booleans(),
       st.booleans())
def test_batched_estimators_equal_each_tree_alone(seeds, centre, turns_once):
    trees = [random_tree(np.random.default_rng(s), 2 + s % 13) for s in seeds]
    batch = TreeBatch.concat([TreeBatch(p, r) for p, r in trees])
    for name in ESTIMATORS:
        got = advantages(batch, name, centre=centre, turns_once=turns_once)
        alone = [advantages(TreeBatch(p, r), name, centre=centre, turns_once=turns_once)
                 for p, r in trees]
        want = np.concatenate([np.pad(a, ((0, 0), (0, got.shape[1] - a.shape[1])),
                                      constant_values=np.nan) for a in alone])
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12, err_msg=name)
