"""trace_core.coverage (allocator=trace_cover): the tree value, the exact solver against
exhaustive search, and the allocator's coverage floor."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from trace_core.allocation import root_gain
from trace_core.allocators import AllocatorConfig, Budget, RootPool, make_allocator
from trace_core.coverage import allocate_cover, min_bare, tree_gain, tree_objective

CFG = AllocatorConfig(group_size=4, tree_group=2, min_per_root=2, max_per_root=None,
                      exploration=0.0, branch_from_root=True, joint_split=False, multiplier=2)


def test_tree_gain_counts_the_continuations():
    # v = 1/2, N = 2, independence: a tree of one bare rollout is 3 draws, mixed w.p. 3/4; the
    # 2nd and 3rd bare rollouts add 0.22 and 0.03 (the figures that motivated it)
    g = tree_gain(np.full(4, 0.5), np.arange(4), 2)
    np.testing.assert_allclose(g, [0.0, 0.75, 1 - 2 / 64, 1 - 2 / 512])
    assert np.diff(g)[1] == pytest.approx(0.21875) and np.diff(g)[2] == pytest.approx(0.02734375)
    # with correlation it is the Beta-binomial g at m (1 + N) draws; N = 0 is Stage 1's g
    v = np.array([0.1, 0.3, 0.8])
    m = np.array([1, 2, 3])
    np.testing.assert_allclose(tree_gain(v, m, 3, 0.4), root_gain(v, 4 * m, 0.4))
    np.testing.assert_allclose(tree_gain(v, m, 0, 0.4), root_gain(v, m, 0.4))
    assert tree_gain(np.array([0.3]), np.array([1]), 0)[0] == 0.0  # one rollout alone: never mixed


def _exhaustive(v, budget, n_mult, floor, lo, caps, rho):
    """Best objective over every feasible allocation: m_i in {0} U [lo, cap_i], the largest total
    <= budget reachable with at least the (clamped) floor of active prompts."""
    floor = min(floor, int(np.sum(caps >= lo)), budget // lo)
    options = [[0] + list(range(lo, min(int(c), budget) + 1)) for c in caps]
    best_total, best_value = -1, -np.inf
    for m in itertools.product(*options):
        total, active = sum(m), sum(x > 0 for x in m)
        if total > budget or active < floor:
            continue
        value = tree_objective(v, np.array(m), n_mult, rho)
        if total > best_total or (total == best_total and value > best_value):
            best_total, best_value = total, value
    return best_total, best_value, floor


def test_exact_against_exhaustive_search():
    rng = np.random.default_rng(47)
    checked = 0
    for _ in range(400):
        n = int(rng.integers(1, 6))
        v = rng.choice([0.0, 1.0, 0.5, 0.05, 0.95], size=n) if rng.random() < 0.25 else rng.random(n)
        budget = int(rng.integers(0, 10))
        n_mult = int(rng.integers(0, 4))
        lo = min_bare(n_mult, 2)
        caps = (np.full(n, 10) if rng.random() < 0.5
                else rng.integers(lo, 6, size=n))
        floor = int(rng.integers(0, n + 2))
        rho = float(rng.choice([0.0, 0.3, 0.7]))
        m = allocate_cover(v, budget, multiplier=n_mult, min_active=floor, min_per_root=2,
                           max_per_root=caps, correlation=rho)
        total, value, clamped = _exhaustive(v, budget, n_mult, floor, lo, caps, rho)
        if total < 0:
            assert m.sum() == 0
            continue
        assert np.all((m == 0) | ((m >= lo) & (m <= caps))), (m, lo, caps)
        assert int(m.sum()) == total, (m, total, v, budget, n_mult, caps)
        assert np.count_nonzero(m) >= clamped
        assert tree_objective(v, m, n_mult, rho) == pytest.approx(value, abs=1e-12)
        checked += 1
    assert checked > 300


def test_one_rollout_per_prompt_when_continuations_follow():
    v = np.full(16, 0.5)
    # N = 2: 16 bare rollouts on 16 prompts (0.75 each) beat 8 pairs (0.97 each)
    np.testing.assert_array_equal(allocate_cover(v, 16, multiplier=2), np.ones(16, np.int64))
    # N = 0: one rollout is worthless, pairs it is
    m0 = allocate_cover(v, 16, multiplier=0)
    assert m0.sum() == 16 and m0[m0 > 0].min() == 2


def test_the_floor_forces_coverage_and_yields_to_the_budget():
    v = np.array([0.5, 0.5, 0.02, 0.03, 0.04])
    free = allocate_cover(v, 4, multiplier=2)
    assert np.count_nonzero(free) == 2  # the near-certain prompts are not worth a rollout
    forced = allocate_cover(v, 4, multiplier=2, min_active=4)
    assert np.count_nonzero(forced) == 4 and forced.sum() == 4
    assert np.count_nonzero(allocate_cover(v, 3, multiplier=2, min_active=9)) == 3


def _pool(v):
    v = np.asarray(v, np.float64)
    return RootPool(predicted=v, staleness=np.zeros(len(v)))


def test_allocator_never_covers_fewer_prompts_than_grpo():
    alloc = make_allocator("trace_cover", CFG)
    rng = np.random.default_rng(0)
    budget = Budget(roots=16, multiplier=2)  # 48 leaves: GRPO covers 12 prompts
    # a spread of predictions: the paper's Stage 1 puts 16 rollouts on few prompts
    v = np.concatenate([np.full(4, 0.5), np.linspace(0.1, 0.3, 28)])
    m = alloc.allocate_roots(_pool(v), alloc.root_leaves(budget), rng)
    assert m.sum() == 16 and np.count_nonzero(m) >= 12
    paper = make_allocator("trace", CFG).allocate_roots(_pool(v), 16, rng)
    assert np.count_nonzero(paper) < 12  # what the floor is there for
    # prompts predicted outside [eps, 1 - eps] do not count toward the floor
    v2 = np.concatenate([np.full(3, 0.5), np.full(29, 0.0)])
    m2 = alloc.allocate_roots(_pool(v2), 16, rng)
    assert np.count_nonzero(m2) == 3 and m2.sum() == 16
    # Stage 2: the same continuations per bare rollout as trace
    assert alloc.tree_leaves(1, budget) == 2 and alloc.branches_from_root


def test_allocator_needs_the_multiplier():
    alloc = make_allocator("trace_cover", replace(CFG, multiplier=None))
    with pytest.raises(ValueError, match="multiplier"):
        alloc.allocate_roots(_pool([0.5, 0.5]), 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match="cover_eps"):
        replace(CFG, cover_eps=0.5)


def test_allocator_name_works_from_the_config_edge():
    from trace_rl.config import load_config

    cfg = load_config(None, ["allocator=trace_cover"])
    assert cfg.allocator == "trace_cover" and cfg.allocator_config.multiplier == cfg.multiplier
    alloc = make_allocator(cfg.allocator, cfg.allocator_config)
    v = np.linspace(0.2, 0.8, cfg.pool_size)
    m = alloc.allocate_roots(_pool(v), alloc.root_leaves(cfg.budget), np.random.default_rng(0))
    assert m.sum() == cfg.root_budget
    assert np.count_nonzero(m) >= cfg.leaf_budget // cfg.group_size
