"""trace_core.allocators: one interface, equal leaf budgets, each method's defining behaviour."""

import numpy as np
import pytest

from trace_core.allocation import allocate_prefixes, allocate_roots, explore
from trace_core.allocators import (
    ALLOCATORS,
    AllocatorConfig,
    Budget,
    LeafLedger,
    PrefixSet,
    RootPool,
    make_allocator,
)


def knobs(**changes) -> AllocatorConfig:
    """Allocator knobs for these tests (the simulation benchmark's), with ``changes``."""
    base = dict(group_size=8, tree_group=4, min_per_root=2, max_per_root=None, exploration=0.003,
                branch_from_root=True, joint_split=False, multiplier=2)
    return AllocatorConfig(**{**base, **changes})


def _pool(n=40, seed=0, stale=0.0):
    rng = np.random.default_rng(seed)
    v = rng.random(n)
    return RootPool(predicted=np.clip(v + rng.normal(0, 0.1, n), 0, 1), staleness=np.full(n, stale), true_value=v)


def _prefixes(k=7, seed=0):
    rng = np.random.default_rng(seed)
    v = rng.random(k)
    return PrefixSet(predicted=np.clip(v + 0.05, 0, 1), observed=rng.integers(0, 2, k).astype(float), true_value=v)


def test_registry_and_config_edge():
    assert set(ALLOCATORS) == {"grpo", "dapo", "prompt_only", "random_prefix", "trace", "trace_cover",
                              "oracle"}
    for name in ALLOCATORS:
        assert make_allocator(name, knobs()).name == name
    with pytest.raises(ValueError, match="unknown allocator 'ppo'"):
        make_allocator("ppo", knobs())
    with pytest.raises(ValueError, match="group_size"):
        knobs(group_size=1)


def test_budget_and_ledger():
    b = Budget(roots=128, multiplier=2)
    assert b.total == 384
    with pytest.raises(ValueError, match="roots"):
        Budget(roots=1, multiplier=2)
    ledger = LeafLedger(10)
    ledger.spend(7, "roots")
    assert ledger.left == 3
    with pytest.raises(ValueError, match="prefixes asks for 4 leaves but 3 of 10"):
        ledger.spend(4, "prefixes")


@pytest.mark.parametrize("name", sorted(set(ALLOCATORS) - {"dapo"}))
def test_every_method_spends_the_equal_leaf_budget(name):
    """Root leaves plus tree leaves add up to Budget.total (DAPO spends by waves: tested below)."""
    budget = Budget(roots=24, multiplier=2)
    alloc = make_allocator(name, knobs())
    pool = _pool(n=200)
    rng = np.random.default_rng(1)
    counts = alloc.allocate_roots(pool, alloc.root_leaves(budget), rng)
    assert counts.shape == (pool.size,) and counts.dtype.kind == "i"
    floor = 1 if name == "trace_cover" else 2  # trace_cover: one bare rollout when N >= 1
    assert np.all((counts == 0) | (counts >= floor))
    tree = sum(alloc.tree_leaves(int(m), budget) for m in counts[counts > 0])
    assert int(counts.sum()) + tree == budget.total


def test_grpo_is_uniform():
    alloc = make_allocator("grpo", knobs(group_size=8))
    counts = alloc.allocate_roots(_pool(100), 384, np.random.default_rng(0))
    assert sorted(counts[counts > 0]) == [8] * 48
    assert alloc.tree_leaves(8, Budget(128, 2)) == 0
    # A remainder of at least 2 becomes one smaller group; the budget is still spent.
    counts = alloc.allocate_roots(_pool(100), 29, np.random.default_rng(0))
    assert sorted(counts[counts > 0]) == [5, 8, 8, 8]
    with pytest.raises(ValueError, match="pool of 3 prompts is too small"):
        alloc.allocate_roots(_pool(3), 384, np.random.default_rng(0))


def test_dapo_first_wave_is_half_the_affordable_groups_by_default():
    alloc = make_allocator("dapo", knobs(group_size=8))
    counts = alloc.allocate_roots(_pool(100), 384, np.random.default_rng(0))
    assert sorted(counts[counts > 0]) == [8] * 24


def test_dapo_refills_missing_mixed_groups_with_fresh_prompts():
    alloc = make_allocator("dapo", knobs(group_size=4, dapo_batch_groups=3))
    pool = _pool(50)
    rng = np.random.default_rng(0)
    counts = alloc.allocate_roots(pool, 40, rng)
    assert sorted(counts[counts > 0]) == [4, 4, 4]
    mixed = np.zeros(pool.size, dtype=bool)
    mixed[np.flatnonzero(counts)[0]] = True  # one of three groups was mixed: two are missing
    extra = alloc.refill(pool, counts, mixed, 40 - int(counts.sum()), rng)
    assert sorted(extra[extra > 0]) == [4, 4]
    assert not np.any((extra > 0) & (counts > 0))  # fresh prompts only
    counts = counts + extra
    mixed[np.flatnonzero(extra)] = True
    assert alloc.refill(pool, counts, mixed, 20, rng) is None  # target met
    mixed[np.flatnonzero(extra)] = False
    last = alloc.refill(pool, counts, mixed, 6, rng)  # 2 missing, 6 leaves left: groups of 4 and 2
    assert last is not None and int(last.sum()) == 6
    assert alloc.refill(pool, counts, mixed, 1, rng) is None  # no room for a group


