"""trace_core.allocation: both solvers against exhaustive search, hand-worked cases, invariants,
input validation, and the exploration rule."""

import itertools

import numpy as np
import pytest

import trace_core.allocation as alloc
from trace_core.allocation import (
    allocate_joint,
    allocate_prefixes,
    allocate_roots,
    explore,
    max_spendable_roots,
    prefix_objective,
    root_gain,
    root_objective,
)


def brute_roots(v, budget, lo, caps):
    """(spent, best value) over every m with m_i in {0} U [lo, caps_i], maximising the spent
    total first (<= budget) and then the objective."""
    best = (-1, -np.inf)
    for m in itertools.product(*[[0, *range(lo, int(c) + 1)] for c in caps]):
        spent = sum(m)
        if spent <= budget:
            best = max(best, (spent, root_objective(v, np.array(m))))
    return best


def brute_prefixes(p, observed, budget, caps):
    best = (-1, -np.inf)
    for k in itertools.product(*[range(int(c) + 1) for c in caps]):
        spent = sum(k)
        if spent <= budget:
            best = max(best, (spent, prefix_objective(p, observed, np.array(k))))
    return best


def random_probabilities(rng, n):
    """Continuous values, or values drawn from a small set so that exact 0, 1 and ties occur."""
    kind = rng.integers(3)
    if kind == 0:
        return rng.random(n)
    if kind == 1:
        return rng.choice([0.0, 1.0, 0.5, 0.3, 0.7, 0.1], size=n)
    return np.round(rng.random(n), 1)


def random_root_case(rng):
    n = int(rng.integers(1, 6))
    lo = int(rng.integers(1, 4))
    budget = int(rng.integers(0, 13))
    mode = rng.integers(3)
    if mode == 0:
        cap, caps = None, [max(budget, lo)] * n  # uncapped: no prompt can use more than budget
    elif mode == 1:
        cap = int(rng.integers(lo, lo + 5))
        caps = [cap] * n
    else:
        cap = rng.integers(lo, lo + 6, size=n)
        caps = list(cap)
    return random_probabilities(rng, n), budget, lo, cap, caps


def test_allocate_roots_matches_exhaustive_search(monkeypatch):
    # Count how often phase 3 (the reduced-cost DP) runs, so the suite provably exercises it.
    calls = []
    search = alloc._reduced_cost_search
    monkeypatch.setattr(
        alloc, "_reduced_cost_search", lambda *a: calls.append(1) or search(*a)
    )
    rng = np.random.default_rng(0)
    for _ in range(1500):
        v, budget, lo, cap, caps = random_root_case(rng)
        m = allocate_roots(v, budget, min_per_root=lo, max_per_root=cap)
        spent, value = brute_roots(v, budget, lo, caps)
        context = f"v={v.tolist()} budget={budget} min={lo} caps={caps} got {m.tolist()}"
        assert m.dtype == np.int64
        assert int(m.sum()) == spent, context
        assert np.all((m == 0) | ((m >= lo) & (m <= np.array(caps)))), context
        assert root_objective(v, m) == pytest.approx(value, abs=1e-9), context
    assert len(calls) >= 20


def test_allocate_prefixes_matches_exhaustive_search():
    rng = np.random.default_rng(1)
    for _ in range(600):
        n = int(rng.integers(1, 5))
        budget = int(rng.integers(0, 10))
        p = random_probabilities(rng, n)
        observed = rng.integers(0, 2, n)
        if rng.random() < 0.5:
            cap, caps = None, [budget] * n
        else:
            cap = rng.integers(0, 5, size=n)
            caps = list(cap)
        k = allocate_prefixes(p, observed, budget, max_per_prefix=cap)
        spent, value = brute_prefixes(p, observed, budget, caps)
        context = f"p={p.tolist()} obs={observed.tolist()} budget={budget} caps={caps}"
        assert int(k.sum()) == spent and np.all(k <= np.array(caps)), context
        assert prefix_objective(p, observed, k) == pytest.approx(value, abs=1e-9), context


