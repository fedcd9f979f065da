"""The pure pieces of a step that the train flow's tasks call: the phase seeds (the numbers every
stored tree was grown with), Stage 1's choice of values, Stage 2 whatever the allocator, and the
policy update's path advantages, checked by hand and against the loops they replaced."""

import numpy as np
import pytest

from trace_core import advantages as adv
from trace_core.allocators import (AllocatorConfig, Budget, PrefixSet, RootPool,
                                   allocate_per_tree, make_allocator)
from trace_core.posterior import PromptPosterior, oracle_values, root_values
from trace_core.seeds import Phase, phase_rng, rollout_seed, update_seed
from trace_core.tree import NO_PARENT, TreeBatch
from trace_core.waves import continuations, split_jointly


def test_phase_streams_keep_the_numbers_the_stored_trees_were_grown_with():
    assert [int(p) for p in Phase] == [1, 2, 3, 4, 5]
    for phase in Phase:
        want = np.random.default_rng([7, 3, int(phase)]).random(4)
        np.testing.assert_array_equal(phase_rng(7, 3, phase).random(4), want)
    assert rollout_seed(7, 3, 0, 2) == 7 * 100_003 + 3 * 17 + 0 + 7919 * 2
    assert rollout_seed(7, 3, 1) == 7 * 100_003 + 3 * 17 + 1
    assert update_seed(7, 3) == 7 * 7919 + 3


def test_root_values_pick_text_posterior_or_oracle():
    text = np.array([0.2, 0.6, 0.5])
    ids, seen = ["a", "b", "c"], ["a", "z"]
    s, n = np.array([3.0, 1.0]), np.array([4.0, 2.0])
    np.testing.assert_array_equal(root_values(text, ids, seen, s, n), text)
    posterior = PromptPosterior(2.0)
    posterior.update(seen, s, n)
    np.testing.assert_allclose(root_values(text, ids, seen, s, n, strength=2.0),
                               posterior.predict(ids, text))
    assert root_values(text, ids, seen, s, n, strength=2.0)[0] == pytest.approx((3 + 0.4) / 6)
    o, seen_o = np.array([0.5, 1.0, 0.25]), np.array([0.8, 0.5])
    # c = 4 successes over 0.8 x 4 + 0.5 x 2 = 4.2 o-weighted rollouts
    np.testing.assert_allclose(root_values(text, ids, seen, s, n, strength=2.0, oracle=o,
                                           seen_oracle=seen_o), np.clip(4 / 4.2 * o, 0, 1))
    # before any rollout: the text predictions' mean against the oracle's
    np.testing.assert_allclose(oracle_values(text, o, np.zeros(0), np.zeros(0), np.zeros(0)),
                               np.clip(np.mean(text) / np.mean(o) * o, 0, 1))


def _knobs(**changes) -> AllocatorConfig:
    base = dict(group_size=2, tree_group=2, min_per_root=2, max_per_root=8, exploration=0.0,
                branch_from_root=True, joint_split=False)
    return AllocatorConfig(**{**base, **changes})


def test_continuations_are_the_per_tree_or_the_joint_stage_two():
    prefixes = PrefixSet(predicted=np.array([0.5, 0.9, 0.5, 0.1]),
                         observed=np.array([1.0, 0.0, 0.0, 1.0]),
                         correlation=np.zeros(4), seen=np.ones(4, np.int64))
    tree, depth, bare = np.array([0, 0, 1, 1]), np.array([1, 1, 1, 2]), np.array([2, 2, 2, 2])
    pool = RootPool(predicted=np.full(4, 0.5), staleness=np.zeros(4))
    counts, budget = np.array([2, 2, 0, 0]), Budget(roots=4, multiplier=1)
    per_tree = make_allocator("trace", _knobs())
    k, m = continuations(per_tree, prefixes, tree, depth, bare, pool, counts, budget,
                         np.random.default_rng(0))
    want = allocate_per_tree(per_tree, tree, prefixes, depth, bare, budget,
                             np.random.default_rng(0))
    assert k.tolist() == want.tolist() and m.tolist() == [0, 0, 0, 0]
    joint = make_allocator("trace", _knobs(joint_split=True))
    k, m = continuations(joint, prefixes, tree, depth, bare, pool, counts, budget,
                         np.random.default_rng(0))
    m_ref, k_ref = split_jointly(joint, prefixes, pool, counts, budget.total - 4,
                                 np.random.default_rng(0))
    assert k.tolist() == k_ref.tolist() and m.tolist() == m_ref.tolist()
    assert k.sum() + m.sum() == budget.total - 4 and m[:2].tolist() == [0, 0]


def test_path_advantages_by_hand():
    """Tree 0: a root alone (nothing to train). Tree 1: root -> a -> (leaf 1.0, leaf 0.0) and
    root -> leaf 0.0; ``grpo`` gives each path its leaf's reward less the tree's mean 1/3."""
    trees = TreeBatch(parent=[NO_PARENT, NO_PARENT, 0, 1, 1, 0],
                      reward=[np.nan, np.nan, np.nan, 1.0, 0.0, 0.0], offsets=[0, 1, 6])
    a = adv.path_advantages(trees, "grpo")
    want = adv.advantages(trees.select([1]), "grpo")
    assert a.ends.tolist() == [3, 6, 8] and a.turn_ends.tolist() == [2, 4, 5]
    assert a.rows.tolist() == [1, 2, 3, 1, 2, 4, 1, 5]
    np.testing.assert_allclose(a.turn_advantages, want[~np.isnan(want)])
    # node a lies on two paths: the mean of their advantages; the leaves on one each
    assert a.nodes.tolist() == [2, 3, 4, 5]
    np.testing.assert_allclose(a.node_mean, [np.mean(want[:2, 0]), want[0, 1], want[1, 1],
                                             want[2, 0]])
