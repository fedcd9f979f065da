"""A coverage-aware Stage 1: each prompt valued by its whole tree (``allocator=trace_cover``).

The paper's Stage 1 values m bare rollouts of prompt i by g_i(m) = P(m rollouts are mixed) and
ignores the m_i N continuations Stage 2 then spends inside the same tree. Two consequences:
a single bare rollout is worth nothing (g(1) = 0), so each active prompt costs at
least 2 of the M bare rollouts; and since g(3) = 1.5 g(2) at v = 1/2 ... any spread in the
predictions tips the solver to few prompts with 3 rollouts each, i.e. fewer prompts than GRPO
covers at the same leaf budget.

Here the value of a prompt is the chance that its *tree* is mixed. With the correlation model
of ``trace_core.allocation`` (the true V of a prompt with prediction v is Beta(mean v, rho)), a
tree with m bare rollouts whose m N continuations all start from the root is m (1 + N)
exchangeable draws, so

    G_i(m) = 1 - E[V^{m(1+N)}] - E[(1 - V)^{m(1+N)}] = g_i(m (1 + N)),   G_i(0) = 0.

Continuing from the root is one of Stage 2's options whenever the bare rollouts agree (the root
prefix, ``AllocatorConfig.branch_from_root``), and Stage 2 maximises the same probability of
contradicting the observed outcome over all its prefixes, so G_i is the value of the tree under
the model when Stage 2 takes that option, and a lower bound on what Stage 2 itself expects. With
N >= 1, G_i(1) = g_i(1 + N) > 0 for 0 < v < 1: one bare rollout is allowed (``min_bare``).

The solver maximises sum_i G_i(m_i) subject to sum_i m_i = B (the largest reachable total not
above the budget), m_i in {0} U [lo, cap_i], and at least K active prompts. K is the caller's
coverage floor (``trace_core.allocators.TraceCover``: GRPO's prompt count at the same leaf budget,
less the prompts the predictor puts outside [eps, 1 - eps]). G_i need not be concave at the
start (N = 0 gives G = g), so the solver is a dynamic programme over prompts with state
(rollouts spent, active prompts capped at K): exact by construction, O(n B K cap) float work,
a few milliseconds at the pipeline's sizes (pool 32, M 16). It is meant for pools of up to a few
hundred prompts; ``allocate_roots`` remains the solver for large pools.
"""

from __future__ import annotations

import numpy as np

from trace_core.allocation import _caps, _nonnegative_int, _probabilities, root_gain


def tree_gain(v: np.ndarray, m: np.ndarray, multiplier: int, correlation: float = 0.0) -> np.ndarray:
    """float64 [n]: G(m) = P(a tree of m bare rollouts and m N root continuations is mixed)."""
    m = np.asarray(m, np.int64)
    return root_gain(v, m * (1 + _nonnegative_int(multiplier, "multiplier")), correlation)


def tree_objective(v: np.ndarray, m: np.ndarray, multiplier: int, correlation: float = 0.0) -> float:
    """Expected number of mixed trees: sum_i G_i(m_i)."""
    return float(tree_gain(v, m, multiplier, correlation).sum())


def min_bare(multiplier: int, min_per_root: int) -> int:
    """Fewest bare rollouts of an active prompt: 1 when continuations follow (N >= 1: they can
    make a one-rollout tree mixed), else ``min_per_root`` (one rollout alone is never mixed)."""
    return 1 if multiplier >= 1 else min_per_root


def allocate_cover(
    v: np.ndarray,
    budget: int,
    *,
    multiplier: int,
    min_active: int = 0,
    min_per_root: int = 2,
    max_per_root: int | np.ndarray | None = None,
    correlation: float = 0.0,
) -> np.ndarray:
    """int64 [n]: bare rollouts per prompt maximising the expected number of mixed trees.

    ``v`` [n] predictions, ``budget`` bare rollouts (M), ``multiplier`` N (continuations per
    bare rollout), ``min_active`` the coverage floor K (clamped to what the budget and caps
    allow), ``min_per_root`` the minimum when N = 0 (``min_bare``), ``max_per_root`` a scalar or
    per-prompt cap, ``correlation`` rho of the roots. Spends the largest total not above
    ``budget`` that the floor and caps allow. Ties: the smaller count for the later prompt.
    """
    v = _probabilities(v, "v")
    budget = _nonnegative_int(budget, "budget")
    n_mult = _nonnegative_int(multiplier, "multiplier")
    lo = min_bare(n_mult, _nonnegative_int(min_per_root, "min_per_root"))
    if lo < 1:
        raise ValueError("min_per_root must be >= 1")
    n = len(v)
    caps = _caps(max_per_root, n, lo, "max_per_root")
    caps = np.full(n, budget, np.int64) if caps is None else np.minimum(caps, budget)
    usable = caps >= lo
    floor = min(_nonnegative_int(min_active, "min_active"), int(usable.sum()), budget // lo)
    if budget < lo or not usable.any():
        return np.zeros(n, np.int64)
    top = int(caps.max())
    counts = np.arange(top + 1)
    gains = [tree_gain(np.full(top + 1, x), counts, n_mult, correlation) for x in v]
    # best[s, a]: the best value with s rollouts spent and a active prompts (a capped at the
    # floor); per prompt, the count it takes and the active count before it, for the traceback.
    best = np.full((budget + 1, floor + 1), -np.inf)
    best[0, 0] = 0.0
    picks = np.zeros((n, budget + 1, floor + 1), np.int64)
    froms = np.broadcast_to(np.arange(floor + 1), (n, budget + 1, floor + 1)).copy()
    for i in range(n):
        new = best.copy()  # m_i = 0 keeps the state
        for m in range(lo, int(caps[i]) + 1):
            for before, after in ((slice(0, floor), slice(1, floor + 1)),  # a -> a + 1
                                  (slice(floor, floor + 1), slice(floor, floor + 1))):  # stays
                cand = np.full((budget + 1, after.stop - after.start), -np.inf)
                cand[m:] = best[: budget + 1 - m, before] + gains[i][m]
                better = cand > new[:, after]
                new[:, after] = np.where(better, cand, new[:, after])
                picks[i][:, after] = np.where(better, m, picks[i][:, after])
                froms[i][:, after] = np.where(better, np.arange(floor + 1)[before],
                                              froms[i][:, after])
        best = new
    spent = int(np.flatnonzero(np.isfinite(best[:, floor])).max())
    out = np.zeros(n, np.int64)
    s, a = spent, floor
    for i in range(n - 1, -1, -1):
        out[i] = picks[i, s, a]
        s, a = s - int(out[i]), int(froms[i, s, a])
    assert s == 0 and a == 0, (s, a)
    return out