@pytest.mark.parametrize(
    ("v", "budget", "kwargs", "expected"),
    [
        ([0.5], 3, {}, [3]),  # odd budget, one prompt, no cap: 3 is allowed
        ([0.5, 0.5], 4, {}, [2, 2]),  # 0.5 + 0.5 beats 1 - 2/16 = 0.875
        ([0.0, 0.5], 4, {}, [0, 4]),  # a certain prompt is worth nothing
        ([0.5], 3, {"max_per_root": 2}, [2]),  # cannot spend 3: spend the most possible
        ([0.5, 0.5], 1, {}, [0, 0]),  # one rollout is never mixed
        ([0.5, 0.5], 9, {"max_per_root": 3}, [3, 3]),  # budget above n * cap
        ([0.5, 0.1], 5, {"min_per_root": 3}, [5, 0]),
        ([0.5, 0.5, 0.5], 5, {"min_per_root": 2}, [3, 2, 0]),  # tie: lower index first
        ([], 5, {}, []),  # no prompts: nothing to spend on
        ([0.5, 0.3], 3, {"min_per_root": 1, "max_per_root": [1, 2]}, [1, 2]),  # burn on a 1
    ],
)
def test_allocate_roots_hand_worked(v, budget, kwargs, expected):
    assert allocate_roots(np.array(v), budget, **kwargs).tolist() == expected


def test_root_gain_values():
    # 2 rollouts at v = 1/2: mixed half the time; 0 or 1 rollouts: never mixed.
    np.testing.assert_allclose(
        root_gain(np.array([0.5, 0.5, 0.5, 0.2, 1.0]), np.array([2, 1, 0, 3, 5])),
        [0.5, 0.0, 0.0, 1 - 0.2**3 - 0.8**3, 0.0],
    )


def test_max_spendable_roots():
    assert max_spendable_roots(1, 3, 2, np.array([2])) == 2
    assert max_spendable_roots(3, 7, 3, None) == 7
    assert max_spendable_roots(2, 7, 3, np.array([3, 3])) == 6
    assert max_spendable_roots(2, 5, 3, np.array([3, 3])) == 3
    assert max_spendable_roots(4, 1, 2, None) == 0


def test_allocate_roots_large_instance_is_locally_optimal():
    """Invariants on a big case: exact spend, feasibility, and no improving single move
    (one rollout moved between prompts, or a prompt switched on/off against another's units)."""
    rng = np.random.default_rng(2)
    n, budget, lo = 160, 641, 2
    v = np.concatenate([rng.random(n - 20), np.zeros(10), np.ones(10)])
    caps = rng.integers(lo, 12, size=n)
    m = allocate_roots(v, budget, min_per_root=lo, max_per_root=caps)
    assert int(m.sum()) == budget
    assert np.all((m == 0) | ((m >= lo) & (m <= caps)))
    base = root_objective(v, m)

    def feasible(x):
        return np.all((x == 0) | ((x >= lo) & (x <= caps)))

    for i, j in itertools.permutations(range(n), 2):
        for size in {1, int(m[i])} if m[i] else set():
            moved = m.copy()
            moved[i] -= size
            moved[j] += size
            if feasible(moved):
                assert root_objective(v, moved) <= base + 1e-12


def test_allocate_roots_is_deterministic_and_permutation_consistent():
    rng = np.random.default_rng(3)
    v = np.round(rng.random(50), 1)  # many ties
    m1 = allocate_roots(v, 151)
    assert allocate_roots(v.copy(), 151).tolist() == m1.tolist()
    perm = rng.permutation(50)
    assert root_objective(v[perm], allocate_roots(v[perm], 151)) == pytest.approx(
        root_objective(v, m1), abs=1e-12
    )


