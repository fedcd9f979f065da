"""trace_core.posterior: the shrinkage formula, its limits, accumulation, state, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from trace_core.posterior import PromptPosterior


def test_unseen_prompts_return_the_prior():
    post = PromptPosterior(strength=4.0)
    prior = np.array([0.1, 0.5, 0.93])
    np.testing.assert_allclose(post.predict(["a", "b", "c"], prior), prior)
    post.update(["a"], np.array([3.0]), np.array([4.0]))
    out = post.predict(["a", "zz"], np.array([0.2, 0.37]))
    assert out[1] == pytest.approx(0.37)
    assert out[0] == pytest.approx((3 + 4 * 0.2) / (4 + 4))


def test_shrinkage_limits():
    prior = np.array([0.8])
    # many observations: the estimate goes to the observed rate whatever the prior
    post = PromptPosterior(strength=4.0)
    post.update(["p"], np.array([100.0]), np.array([10_000.0]))
    assert post.predict(["p"], prior)[0] == pytest.approx(0.01, abs=5e-4)
    # a huge strength pins the estimate to the prior
    stiff = PromptPosterior(strength=1e9)
    stiff.update(["p"], np.array([0.0]), np.array([8.0]))
    assert stiff.predict(["p"], prior)[0] == pytest.approx(0.8, abs=1e-7)
    # a tiny strength gives the observed rate after a few rollouts
    loose = PromptPosterior(strength=1e-9)
    loose.update(["p"], np.array([1.0]), np.array([4.0]))
    assert loose.predict(["p"], prior)[0] == pytest.approx(0.25, abs=1e-7)


def test_estimate_lies_between_prior_and_observed_rate():
    rng = np.random.default_rng(3)
    post = PromptPosterior(strength=2.5)
    ids = [f"q{i}" for i in range(50)]
    n = rng.integers(1, 9, size=50).astype(float)
    s = np.floor(rng.random(50) * (n + 1))
    post.update(ids, s, n)
    prior = rng.random(50)
    est = post.predict(ids, prior)
    lo, hi = np.minimum(prior, s / n), np.maximum(prior, s / n)
    assert np.all(est >= lo - 1e-12) and np.all(est <= hi + 1e-12)


def test_updates_accumulate_including_repeated_ids():
    post = PromptPosterior(strength=4.0)
    post.update(["a", "b"], np.array([1.0, 0.0]), np.array([4.0, 2.0]))
    post.update(["a", "a"], np.array([2.0, 0.5]), np.array([2.0, 1.0]))
    s, n = post.counts(["a", "b", "c"])
    np.testing.assert_allclose(s, [3.5, 0.0, 0.0])
    np.testing.assert_allclose(n, [7.0, 2.0, 0.0])
    assert post.predict(["a"], np.array([0.5]))[0] == pytest.approx((3.5 + 2.0) / 11.0)
    assert len(post) == 2


def test_state_round_trip():
    post = PromptPosterior(strength=3.0)
    post.update(["x", "y"], np.array([2.0, 1.0]), np.array([5.0, 1.0]))
    other = PromptPosterior()
    other.load_state_dict(post.state_dict())
    assert other.strength == 3.0
    prior = np.array([0.3, 0.6, 0.9])
    np.testing.assert_allclose(other.predict(["x", "y", "w"], prior),
                               post.predict(["x", "y", "w"], prior))
    assert other.state_dict() == post.state_dict()


@pytest.mark.parametrize("strength", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_strength(strength):
    with pytest.raises(ValueError, match="strength"):
        PromptPosterior(strength)


def test_bad_input_names_what_and_where():
    post = PromptPosterior()
    with pytest.raises(ValueError, match="shape"):
        post.update(["a", "b"], np.array([1.0]), np.array([1.0, 1.0]))
    with pytest.raises(ValueError, match="'b'.*index 1"):
        post.update(["a", "b"], np.array([1.0, 3.0]), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="successes"):
        post.update(["a"], np.array([-1.0]), np.array([2.0]))
    with pytest.raises(ValueError, match="single string"):
        post.predict("abc", np.array([0.5, 0.5, 0.5]))
    with pytest.raises(ValueError, match=r"prompt_ids\[1\]"):
        post.update(["a", 7], np.array([1.0, 1.0]), np.array([1.0, 1.0]))
    with pytest.raises(ValueError, match="prior"):
        post.predict(["a"], np.array([1.5]))
    with pytest.raises(ValueError, match="prior has shape"):
        post.predict(["a", "b"], np.array([0.5]))
    with pytest.raises(ValueError, match="lacks"):
        post.load_state_dict({"strength": 2.0})
    # a failed update leaves the counts untouched
    assert len(post) == 0
