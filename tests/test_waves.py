"""trace_core.waves: a wave's outcome counts, DAPO's refill waves and the joint split, as pure
functions (hand-worked cases, a naive loop as reference, invariants on random cases)."""

import numpy as np
import pytest

from trace_core.allocators import AllocatorConfig, Budget, PrefixSet, RootPool, make_allocator
from trace_core.waves import outcome_counts, refill_wave, split_jointly


def knobs(**changes) -> AllocatorConfig:
    base = dict(group_size=2, tree_group=2, min_per_root=2, max_per_root=8, exploration=0.0,
                branch_from_root=True, joint_split=False)
    return AllocatorConfig(**{**base, **changes})


def _naive_counts(tree_id, reward, is_leaf, pool_size, offset):
    counts, mixed = [0] * pool_size, [False] * pool_size
    for p in range(pool_size):
        rs = [r for t, r, leaf in zip(tree_id, reward, is_leaf) if leaf and t - offset == p]
        counts[p] = len(rs)
        mixed[p] = 0 < sum(rs) < len(rs)
    return counts, mixed


def test_outcome_counts_by_hand():
    # wave 1 of a pool of 3: trees 3, 4 (4 has two leaves, one success), tree 5 absent
    tree = [3, 3, 4, 4, 4, 3]
    reward = [np.nan, 1.0, np.nan, 0.0, 1.0, 1.0]  # non-leaves carry no reward
    leaf = [False, True, False, True, True, True]
    counts, mixed = outcome_counts(tree, reward, leaf, 3, offset=3)
    assert counts.tolist() == [2, 2, 0] and mixed.tolist() == [False, True, False]


def test_outcome_counts_refuses_a_tree_outside_the_wave():
    with pytest.raises(ValueError, match="not in this wave's range 4..7"):
        outcome_counts([2], [1.0], [True], 4, offset=4)


def test_outcome_counts_matches_a_naive_loop():
    rng = np.random.default_rng(0)
    for _ in range(50):
        pool, offset, n = int(rng.integers(1, 8)), int(rng.integers(0, 3)) * 8, int(rng.integers(0, 40))
        tree = (rng.integers(0, pool, n) + offset).tolist()
        leaf = rng.random(n) < 0.6
        reward = np.where(leaf, rng.integers(0, 2, n), np.nan).tolist()
        counts, mixed = outcome_counts(tree, reward, leaf.tolist(), pool, offset)
        assert (counts.tolist(), mixed.tolist()) == _naive_counts(tree, reward, leaf, pool, offset)
        assert counts.sum() == leaf.sum()


def test_refill_waves_spend_at_most_the_root_budget_and_stop():
    """DAPO refills fresh prompts until its target of mixed groups is met or leaves run out; the
    waves never exceed the budget and never revisit a prompt."""
    pool = RootPool(predicted=np.full(40, 0.5), staleness=np.zeros(40))
    budget = Budget(roots=8, multiplier=2)  # 24 leaves
    dapo = make_allocator("dapo", knobs(group_size=4, dapo_batch_groups=3))
    rng = np.random.default_rng(1)
    counts = dapo.allocate_roots(pool, dapo.root_leaves(budget), rng)
    mixed = np.zeros(40, dtype=bool)  # nothing mixed: every wave must ask for more
    waves = 1
    while (extra := refill_wave(dapo, pool, counts, mixed, budget, rng)) is not None:
        assert not np.any((extra > 0) & (counts > 0))  # fresh prompts only
        counts, waves = counts + extra, waves + 1
    assert counts.sum() == budget.total and waves == 2  # 12 + 12 leaves: the budget is spent
    mixed[np.flatnonzero(counts)[:3]] = True  # the target met: no refill, though leaves are left
    assert refill_wave(dapo, pool, counts, mixed, Budget(roots=40, multiplier=2), rng) is None
    mixed[np.flatnonzero(counts)[2]] = False  # one short: a wave of one group
    extra = refill_wave(dapo, pool, counts, mixed, Budget(roots=40, multiplier=2), rng)
    assert extra is not None and extra.sum() == 4


def test_no_refill_for_methods_without_one():
    pool = RootPool(predicted=np.full(8, 0.5), staleness=np.zeros(8))
    for name in ("grpo", "trace", "prompt_only", "random_prefix"):
        assert refill_wave(make_allocator(name, knobs()), pool, np.zeros(8, np.int64),
                           np.zeros(8, bool), Budget(4, 1), np.random.default_rng(0)) is None


def test_split_jointly_skips_nan_prefixes_and_rolled_out_prompts():
    trace = make_allocator("trace", knobs(joint_split=True))
    prefixes = PrefixSet(predicted=np.array([0.5, 0.9, 0.5, 0.1]),
                         observed=np.array([1.0, np.nan, 0.0, 1.0]),
                         correlation=np.zeros(4), seen=np.ones(4, np.int64))
    pool = RootPool(predicted=np.array([0.5, 0.5, 0.5, 0.5]), staleness=np.zeros(4))
    counts = np.array([2, 0, 2, 0])
    m, k = split_jointly(trace, prefixes, pool, counts, 6, np.random.default_rng(0))
    assert m.sum() + k.sum() == 6  # every leaf spent
    assert k[1] == 0 and m[0] == 0 and m[2] == 0  # NaN prefix, prompts already rolled out
    # the same split, computed by the allocator on the usable parts directly
    usable = [0, 2, 3]
    part = PrefixSet(predicted=prefixes.predicted[usable], observed=prefixes.observed[usable],
                     correlation=np.zeros(3), seen=np.ones(3, np.int64))
    fresh = RootPool(predicted=pool.predicted[[1, 3]], staleness=np.zeros(2))
    m_ref, k_ref = trace.allocate_joint(part, fresh, 6, np.random.default_rng(0))
    assert m[[1, 3]].tolist() == list(m_ref) and k[usable].tolist() == list(k_ref)