def test_allocate_prefixes_hand_worked():
    # q = [0.5, 0.9, 1.0]: gains 0.5, 0.25, 0.125 for the first prefix, 0.1, 0.09 for the second,
    # 0 for the third.  Budget 4: 0.5, 0.25, 0.125, 0.1 -> K = [3, 1, 0].
    p = np.array([0.5, 0.9, 1.0])
    observed = np.array([1, 1, 1])
    assert allocate_prefixes(p, observed, 4).tolist() == [3, 1, 0]
    # observed 0 flips q = 1 - p: q = [0.5, 0.1, 0.0] -> gains 0.5.., 0.9, 1.0.
    assert allocate_prefixes(p, 1 - observed, 2).tolist() == [0, 1, 1]
    assert allocate_prefixes(p, observed, 10, max_per_prefix=2).tolist() == [2, 2, 2]
    assert allocate_prefixes(np.array([]), np.array([]), 5).tolist() == []


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: allocate_roots([0.5, np.nan], 4), "v"),
        (lambda: allocate_roots([0.5, 1.2], 4), "v"),
        (lambda: allocate_roots([[0.5]], 4), "v"),
        (lambda: allocate_roots([0.5], -1), "budget"),
        (lambda: allocate_roots([0.5], 2.5), "budget"),
        (lambda: allocate_roots([0.5], 4, min_per_root=0), "min_per_root"),
        (lambda: allocate_roots([0.5], 4, max_per_root=1), "max_per_root"),
        (lambda: allocate_roots([0.5, 0.5], 4, max_per_root=[3]), "max_per_root"),
        (lambda: allocate_roots([0.5], 4, max_per_root=[2.5]), "max_per_root"),
        (lambda: allocate_prefixes([0.5, -0.1], [1, 0], 3), "p"),
        (lambda: allocate_prefixes([0.5, 0.4], [1], 3), "observed"),
        (lambda: allocate_prefixes([0.5], [0.5], 3), "observed"),
        (lambda: allocate_prefixes([0.5], [1], -2), "budget"),
        (lambda: allocate_prefixes([0.5], [1], 3, max_per_prefix=-1), "max_per_prefix"),
        (lambda: allocate_joint([1.5], [0.5], [1], 3), "v_new"),
        (lambda: allocate_joint([0.5], [0.5, 0.4], [1], 3), "observed"),
        (lambda: allocate_joint([0.5], [0.5], [1], 3, min_per_root=0), "min_per_root"),
        (lambda: allocate_joint([0.5], [0.5], [1], -1), "budget"),
        (lambda: explore([0.5], [-1.0], strength=1.0), "staleness"),
        (lambda: explore([0.5], [1.0, 2.0], strength=1.0), "staleness"),
        (lambda: explore([0.5], [1.0], strength=-1.0), "strength"),
    ],
)
def test_bad_input_names_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        call()


def test_explore_pulls_toward_half():
    v = np.array([0.0, 0.2, 0.5, 0.9, 1.0])
    np.testing.assert_array_equal(explore(v, np.full(5, 7.0), strength=0.0), v)
    np.testing.assert_array_equal(explore(v, np.zeros(5), strength=3.0), v)
    pulled = explore(v, np.array([1.0, 1.0, 1.0, 2.0, 100.0]), strength=np.log(2))
    np.testing.assert_allclose(pulled, [0.25, 0.35, 0.5, 0.6, 0.5])


def test_explore_keeps_certain_prompts_from_starving():
    """Prompt 0 is predicted certain (v = 0): without exploration it never gets a rollout; with
    exploration its staleness grows until it outbids the others."""
    v = np.array([0.0, 0.3, 0.3])

    def run(strength):
        stale = np.zeros(3)
        sampled = np.zeros(3, dtype=int)
        for _ in range(20):
            m = allocate_roots(explore(v, stale, strength=strength), 4)
            sampled += m > 0
            stale = np.where(m > 0, 0.0, stale + 1.0)
        return sampled

    assert run(0.0)[0] == 0
    assert run(0.5)[0] > 0


# ----------------------------------------------------------------------------- correlation


def test_power_mean_is_the_beta_moment():
    # Beta(a, b) with mean x = a / (a + b) and c = 1 / (a + b): E[X^m] against numerical integration.
    from scipy import integrate, stats

    for x, c, m in [(0.3, 0.5, 3), (0.5, 2.0, 4), (0.9, 0.1, 2), (0.2, 1.0, 1)]:
        a, b = x / c, (1 - x) / c
        want = integrate.quad(lambda t: t**m * stats.beta.pdf(t, a, b), 0, 1)[0]
        assert alloc._power_mean(x, c, m) == pytest.approx(want, rel=1e-6)
    assert alloc._power_mean(0.3, 0.0, 4) == pytest.approx(0.3**4)


