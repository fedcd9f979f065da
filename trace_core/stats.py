"""Confidence intervals for held-out accuracy: how a run tells a gain from its own noise.

Held-out accuracy is the mean over items of each item's success rate over its samples. Items, not
samples, are the independent units (the samples of one item share its difficulty and are
correlated), so the interval is taken over the item means:

    acc = (1/n) sum_i a_i,    95% CI = acc +- t_{0.975, n-1} * sd(a) / sqrt(n)

The gain of a training run is paired by item: the same items (and sampling seeds) are evaluated
before and after, and the interval is that of d_i = a_i^after - a_i^before, which removes the
between-item spread from the comparison. The quantile is Student's t with n - 1 degrees of
freedom (``scipy.stats.t``), so the same function serves 200 held-out items (t = 1.972, 0.6%
wider than the normal 1.960) and a handful of paired seeds, where the normal quantile would be
far too narrow (n = 3: t = 4.303; n = 10: 2.262); ``n < 2`` has no interval at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Interval:
    """A mean and its two-sided confidence interval over ``n`` independent units."""

    mean: float
    low: float
    high: float
    n: int
    level: float = 0.95

    @property
    def excludes_zero(self) -> bool:
        """Whether the interval lies wholly on one side of 0 (the effect is larger than noise)."""
        return self.low > 0.0 or self.high < 0.0

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2.0


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The mean of ``values`` (one per independent unit) with its ``level`` confidence interval."""
    x = np.asarray(values, dtype=np.float64)  # [n]
    if x.ndim != 1 or x.size < 2:
        raise ValueError(f"mean_interval: need a flat sequence of at least 2 values, got shape "
                         f"{x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("mean_interval: values must be finite")
    if not 0.0 < level < 1.0:
        raise ValueError(f"mean_interval: level={level} must lie in (0, 1)")
    from scipy.stats import t as student_t  # here, not at import: scipy.stats costs every process ~1 s

    q = float(student_t.ppf(0.5 + level / 2.0, x.size - 1))
    mean = float(x.mean())
    half = q * float(x.std(ddof=1)) / np.sqrt(x.size)
    return Interval(mean=mean, low=mean - half, high=mean + half, n=int(x.size), level=level)


def paired_gain(before: Sequence[float], after: Sequence[float], level: float = 0.95) -> Interval:
    """``mean(after - before)`` with its interval; ``before[i]`` and ``after[i]`` are one item."""
    b = np.asarray(before, dtype=np.float64)
    a = np.asarray(after, dtype=np.float64)
    if b.shape != a.shape:
        raise ValueError(f"paired_gain: before has shape {b.shape}, after {a.shape}; the same "
                         "items must be evaluated twice")
    return mean_interval(a - b, level)


def median_ratio(need: Sequence[float], base: Sequence[float], seed: int = 0,
                 draws: int = 2000) -> tuple[float, float, float, int]:
    """(median ratio, 95% low, high, seeds that never reach) of ``need[i] / base[i]`` over paired
    seeds: the budget (tokens) one method needs to reach a target over the budget the reference
    needs. A NaN in ``need`` (the method never reached the target) counts as an infinite ratio, so
    a method that falls short is not flattered by its smaller total; the interval is a percentile
    bootstrap of the median over seeds, taken on order statistics so that infinity stays
    infinity."""
    n = np.asarray(need, dtype=np.float64)
    b = np.asarray(base, dtype=np.float64)
    if n.shape != b.shape or n.ndim != 1 or n.size == 0:
        raise ValueError(f"median_ratio: need {n.shape} and base {b.shape} must be the same "
                         "non-empty flat shape (one value per seed)")
    never = int(np.isnan(n).sum())
    ratio = np.where(np.isnan(n), np.inf, n / np.maximum(b, 1e-9))
    rng = np.random.default_rng(seed)
    boot = np.median(ratio[rng.integers(0, ratio.size, size=(draws, ratio.size))], axis=1)
    low = np.percentile(boot, 2.5, method="lower")
    high = np.percentile(boot, 97.5, method="higher")
    return float(np.median(ratio)), float(low), float(high), never


def verdict(mean: float, low: float, high: float) -> str:
    """How a gain with interval [low, high] reads: "not better" whenever the interval holds 0."""
    if low > 0.0:
        return "larger than its noise"
    if high < 0.0:
        return "a loss larger than its noise"
    return "not distinguishable from noise (the interval holds 0)"


def detectable_effect(sd: float, n: int, level: float = 0.95, power: float = 0.8) -> float:
    """The smallest true paired difference that the two-sided paired t-test at ``level`` detects
    with probability ``power`` over ``n`` paired units (seeds) whose differences have standard
    deviation ``sd`` (exact, from the noncentral t distribution); nan below 2 units or for a
    non-positive or non-finite ``sd``."""
    from scipy import optimize
    from scipy.stats import nct, t as student_t

    if n < 2 or not np.isfinite(sd) or sd <= 0:
        return float("nan")
    df, crit = n - 1, float(student_t.ppf(0.5 + level / 2, n - 1))

    def shortfall(delta: float) -> float:
        nc = delta * np.sqrt(n) / sd  # the far tail (below -crit) underflows to nan at large nc
        return float(nct.sf(crit, df, nc) + np.nan_to_num(nct.cdf(-crit, df, nc))) - power

    # power rises with delta; at a noncentrality of 50 it is 1 for any n >= 2
    return float(optimize.brentq(shortfall, 0.0, 50.0 * sd / np.sqrt(n)))


def seeds_needed(sd: float, effect: float, level: float = 0.95, power: float = 0.8,
                 most: int = 10_000) -> int:
    """The fewest paired units at which ``effect`` is detectable (``detectable_effect``) when the
    differences have standard deviation ``sd``; 0 where even ``most`` fall short or ``sd`` is not
    a positive finite number."""
    if not np.isfinite(sd) or sd <= 0 or effect <= 0:
        return 0
    low, high = 2, most
    if detectable_effect(sd, high, level, power) > effect:
        return 0
    while low < high:  # the detectable effect falls as units are added
        mid = (low + high) // 2
        if detectable_effect(sd, mid, level, power) <= effect:
            high = mid
        else:
            low = mid + 1
    return low