def test_prompt_only_and_trace_use_the_exact_solver_on_explored_predictions():
    cfg = knobs(exploration=0.2)
    pool = _pool(60, stale=3.0)
    explored = explore(pool.predicted, pool.staleness, strength=0.2)
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(
        make_allocator("prompt_only", cfg).allocate_roots(pool, 300, rng), allocate_roots(explored, 300)
    )
    trace = make_allocator("trace", cfg)
    np.testing.assert_array_equal(trace.allocate_roots(pool, 40, rng), allocate_roots(explored, 40))
    assert trace.root_leaves(Budget(40, 3)) == 40 and trace.tree_leaves(5, Budget(40, 3)) == 15
    pre = _prefixes()
    np.testing.assert_array_equal(
        trace.allocate_prefixes(pre, 11, rng), allocate_prefixes(pre.predicted, pre.observed, 11)
    )


def test_oracle_uses_the_true_value_and_needs_it():
    oracle = make_allocator("oracle", knobs())
    pool, pre = _pool(60), _prefixes()
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(oracle.allocate_roots(pool, 40, rng), allocate_roots(pool.true_value, 40))
    np.testing.assert_array_equal(
        oracle.allocate_prefixes(pre, 9, rng), allocate_prefixes(pre.true_value, pre.observed, 9)
    )
    with pytest.raises(ValueError, match="true_value is required"):
        oracle.allocate_roots(RootPool(pool.predicted, pool.staleness), 40, rng)
    with pytest.raises(ValueError, match="true_value is required"):
        oracle.allocate_prefixes(PrefixSet(pre.predicted, pre.observed), 9, rng)


def test_exploration_revives_a_prompt_called_certain():
    """With the explore rule a long-unsampled prompt predicted at 0.01 gets rollouts; without it, not."""
    pred = np.array([0.01, 0.2, 0.2, 0.2])
    pool = RootPool(predicted=pred, staleness=np.array([100.0, 0.0, 0.0, 0.0]))
    rng = np.random.default_rng(0)
    off = make_allocator("trace", knobs(exploration=0.0)).allocate_roots(pool, 6, rng)
    on = make_allocator("trace", knobs(exploration=0.05)).allocate_roots(pool, 6, rng)
    assert off[0] == 0 and on[0] >= 2


def test_random_prefix_is_uniform_over_roots_and_branch_points():
    alloc = make_allocator("random_prefix", knobs(tree_group=4))
    rng = np.random.default_rng(0)
    counts = alloc.allocate_roots(_pool(100), 128, rng)
    assert sorted(counts[counts > 0]) == [4] * 32
    pre = _prefixes(k=5)
    total = np.zeros(5)
    for _ in range(400):
        k = alloc.allocate_prefixes(pre, 8, rng)
        assert k.sum() == 8
        total += k
    np.testing.assert_allclose(total / total.sum(), 0.2, atol=0.03)  # ignores the predictions
    with pytest.raises(ValueError, match="no prefixes"):
        alloc.allocate_prefixes(PrefixSet(np.zeros(0), np.zeros(0)), 4, rng)


def test_pool_and_prefix_shapes_are_checked():
    with pytest.raises(ValueError, match="equal length"):
        RootPool(predicted=np.zeros(3), staleness=np.zeros(2))
    with pytest.raises(ValueError, match="true_value"):
        PrefixSet(predicted=np.zeros(3), observed=np.zeros(3), true_value=np.zeros(2))


def test_candidates_list_the_bare_rollouts_prefixes_and_the_agreeing_root():
    from trace_core.tree import TreeBatch

    # root 0; bare rollout A: 0 -> 1 -> 2 (leaf, r = 1); bare rollout B: 0 -> 3 (leaf, r = 1);
    # a continuation 1 -> 4 (leaf, r = 0) is not a bare rollout and adds no candidate
    parent = [-1, 0, 1, 0, 1]
    level = [0, 0, 0, 0, 1]
    tree = TreeBatch(parent, [np.nan, np.nan, 1.0, 1.0, 0.0], level=level)
    nodes, observed = tree.candidates(from_root=False)
    assert nodes.tolist() == [1] and observed.tolist() == [1.0]
    nodes, observed = tree.candidates(from_root=True)
    assert nodes.tolist() == [1, 0] and observed.tolist() == [1.0, 1.0]
    # bare outcomes that disagree: the root is not offered
    mixed = TreeBatch(parent, [np.nan, np.nan, 1.0, 0.0, 0.0], level=level)
    assert mixed.candidates(from_root=True)[0].tolist() == [1]
    # no prefix at depth >= 1 (every bare rollout ended on its first turn): the root alone, its
    # observed outcome the shared one (NaN when the rollouts disagree)
    nodes, observed = TreeBatch([-1, 0, 0], [np.nan, 0.0, 0.0]).candidates(from_root=False)
    assert nodes.tolist() == [0] and observed.tolist() == [0.0]
    _, observed = TreeBatch([-1, 0, 0], [np.nan, 0.0, 1.0]).candidates(from_root=True)
    assert np.isnan(observed).all()


def test_allocate_per_tree_spends_each_trees_own_budget():
    from trace_core.allocators import Trace, allocate_per_tree

    # tree 7: its root alone (no prefix); tree 3: two prefixes; tree 5: bare 0, nothing to spend
    tree = np.array([7, 3, 3, 5])
    depth = np.array([0, 1, 2, 1])
    bare = np.array([2, 3, 3, 0])
    prefixes = PrefixSet(predicted=np.array([0.5, 0.9, 0.2, 0.5]),
                         observed=np.array([np.nan, 1.0, 0.0, 1.0]))
    budget = Budget(roots=4, multiplier=2)
    k = allocate_per_tree(Trace(knobs()), tree, prefixes, depth, bare, budget,
                          np.random.default_rng(0))
    assert k[0] == 4 and k[1:3].sum() == 6 and k[3] == 0
