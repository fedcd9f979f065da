"""trace_core.waves: a wave's outcome counts, DAPO's refill waves and the joint split, as pure
functions (hand-worked cases, a naive loop as reference, invariants on random cases)."""

import numpy as np
import pytest

from trace_core.allocators import AllocatorConfig, Budget, LeafLedger, PrefixSet, RootPool, make_allocator
from trace_core.tree import TreeBatch
from trace_core.waves import outcome_counts, refill_wave, root_waves, split_jointly


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


def _grower(win):
    """A root stage's ``roll`` on a ``TreeBatch``: one-turn rollouts, the i-th of the step a
    success when ``win(i)``; returns it and what it saw."""
    seen = {"trees": TreeBatch.empty(), "opened": [], "rolled": 0}

    def roll(opened, trees):
        seen["opened"] += opened
        t = seen["trees"].with_new_trees(len(opened))
        reward = [float(win(seen["rolled"] + i)) for i in range(len(trees))]
        seen["rolled"] += len(trees)
        seen["trees"] = t.grow(t.roots[trees], np.ones(len(trees), np.int64), reward)[0]
        return seen["trees"]
    return roll, seen


def test_root_waves_grow_one_tree_per_candidate_until_dapo_is_satisfied():
    """The simulators' root stage: each wave hangs its bare rollouts below the roots of the same
    trees (a candidate's tree opened at its first wave); a candidate whose bare rollouts split
    counts as mixed, and DAPO refills until 3 groups are mixed or the root budget is spent."""
    pool = RootPool(predicted=np.full(40, 0.5), staleness=np.zeros(40))
    budget = Budget(roots=16, multiplier=2)  # 48 leaves: waves of up to 3 groups of 4
    dapo = make_allocator("dapo", knobs(group_size=4, dapo_batch_groups=3))
    roll, seen = _grower(lambda i: i % 3 == 0)  # every group of 4 mixed: one wave
    ledger = LeafLedger(budget.total)
    counts, order = root_waves(dapo, pool, budget, np.random.default_rng(0), roll, ledger, "dapo")
    assert order == seen["opened"] == list(np.flatnonzero(counts))
    assert ledger.spent == counts.sum() == 12
    assert seen["trees"].bare_outcomes()[0].tolist() == [4, 4, 4]
    assert seen["trees"].bare_outcomes()[1].tolist() == [2, 1, 1]
    roll, seen = _grower(lambda i: False)  # nothing mixed: fresh prompts until the budget is spent
    counts, order = root_waves(dapo, pool, budget, np.random.default_rng(0), roll,
                               LeafLedger(budget.total), "dapo")
    assert counts.sum() == budget.total and len(order) == 12 == len(set(order))
    assert sorted(order) == list(np.flatnonzero(counts))
    assert seen["trees"].bare_outcomes()[0].tolist() == [4] * 12


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