def test_zero_correlation_is_the_papers_formulas():
    rng = np.random.default_rng(5)
    for _ in range(200):
        v, budget, lo, cap, _ = random_root_case(rng)
        assert np.array_equal(allocate_roots(v, budget, min_per_root=lo, max_per_root=cap),
                              allocate_roots(v, budget, min_per_root=lo, max_per_root=cap, correlation=0.0))
        p = random_probabilities(rng, len(v))
        obs = rng.integers(0, 2, len(v))
        k = rng.integers(0, 4, len(v))
        q = obs * p + (1 - obs) * (1 - p)
        assert prefix_objective(p, obs, k, correlation=0.0) == pytest.approx(float((1 - q**k).sum()))


def test_correlated_root_gain_against_simulation():
    rng = np.random.default_rng(6)
    v, rho, m = 0.4, 0.3, 4
    kappa = 1 / rho - 1
    V = rng.beta(v * kappa, (1 - v) * kappa, size=400_000)
    s = rng.binomial(m, V)
    assert root_gain([v], [m], rho)[0] == pytest.approx(np.mean((s > 0) & (s < m)), abs=3e-3)
    assert root_gain([v], [m], rho)[0] < root_gain([v], [m])[0]  # correlated rollouts mix less


def test_correlated_allocations_match_exhaustive_search():
    rng = np.random.default_rng(7)
    for _ in range(400):
        v, budget, lo, cap, caps = random_root_case(rng)
        rho = float(rng.choice([0.1, 0.5, 0.9]))
        m = allocate_roots(v, budget, min_per_root=lo, max_per_root=cap, correlation=rho)
        best = (-1, -np.inf)
        for mm in itertools.product(*[[0, *range(lo, int(c) + 1)] for c in caps]):
            if sum(mm) <= budget:
                best = max(best, (sum(mm), root_objective(v, np.array(mm), rho)))
        assert int(m.sum()) == best[0]
        assert root_objective(v, m, rho) == pytest.approx(best[1], abs=1e-9), (v, budget, lo, caps, rho, m)
    for _ in range(300):
        n = int(rng.integers(1, 5))
        budget = int(rng.integers(0, 9))
        p = random_probabilities(rng, n)
        obs = rng.integers(0, 2, n)
        rho = rng.choice([0.0, 0.2, 0.6, 0.95], size=n)
        seen = rng.integers(0, 4, size=n)
        k = allocate_prefixes(p, obs, budget, correlation=rho, seen=seen)
        best = max(prefix_objective(p, obs, np.array(kk), rho, seen)
                   for kk in itertools.product(range(budget + 1), repeat=n) if sum(kk) == budget)
        assert int(k.sum()) == budget
        assert prefix_objective(p, obs, k, rho, seen) == pytest.approx(best, abs=1e-9)


def test_correlation_moves_continuations_to_where_outcomes_were_seen_least():
    # Two prefixes predicted 0.5, both observed to succeed. Independent draws (rho 0): a tie,
    # ties go to the lower index. With correlated outcomes, the one whose success was seen three
    # times (a root whose three bare rollouts agreed) is likelier to repeat it: the other gets more.
    p, obs = np.array([0.5, 0.5]), np.array([1, 1])
    assert allocate_prefixes(p, obs, 3, seen=np.array([3, 1])).tolist() == [2, 1]
    assert allocate_prefixes(p, obs, 3, correlation=0.5, seen=np.array([3, 1])).tolist() == [1, 2]
    # With a strong correlation a prediction of 0.5 after an observed success is far from a coin:
    w, _ = alloc._repeat_posterior(np.array([0.5]), np.array([1.0]), 0.8, None)
    assert w[0] == pytest.approx((0.5 + 4) / (1 + 4))  # c = 4: (q + s c) / (1 + s c)


@pytest.mark.parametrize("rho", [-0.1, 1.0, float("nan")])
def test_bad_correlation_is_named(rho):
    with pytest.raises(ValueError, match="correlation"):
        allocate_roots([0.5, 0.5], 4, correlation=rho)
    with pytest.raises(ValueError, match="correlation"):
        allocate_prefixes([0.5], [1], 2, correlation=rho)


