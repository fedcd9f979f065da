"""trace_core.stats: hand-worked intervals, a naive loop as reference, invariants."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trace_core.stats import Interval, mean_interval, median_ratio, paired_gain, verdict


def test_hand_worked_interval():
    # values 0, 1, 1, 0: mean 0.5, sd (ddof 1) = sqrt(1/3), se = sqrt(1/3)/2, t_{0.975, 3} from
    # a printed t table (3.182)
    iv = mean_interval([0.0, 1.0, 1.0, 0.0])
    half = 3.182446305284263 * math.sqrt(1 / 3) / 2
    assert iv.mean == 0.5 and iv.n == 4
    assert iv.low == pytest.approx(0.5 - half) and iv.high == pytest.approx(0.5 + half)
    assert not iv.excludes_zero


def test_paired_gain_matches_a_naive_loop():
    rng = np.random.default_rng(0)
    before = rng.integers(0, 5, size=50) / 4  # 4 samples per item
    after = np.clip(before + rng.integers(-1, 3, size=50) / 4, 0, 1)
    diffs = [a - b for a, b in zip(after, before)]
    m = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / (len(diffs) - 1))
    iv = paired_gain(before, after)
    assert iv.mean == pytest.approx(m)
    assert iv.half_width == pytest.approx(2.009575237129235 * sd / math.sqrt(len(diffs)))


def test_few_paired_seeds_get_students_t_not_the_normal_quantile():
    # Three seeds' differences 1, 2, 3: mean 2, sd 1, se 1/sqrt(3); t_{0.975, 2} = 4.303 (the
    # normal 1.960 would claim an interval less than half as wide).
    iv = mean_interval([1.0, 2.0, 3.0])
    assert iv.half_width == pytest.approx(4.302652729911275 / math.sqrt(3))
    assert iv.low < 0.0 < iv.mean  # 2 +- 2.48 holds zero; the normal quantile's +- 1.13 would not
    # With many units t approaches the normal quantile.
    x = np.tile([0.0, 1.0], 5000)
    assert mean_interval(x).half_width == pytest.approx(1.96 * x.std(ddof=1) / 100, rel=1e-3)


def test_pairing_removes_item_spread():
    # Items of very different difficulty, each gaining 0.1: unpaired the spread hides the gain.
    before = np.array([0.0, 0.25, 0.5, 0.75] * 2)
    after = before + 0.1
    gain = paired_gain(before, after)
    assert gain.mean == pytest.approx(0.1) and gain.half_width == pytest.approx(0.0)
    assert gain.excludes_zero
    assert mean_interval(after).low < mean_interval(before).high  # the two intervals overlap


@pytest.mark.parametrize("seed", range(5))
def test_invariants_on_random_cases(seed):
    rng = np.random.default_rng(seed)
    x = rng.random(int(rng.integers(2, 300)))
    iv = mean_interval(x)
    assert iv.low <= iv.mean <= iv.high and iv.low < iv.high
    assert mean_interval(x, level=0.99).half_width > iv.half_width
    shifted = mean_interval(x + 1.0)
    assert shifted.mean == pytest.approx(iv.mean + 1.0)
    assert shifted.half_width == pytest.approx(iv.half_width)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="at least 2"):
        mean_interval([1.0])
    with pytest.raises(ValueError, match="finite"):
        mean_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="level"):
        mean_interval([0.0, 1.0], level=1.0)
    with pytest.raises(ValueError, match="same items"):
        paired_gain([0.0, 1.0], [0.0, 1.0, 1.0])
    assert isinstance(mean_interval([0.0, 1.0]), Interval)


def test_verdict_says_not_better_when_the_interval_holds_zero():
    assert verdict(0.18, 0.135, 0.225) == "larger than its noise"
    assert verdict(-0.05, -0.08, -0.01) == "a loss larger than its noise"
    assert verdict(0.028, -0.003, 0.058).startswith("not distinguishable")


def test_median_ratio_counts_a_seed_that_never_reaches_as_infinite():
    """Ratios 0.5, 0.8 and never (NaN): the median is 0.8, not the 0.65 of the seeds that reached;
    with a majority of seeds never reaching, the median itself is infinite."""
    ratio, low, high, never = median_ratio([50.0, 80.0, float("nan")], [100.0, 100.0, 100.0])
    assert (ratio, never) == (0.8, 1)
    assert low == 0.5 and high == math.inf  # resampling 3 seeds reaches both extremes
    ratio, _, _, never = median_ratio([float("nan"), float("nan"), 60.0], [100.0, 50.0, 100.0])
    assert (ratio, never) == (math.inf, 2)
    ratio, low, high, _ = median_ratio([30.0] * 4, [60.0] * 4)
    assert ratio == low == high == 0.5
    with pytest.raises(ValueError, match="one value per seed"):
        median_ratio([1.0, 2.0], [1.0])


def test_detectable_effect_is_the_paired_t_tests_80_percent_power_point():
    """The smallest effect a benchmark of paired seeds can see: at that true difference the paired t-test over
    n seeds rejects in 80% of simulated benchmarks; below it, less often."""
    from scipy import stats as st

    from trace_core.stats import detectable_effect, seeds_needed

    rng = np.random.default_rng(0)
    for n, sd in ((3, 0.06), (6, 0.10)):
        delta = detectable_effect(sd, n)
        d = rng.normal(delta, sd, size=(40_000, n))
        rejects = st.ttest_1samp(d, 0.0, axis=1).pvalue < 0.05
        assert rejects.mean() == pytest.approx(0.8, abs=0.01)
        d = rng.normal(0.7 * delta, sd, size=(40_000, n))
        assert st.ttest_1samp(d, 0.0, axis=1).pvalue.__lt__(0.05).mean() < 0.7
    # many seeds: the normal approximation (z_0.975 + z_0.8) sd / sqrt(n) = 2.80 sd / sqrt(n)
    assert detectable_effect(1.0, 1000) == pytest.approx(2.8016 / math.sqrt(1000), rel=0.01)
    n = seeds_needed(0.10, 0.03)
    assert detectable_effect(0.10, n) <= 0.03 < detectable_effect(0.10, n - 1)
    assert math.isnan(detectable_effect(0.1, 1)) and math.isnan(detectable_effect(0.0, 5))
    assert seeds_needed(0.0, 0.03) == 0 and seeds_needed(1.0, 1e-4, most=50) == 0
