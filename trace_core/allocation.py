"""Exact solvers for TRACE's two budget allocations (docs/algorithm.md), plus exploration.

Stage 1, global root allocation::

    max_m  sum_i g_i(m_i),  g_i(m) = 1 - v_i^m - (1 - v_i)^m  (m >= 1),  g_i(0) = 0,
    s.t.   sum_i m_i = M,   m_i in {0} U [min_per_root, max_per_root].

``g_i(m)`` is the chance that m rollouts of prompt i hold both a success and a failure. The paper's
formula gives -1 at m = 0; a filtered prompt contributes nothing, so we use 0 (the probability).

Stage 2, local prefix expansion::

    max_K  sum_j 1 - q_j^K_j,   q_j = r_j p_j + (1 - r_j)(1 - p_j),   s.t. sum_j K_j = B.

Both formulas treat the prediction as the exact success probability: rollouts of one node are
independent Bernoulli(v) draws. ``correlation`` (rho in [0, 1), default 0 = the formulas above)
relaxes that: the true V of a node with prediction v is taken as Beta-distributed with mean v and
intra-class correlation rho (concentration kappa = 1/rho - 1), which is what an honest but
uninformative predictor looks like (its v is the mean over nodes whose true V differ). Then

    g(m) = 1 - E[V^m] - E[(1 - V)^m],     E[V^m] = prod_{i<m} (v + i c) / (1 + i c),  c = rho/(1-rho)

and for Stage 2 the chance that K continuations all repeat an outcome seen s times below the node
is E[W^K] under the posterior (W = V or 1 - V), i.e. q^K with q updated by the observation:
rho > 0 makes a continuation likelier to repeat what was seen. rho = 0 gives the formulas above
exactly; the objectives keep their shape (separable; concave for m >= 1 and in K), so the solvers
and their optimality arguments below are unchanged. ``trace_core.calibration`` estimates rho
from stored trees.

Both problems are solved exactly (up to floating-point rounding of the objective):

* Prefixes: the objective is separable and concave in each K_j (marginal gain q^K (1 - q) is
  non-increasing), so the greedy that hands out one unit at a time to the largest marginal gain is
  optimal. Ties go to the lower index.
* Roots: g_i is concave for m >= 1 but "0 or >= min_per_root" makes each prompt's feasible set
  non-convex, so plain greedy is not exact. We (1) solve the relaxation in which every prompt's
  value is replaced by its concave hull f^_i (linear from 0 up to t = max(min_per_root, 2) with
  slope g_i(t)/t, flat for a prompt capped below t, then g_i; the slope dominates every later
  increment), by greedy; this gives
  an upper bound U, a marginal value lambda and an allocation m^L that is infeasible in at most one
  prompt (0 < m^L_p < t). (2) We build feasible candidates by repairing that prompt. (3) If no
  candidate reaches U, a reduced-cost argument gives the exact answer: for any feasible m with
  sum m = M, U - sum_i g_i(m_i) = sum_i loss_i(m_i) with
  loss_i(m) = [f^_i(m^L_i) - lambda m^L_i] - [g_i(m) - lambda m] >= 0, so a solution better than
  the best candidate uses only values with loss_i(m) <= gap = U - best. A dynamic programme over
  the prompts (state: sum of deviations m_i - m^L_i, cost: sum of losses) restricted to those
  values finds the optimum. In practice the gap is one unit's worth and the programme tiny.

Departures from the paper, both documented in docs/algorithm.md:

* Where the caps make spending the budget exactly impossible (min_per_root > budget, an odd
  budget with one prompt capped at 2, budget > sum of caps, ...), ``allocate_roots`` spends the
  largest feasible total <= budget and ``allocate_prefixes`` spends min(budget, sum of caps).
* ``explore`` pulls predictions toward 1/2 for prompts not rolled out recently, so that prompts the
  predictor calls certain (v near 0 or 1, hence g near 0) are not starved forever. It is applied to
  the solver's input, never inside it.

The module is longer than the project's 400-line guide on purpose: the optimality argument above
covers the root and prefix solvers together, the joint split (``allocate_joint``) prices its
shares with their internals (the prefix units, the posterior repeat probability, the
certification tolerance), and all of them share the objectives' helpers, so the proof and the
code it proves stay in one file. (``explore``, 20 lines, is the one part outside the argument; it
stays beside the solver whose input it shapes.)
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

_CERTIFY_TOL = 1e-12
"""A candidate within this of the upper bound is accepted as optimal (float rounding)."""
_PRUNE_TOL = 1e-9
"""Slack on reduced-cost pruning, so that rounding never prunes a true optimum."""


# ----------------------------------------------------------------------------- objectives


def _spread(correlation: float) -> float:
    """c = rho / (1 - rho) (= 1 / kappa), after checking rho is in [0, 1)."""
    rho = float(correlation)
    if not 0.0 <= rho < 1.0:  # NaN fails too
        raise ValueError(f"correlation must be in [0, 1), got {correlation!r}")
    return rho / (1.0 - rho)


def _power_mean(x: np.ndarray, c: float | np.ndarray, m: np.ndarray) -> np.ndarray:
    """float64: E[X^m] for X ~ Beta with mean x and c = 1/kappa (c = 0: x^m), elementwise:
    prod_{i<m} (x + i c) / (1 + i c)."""
    x, m = np.broadcast_arrays(np.asarray(x, np.float64), np.asarray(m, np.int64))
    c = np.broadcast_to(np.asarray(c, np.float64), x.shape)
    if not np.any(c):
        return x**m  # the paper's formulas, to the last bit
    out = np.ones(x.shape)
    for i in range(int(m.max(initial=0))):
        out = np.where(i < m, out * (x + i * c) / (1.0 + i * c), out)
    return out


def root_gain(v: np.ndarray, m: np.ndarray, correlation: float = 0.0) -> np.ndarray:
    """float64 [n]: P(m rollouts of each prompt are mixed) = 1 - E[V^m] - E[(1-V)^m] (with
    ``correlation`` 0: 1 - v^m - (1-v)^m), and 0 at m = 0."""
    v = np.asarray(v, dtype=np.float64)
    m = np.asarray(m)
    c = _spread(correlation)
    return np.where(m > 0, 1.0 - _power_mean(v, c, m) - _power_mean(1.0 - v, c, m), 0.0)


def root_objective(v: np.ndarray, m: np.ndarray, correlation: float = 0.0) -> float:
    """Stage 1 objective: expected number of prompts whose rollouts hold a success and a failure."""
    return float(root_gain(v, m, correlation).sum())


def prefix_objective(p: np.ndarray, observed: np.ndarray, k: np.ndarray, correlation: object = 0.0,
                     seen: np.ndarray | None = None) -> float:
    """Stage 2 objective: sum_j 1 - P(k_j continuations all repeat the observed outcome), the
    expected number of prefixes whose continuations contradict it at least once (with
    ``correlation`` 0: sum_j 1 - q_j^k_j)."""
    w, c = _repeat_posterior(np.asarray(p, np.float64), np.asarray(observed, np.float64),
                             correlation, seen)
    return float((1.0 - _power_mean(w, c, np.asarray(k))).sum())


def _repeat_probability(p: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """q = r p + (1 - r)(1 - p): the chance one continuation repeats the observed outcome r."""
    return observed * p + (1.0 - observed) * (1.0 - p)


def _repeat_posterior(p: np.ndarray, observed: np.ndarray, correlation: object,
                      seen: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(q', c') per prefix: mean and spread of W (the chance one continuation repeats the observed
    outcome) after the ``seen`` rollouts below the prefix that all had that outcome. With
    correlation 0 this is (q, 0)."""
    rho = np.broadcast_to(np.asarray(correlation, np.float64), p.shape)
    c = np.array([_spread(r) for r in rho.ravel()]).reshape(p.shape)
    s = np.ones(p.shape) if seen is None else np.asarray(seen, np.float64)
    q = _repeat_probability(p, observed)
    return (q + s * c) / (1.0 + s * c), c / (1.0 + s * c)