def brute_joint(v, p, obs, budget, lo, root_caps, prefix_caps, rho_root, rho_prefix, seen):
    """(spent, best value) of the joint split over every feasible (m, K), spent first."""
    best = (-1, -np.inf)
    roots = list(itertools.product(*[[0, *range(lo, int(c) + 1)] for c in root_caps]))
    prefixes = list(itertools.product(*[range(int(c) + 1) for c in prefix_caps]))
    for m in roots:
        for k in prefixes:
            spent = sum(m) + sum(k)
            if spent <= budget:
                value = (root_objective(v, np.array(m, dtype=np.int64), rho_root)
                         + prefix_objective(p, obs, np.array(k, dtype=np.int64), rho_prefix, seen))
                best = max(best, (spent, value))
    return best


def test_allocate_joint_matches_exhaustive_search():
    rng = np.random.default_rng(11)
    for case in range(300):
        n_root, n_pre = int(rng.integers(0, 4)), int(rng.integers(0, 4))
        lo = int(rng.integers(1, 4))
        budget = int(rng.integers(0, 9))
        v = random_probabilities(rng, n_root)
        p = random_probabilities(rng, n_pre)
        obs = rng.integers(0, 2, n_pre)
        rho_root = float(rng.choice([0.0, 0.3, 0.8]))
        rho_prefix = rng.choice([0.0, 0.5, 0.9], size=n_pre)
        seen = rng.integers(1, 4, size=n_pre)
        capped = bool(rng.integers(2))
        root_cap = int(rng.integers(lo, lo + 3)) if capped else None
        prefix_cap = int(rng.integers(0, 4)) if capped else None
        m, k = allocate_joint(v, p, obs, budget, min_per_root=lo, max_per_root=root_cap,
                              max_per_prefix=prefix_cap, root_correlation=rho_root,
                              prefix_correlation=rho_prefix, seen=seen)
        assert np.all((m == 0) | ((m >= lo) & (m <= (root_cap or budget))))
        assert np.all(k <= (budget if prefix_cap is None else prefix_cap))
        spent, best = brute_joint(v, p, obs, budget, lo, [root_cap or max(budget, lo)] * n_root,
                                  [budget if prefix_cap is None else prefix_cap] * n_pre,
                                  rho_root, rho_prefix, seen)
        assert int(m.sum() + k.sum()) == spent, (case, v, p, obs, budget, lo, m, k)
        value = root_objective(v, m, rho_root) + prefix_objective(p, obs, k, rho_prefix, seen)
        assert value == pytest.approx(best, abs=1e-9), (case, v, p, obs, budget, lo, m, k)


def test_allocate_joint_reduces_to_each_stage():
    rng = np.random.default_rng(3)
    for _ in range(50):
        v, p = rng.random(5), rng.random(4)
        obs = rng.integers(0, 2, 4)
        budget = int(rng.integers(0, 12))
        m, k = allocate_joint(np.zeros(0), p, obs, budget)
        assert m.size == 0 and k.tolist() == allocate_prefixes(p, obs, budget).tolist()
        m, k = allocate_joint(v, np.zeros(0), np.zeros(0), budget)
        assert k.size == 0 and m.tolist() == allocate_roots(v, budget).tolist()


def test_allocate_joint_follows_the_calibrated_flip_chance():
    # Three fresh prompts predicted 0.5 against two continued prefixes. Read as independent
    # draws (rho 0) a continuation flips a 0.5 prefix half the time, more than a fresh pair buys
    # per leaf (0.25): the budget goes to the prefixes. When the store says a prefix's outcomes
    # are strongly correlated (rho 0.8: a continuation repeats what was seen 90% of the time),
    # the same leaves go to fresh prompts.
    v, p, obs = np.full(3, 0.5), np.array([0.5, 0.5]), np.array([1, 0])
    m, k = allocate_joint(v, p, obs, 4)
    assert m.sum() == 0 and k.tolist() == [2, 2]
    m, k = allocate_joint(v, p, obs, 4, prefix_correlation=0.8)
    assert k.sum() == 0 and sorted(m.tolist()) == [0, 2, 2]