# ----------------------------------------------------------------------------- validation


def _probabilities(x: object, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    bad = np.flatnonzero(~((arr >= 0.0) & (arr <= 1.0)))  # NaN fails both comparisons
    if len(bad):
        raise ValueError(f"{name}[{bad[0]}] = {arr[bad[0]]} is not a probability in [0, 1]")
    return arr


def _nonnegative_int(x: object, name: str) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {x!r}")
    return int(x)


def _caps(cap: object, n: int, floor: int, name: str) -> np.ndarray | None:
    """None, or int64 [n] per-item caps (a scalar is broadcast), each >= floor."""
    if cap is None:
        return None
    arr = np.asarray(cap)
    if arr.ndim == 0:
        arr = np.full(n, _nonnegative_int(arr.item(), name), dtype=np.int64)
    if arr.shape != (n,):
        raise ValueError(f"{name} must be a scalar or have shape ({n},), got {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    bad = np.flatnonzero(arr < floor)
    if len(bad):
        raise ValueError(f"{name}[{bad[0]}] = {arr[bad[0]]} is below the minimum {floor}")
    return arr.astype(np.int64)


# ----------------------------------------------------------------------------- greedy core


def _greedy(
    unit: Callable[[int, int], float], caps: np.ndarray, spend: int
) -> tuple[np.ndarray, float, list[tuple[float, int, int]]]:
    """Hand out ``spend`` units one at a time to the largest next unit value.

    ``unit(i, j)`` is the value of item i's (j+1)-th unit and must be non-increasing in j; ties go
    to the lower index. Returns (counts [n], value of the last unit given, the remaining heap).
    """
    n = len(caps)
    heap = [(-unit(i, 0), i, 0) for i in range(n) if caps[i] > 0]
    heapq.heapify(heap)
    counts = np.zeros(n, dtype=np.int64)
    last = np.inf
    for _ in range(spend):
        neg, i, j = heapq.heappop(heap)
        counts[i] += 1
        last = -neg
        if j + 1 < caps[i]:
            heapq.heappush(heap, (-unit(i, j + 1), i, j + 1))
    return counts, last, heap


# ----------------------------------------------------------------------------- Stage 2


def _prefix_unit(w: float, c: float, j: int) -> float:
    """Value of a prefix's (j+1)-th continuation: P(j repeat) - P(j + 1 repeat)
    = E[W^j](1 - w)/(1 + j c); q^j (1 - q), the paper's marginal gain, when c = 0."""
    if c == 0.0:
        return w**j * (1.0 - w)
    return float(_power_mean(w, c, j)) * (1.0 - w) / (1.0 + j * c)


def allocate_prefixes(
    p: np.ndarray,
    observed: np.ndarray,
    budget: int,
    *,
    max_per_prefix: int | np.ndarray | None = None,
    correlation: float | np.ndarray = 0.0,
    seen: np.ndarray | None = None,
) -> np.ndarray:
    """int64 [n]: continuations per prefix maximising sum(1 - q^K) with sum(K) = budget.

    p[j] is the predicted success probability of prefix j and observed[j] in {0, 1} the outcome of
    the rollout through it. Greedy on the marginal gain q^K (1 - q) is exact (the objective is
    separable and concave); ties go to the lower index. With caps, spends min(budget, sum of caps).
    ``correlation`` (a scalar or one per prefix, in [0, 1)) and ``seen`` (rollouts below each
    prefix that had its observed outcome, default 1) replace q^K by its Beta-posterior expectation
    (module docstring); the greedy stays exact.
    """
    p = _probabilities(p, "p")
    obs = np.asarray(observed, dtype=np.float64)
    if obs.shape != p.shape:
        raise ValueError(f"observed has shape {obs.shape} but p has {p.shape}")
    bad = np.flatnonzero((obs != 0.0) & (obs != 1.0))
    if len(bad):
        raise ValueError(f"observed[{bad[0]}] = {obs[bad[0]]} is not an outcome in {{0, 1}}")
    budget = _nonnegative_int(budget, "budget")
    n = len(p)
    caps = _caps(max_per_prefix, n, 0, "max_per_prefix")
    if caps is None:
        caps = np.full(n, budget, dtype=np.int64)
    spend = min(budget, int(caps.sum()))
    corr = np.asarray(correlation, dtype=np.float64)
    if corr.ndim not in (0, 1) or (corr.ndim == 1 and corr.shape != p.shape):
        raise ValueError(f"correlation must be a scalar or have shape {p.shape}, got {corr.shape}")
    if seen is not None:
        seen = np.asarray(seen)
        if seen.shape != p.shape or not np.issubdtype(seen.dtype, np.integer) or np.any(seen < 0):
            raise ValueError(f"seen must hold {len(p)} non-negative integers, got {seen!r}")
    w, c = _repeat_posterior(p, obs, corr, seen)
    w, c = w.tolist(), c.tolist()
    k, _, _ = _greedy(lambda i, j: _prefix_unit(w[i], c[i], j), caps, spend)
    assert int(k.sum()) == spend and np.all(k <= caps)
    return k


# ----------------------------------------------------------------------------- Stage 1


def max_spendable_roots(n: int, budget: int, min_per_root: int, caps: np.ndarray | None) -> int:
    """The largest total <= budget reachable with each m_i in {0} U [min_per_root, caps_i].

    With k active prompts every total in [k * min, sum of the k largest caps] is reachable.
    """
    top = np.sort(caps)[::-1].cumsum() if caps is not None else np.full(n, budget)
    best = 0
    for k in range(1, n + 1):
        if k * min_per_root > budget:
            break
        best = max(best, min(budget, int(top[k - 1])))
    return best


class _RootUnits:
    """Unit values of the concave hull f^_i of each prompt's g_i, and the exact values g_i."""

    def __init__(self, v: np.ndarray, min_per_root: int, caps: np.ndarray,
                 correlation: float = 0.0) -> None:
        self.v = v.tolist()
        self.correlation = correlation
        self.c = _spread(correlation)
        self.lo = min_per_root
        self.t = max(min_per_root, 2)  # where the hull's first linear piece ends
        # A prompt capped below t (min 1, cap 1) can only ever hold one worthless rollout: its
        # hull on [0, cap] is flat. Elsewhere the first piece rises to g(t) at t.
        reach = np.minimum(caps, self.t)
        self.slope = (root_gain(v, reach, correlation) / reach).tolist()

    def unit(self, i: int, j: int) -> float:
        """Value of the (j+1)-th rollout of prompt i under the hull."""
        if j < self.t:
            return self.slope[i]
        v, c = self.v[i], self.c
        if c == 0.0:
            return v**j * (1.0 - v) + (1.0 - v) ** j * v  # g(j + 1) - g(j), without cancellation
        # g(j + 1) - g(j) = E[V^j](1 - v)/(1 + jc) + E[(1-V)^j] v/(1 + jc), without cancellation
        return float(_power_mean(v, c, j) * (1.0 - v) + _power_mean(1.0 - v, c, j) * v) / (1.0 + j * c)

    def hull(self, i: int, m: int) -> float:
        return self.slope[i] * m if m <= self.t else self.exact(i, m)

    def exact(self, i: int, m: int) -> float:
        """g_i(m), -inf where m is not an allowed count."""
        if m == 0:
            return 0.0
        if m < self.lo:
            return -np.inf
        return float(root_gain(np.array([self.v[i]]), np.array([m]), self.correlation)[0])

    def objective(self, m: np.ndarray) -> float:
        return root_objective(np.asarray(self.v), m, self.correlation)


def allocate_roots(
    v: np.ndarray,
    budget: int,
    *,
    min_per_root: int = 2,
    max_per_root: int | np.ndarray | None = None,
    correlation: float = 0.0,
) -> np.ndarray:
    """int64 [n]: rollouts per prompt maximising sum(1 - v^m - (1-v)^m), exactly (with
    ``correlation`` rho > 0: sum(1 - E[V^m] - E[(1-V)^m]), module docstring).

    Each m_i is 0 (prompt filtered out) or in [min_per_root, max_per_root] (a scalar or one cap per
    prompt; None = no cap). Spends ``budget`` exactly when the caps allow it, otherwise the largest
    reachable total below it (see ``max_spendable_roots``). Deterministic: the relaxation's ties
    go to the lower index. See the module docstring for the method and its optimality argument.
    """
    v = _probabilities(v, "v")
    budget = _nonnegative_int(budget, "budget")
    _spread(correlation)  # validated before any early return
    lo = _nonnegative_int(min_per_root, "min_per_root")
    if lo < 1:
        raise ValueError(f"min_per_root must be >= 1, got {lo}")
    n = len(v)
    caps = _caps(max_per_root, n, lo, "max_per_root")
    spend = max_spendable_roots(n, budget, lo, caps)
    if caps is None:
        caps = np.full(n, max(spend, lo), dtype=np.int64)  # no prompt can use more than spend
    if spend == 0:
        return np.zeros(n, dtype=np.int64)

    units = _RootUnits(v, lo, caps, correlation)
    relaxed, lam, heap = _greedy(units.unit, caps, spend)  # phase 1: concave relaxation
    upper = sum(units.hull(i, int(c)) for i, c in enumerate(relaxed))
    best = _best_candidate(units, relaxed, heap, caps, spend)  # phase 2: repairs
    if units.objective(best) < upper - _CERTIFY_TOL:
        best = _reduced_cost_search(units, relaxed, lam, upper, best, caps)  # phase 3: exact
    assert int(best.sum()) == spend, (int(best.sum()), spend)
    assert np.all((best == 0) | ((best >= lo) & (best <= caps)))
    return best


def _feasible(m: np.ndarray, lo: int, caps: np.ndarray) -> bool:
    return bool(np.all((m == 0) | ((m >= lo) & (m <= caps))))


def _best_candidate(
    units: _RootUnits,
    relaxed: np.ndarray,
    heap: list[tuple[float, int, int]],
    caps: np.ndarray,
    spend: int,
) -> np.ndarray:
    """The best feasible allocation among the relaxation and its repairs of the one prompt the
    relaxation leaves between 0 and t; always returns a feasible allocation spending ``spend``."""
    t, lo = units.t, units.lo
    # Left inside its hull's first piece: holds value the true g does not give (at most one
    # prompt, since the greedy finishes a started first piece before anything else).
    partial = np.flatnonzero((relaxed > 0) & (relaxed < np.minimum(caps, t)))
    candidates = [_any_feasible(caps, lo, spend)]
    if _feasible(relaxed, lo, caps):
        candidates.append(relaxed)
    if len(partial) == 1:
        p = int(partial[0])
        r = int(relaxed[p])
        # (a) drop the partial prompt; its r units go to the next-best increments of active ones.
        drop = relaxed.copy()
        drop[p] = 0
        rest = list(heap)
        need = r
        while need and rest:
            neg, i, j = heapq.heappop(rest)
            if j >= t:  # an increment of an active prompt (j < t: a prompt not yet active)
                drop[i] += 1
                need -= 1
                if j + 1 < caps[i]:
                    heapq.heappush(rest, (-units.unit(i, j + 1), i, j + 1))
        if need == 0:
            candidates.append(drop)
        # (b) complete the partial prompt to t, paying with the cheapest increments elsewhere.
        if caps[p] >= t:
            done = relaxed.copy()
            done[p] = t
            for _ in range(t - r):
                donors = [i for i in np.flatnonzero(done > t) if i != p]
                if not donors:
                    break
                i = min(donors, key=lambda i: (units.unit(i, int(done[i]) - 1), -i))
                done[i] -= 1
            if int(done.sum()) == spend:
                candidates.append(done)
    values = [units.objective(c) for c in candidates]
    return candidates[int(np.argmax(values))]


def _any_feasible(caps: np.ndarray, lo: int, spend: int) -> np.ndarray:
    """A feasible allocation of exactly ``spend`` (which max_spendable_roots says exists)."""
    order = np.argsort(-caps, kind="stable")
    m = np.zeros(len(caps), dtype=np.int64)
    for k in range(1, len(caps) + 1):
        chosen = order[:k]
        if k * lo <= spend <= int(caps[chosen].sum()):
            m[chosen] = lo
            left = spend - k * lo
            for i in chosen:
                add = min(left, int(caps[i]) - lo)
                m[i] += add
                left -= add
            return m
    raise AssertionError(f"no feasible allocation of {spend}")  # excluded by max_spendable_roots


def _reduced_cost_search(
    units: _RootUnits,
    relaxed: np.ndarray,
    lam: float,
    upper: float,
    incumbent: np.ndarray,
    caps: np.ndarray,
) -> np.ndarray:
    """Exact optimum by a DP over prompts, restricted by reduced costs to values that can beat
    the incumbent (see the module docstring)."""
    threshold = upper - units.objective(incumbent) + _PRUNE_TOL
    options = _allowed_deviations(units, relaxed, lam, threshold, caps)
    return _min_loss_allocation(options, relaxed)


Options = list[tuple[int, list[int], list[float]]]
"""Per prompt that may move off the relaxation: (prompt, allowed deviations, their losses)."""


def _allowed_deviations(units: _RootUnits, relaxed: np.ndarray, lam: float, threshold: float,
                        caps: np.ndarray) -> Options:
    """The counts each prompt may take in a solution that beats the incumbent: those whose
    reduced-cost loss is within the gap, as deviations from the relaxed count."""
    lo = units.lo
    options: Options = []
    for i in range(len(relaxed)):
        base = units.hull(i, int(relaxed[i])) - lam * relaxed[i]

        def loss(m: int, i: int = i, base: float = base) -> float:
            return base - (units.exact(i, m) - lam * m)

        allowed = [0] if loss(0) <= threshold else []
        # loss is convex on [lo, cap] (g is concave for m >= 1), so the allowed values there are
        # a run around its minimiser: the relaxed count, or for a prompt the relaxation left
        # below t, the best count in [lo, t] (beyond t its increments are worth <= lambda).
        if relaxed[i] >= units.t:
            centre = int(relaxed[i])
        else:
            centre = min(range(lo, min(units.t, int(caps[i])) + 1), key=loss)
        if loss(centre) <= threshold:
            top = _last_within(loss, centre, int(caps[i]), threshold)
            bottom = _last_within(loss, centre, lo, threshold)
            allowed += [m for m in range(bottom, top + 1) if m != 0]
        if allowed != [int(relaxed[i])]:
            # Deviation 0 first, then small ones: equal-cost choices stay close to the relaxation.
            devs = sorted((m - int(relaxed[i]) for m in allowed), key=lambda d: (abs(d), d))
            options.append((i, devs, [loss(int(relaxed[i]) + d) for d in devs]))
    return options


def _min_loss_allocation(options: Options, relaxed: np.ndarray) -> np.ndarray:
    """DP over prompts. State = sum of deviations so far; array index = state - low. After each
    prompt only states from which the remaining prompts can still bring the sum back to 0 are
    kept, which bounds the array by the smaller of the spans before and after."""
    rest_min = np.cumsum([0] + [min(d) for _, d, _ in reversed(options)])[::-1]  # [len + 1]
    rest_max = np.cumsum([0] + [max(d) for _, d, _ in reversed(options)])[::-1]
    low = 0
    cost = np.zeros(1)
    choices: list[tuple[np.ndarray, int]] = []  # per prompt: (choice per kept state, its low)
    for k, (_, devs, losses) in enumerate(options):
        dmin, dmax = min(devs), max(devs)
        new = np.full(len(cost) + dmax - dmin, np.inf)
        pick = np.full(len(new), -1, dtype=np.int64)
        for c, (d, ls) in enumerate(zip(devs, losses)):
            window = slice(d - dmin, d - dmin + len(cost))
            better = cost + ls < new[window]
            new[window] = np.where(better, cost + ls, new[window])
            pick[window] = np.where(better, c, pick[window])
        new_low = low + dmin
        keep_lo = max(new_low, -int(rest_max[k + 1]))
        keep_hi = min(new_low + len(new) - 1, -int(rest_min[k + 1]))
        cost = new[keep_lo - new_low : keep_hi - new_low + 1]
        low = keep_lo
        choices.append((pick[keep_lo - new_low : keep_hi - new_low + 1], low))
    assert low <= 0 < low + len(cost) and np.isfinite(cost[-low]), "incumbent must stay reachable"
    best = relaxed.copy()
    state = 0  # total deviation must be 0: the allocation spends exactly what the relaxation did
    for (i, devs, _), (pick, pick_low) in zip(reversed(options), reversed(choices)):
        d = devs[int(pick[state - pick_low])]
        best[i] += d
        state -= d
    return best


def _last_within(loss: Callable[[int], float], start: int, end: int, threshold: float) -> int:
    """The value m between start and end (inclusive, either direction) furthest from start with
    loss(m) <= threshold, given loss is non-decreasing away from start. Binary search."""
    if loss(end) <= threshold:
        return end
    good, bad = start, end  # loss(good) <= threshold < loss(bad)
    while abs(bad - good) > 1:
        mid = (good + bad) // 2
        if loss(mid) <= threshold:
            good = mid
        else:
            bad = mid
    return good


# ----------------------------------------------------------------------------- joint split


def _prefix_values(p: np.ndarray, observed: np.ndarray, budget: int,
                   max_per_prefix: int | np.ndarray | None, correlation: float | np.ndarray,
                   seen: np.ndarray | None) -> np.ndarray:
    """Stage 2's optimal value for every prefix share 0..B (B <= budget: the caps may stop it
    earlier): one greedy run at the full budget, its units sorted best first, prices them all."""
    if not len(p):
        return np.zeros(1)
    k_all = allocate_prefixes(p, observed, budget, max_per_prefix=max_per_prefix,
                              correlation=correlation, seen=seen)
    w, c = _repeat_posterior(p, np.asarray(observed, np.float64), correlation, seen)
    units = sorted((_prefix_unit(float(w[i]), float(c[i]), j)
                    for i in range(len(p)) for j in range(int(k_all[i]))), reverse=True)
    return np.concatenate([[0.0], np.cumsum(units)])


def allocate_joint(
    v_new: np.ndarray,
    p: np.ndarray,
    observed: np.ndarray,
    budget: int,
    *,
    min_per_root: int = 2,
    max_per_root: int | np.ndarray | None = None,
    max_per_prefix: int | np.ndarray | None = None,
    root_correlation: float = 0.0,
    prefix_correlation: float | np.ndarray = 0.0,
    seen: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(m [len(v_new)], K [len(p)]): one leaf budget split between fresh prompts and continuations.

    The continuation budget of a step, chosen after its bare rollouts, where each leaf buys the
    most: bare rollouts of prompts not yet rolled out this step (Stage 1's gain g_i(m_i) on their
    predictions ``v_new``, m_i in {0} U [min_per_root, max_per_root]) or continuations of the
    step's prefixes (Stage 2's gain 1 - E[W^K]). Both gains count expected mixed groups (a new
    mixed prompt; a prefix whose continuations contradict its observed outcome), so they add::

        max  sum_i g_i(m_i) + sum_j (1 - E[W_j^K_j])   s.t.  sum m + sum K = budget.

    Exact: for every root share B the two parts are solved by ``allocate_roots`` (exact) and the
    prefix greedy (exact, concave; its value for every B comes from one greedy run), and the best B
    is kept (ties: the larger prefix share, then the lower index within each part). B runs over
    the totals ``allocate_roots`` can spend exactly. Costs O(budget) Stage 1 solves.
    With no fresh prompts this is ``allocate_prefixes``; with no prefixes, ``allocate_roots``.
    """
    v_new = _probabilities(v_new, "v_new")
    p = _probabilities(p, "p")
    if np.shape(observed) != p.shape:
        raise ValueError(f"observed has shape {np.shape(observed)} but p has {p.shape}")
    budget = _nonnegative_int(budget, "budget")
    lo = _nonnegative_int(min_per_root, "min_per_root")
    if lo < 1:
        raise ValueError(f"min_per_root must be >= 1, got {lo}")
    prefix_value = _prefix_values(p, observed, budget, max_per_prefix, prefix_correlation, seen)
    caps = _caps(max_per_root, len(v_new), lo, "max_per_root") if len(v_new) else None
    chosen: tuple[int, float, int, int] | None = None  # (spent, value, root share, prefix share)
    for b in range(budget + 1):
        roots = max_spendable_roots(len(v_new), b, lo, caps) if b and len(v_new) else 0
        if roots != b:  # b' = roots with a larger prefix share covers it
            continue
        rest = min(budget - b, len(prefix_value) - 1)
        m = (allocate_roots(v_new, b, min_per_root=lo, max_per_root=max_per_root,
                            correlation=root_correlation) if b else np.zeros(len(v_new), np.int64))
        value = root_objective(v_new, m, root_correlation) + float(prefix_value[rest])
        spent = b + rest
        if (chosen is None or spent > chosen[0]
                or (spent == chosen[0] and value > chosen[1] + _CERTIFY_TOL)):
            chosen = (spent, value, b, rest)
    assert chosen is not None  # b = 0 is always considered
    _, _, b, rest = chosen
    m = (allocate_roots(v_new, b, min_per_root=lo, max_per_root=max_per_root,
                        correlation=root_correlation) if b else np.zeros(len(v_new), np.int64))
    k = (allocate_prefixes(p, observed, rest, max_per_prefix=max_per_prefix,
                           correlation=prefix_correlation, seen=seen)
         if len(p) else np.zeros(0, np.int64))
    return m, k


# ----------------------------------------------------------------------------- exploration


def explore(v: np.ndarray, staleness: np.ndarray, *, strength: float) -> np.ndarray:
    """float64 [n]: predictions pulled toward 1/2 the longer a prompt has gone unsampled.

        v' = 1/2 + (v - 1/2) * exp(-strength * staleness)

    ``staleness[i]`` >= 0 counts training steps since prompt i was last rolled out (0 = this
    step's data; a prompt never rolled out gets the number of steps so far). ``strength`` >= 0
    is the rate: after 1/strength unsampled steps the prediction is e times less confident.
    Since g(m) rises as v moves to 1/2, a starved prompt eventually outbids confident ones
    (optimism under uncertainty: a prediction not checked for a while is trusted less). With
    strength 0 this is the identity. Apply it to ``allocate_roots``'s input, not inside it.
    """
    v = _probabilities(v, "v")
    stale = np.asarray(staleness, dtype=np.float64)
    if stale.shape != v.shape:
        raise ValueError(f"staleness has shape {stale.shape} but v has {v.shape}")
    bad = np.flatnonzero(~(stale >= 0) | ~np.isfinite(stale))
    if len(bad):
        raise ValueError(f"staleness[{bad[0]}] = {stale[bad[0]]} must be finite and >= 0")
    if not (np.isfinite(strength) and strength >= 0):
        raise ValueError(f"strength must be finite and >= 0, got {strength!r}")
    return 0.5 + (v - 0.5) * np.exp(-strength * stale)
