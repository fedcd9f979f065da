"""trace_core.predictor: metrics against hand-worked values, the featuriser, online fitting, checkpoints."""

import itertools

import numpy as np
import pytest
import torch

from trace_core.predictor import (
    ConstantPredictor,
    FeaturePredictor,
    HashedNgramConfig,
    HashedNgramFeaturizer,
    HashedNgramPredictor,
    HeadConfig,
    auc,
    brier,
    ece,
)

# ---- metrics ----


def test_brier_hand_worked():
    assert brier(np.array([0.2, 0.9]), np.array([0, 1])) == pytest.approx((0.04 + 0.01) / 2)
    assert brier(np.array([0.5]), np.array([0.5])) == 0.0


def test_ece_hand_worked():
    p = np.array([0.1, 0.15, 0.8, 0.95])
    y = np.array([0, 1, 1, 1])
    # bin [0, .5): mean p .125, mean y .5 -> .375 * 2/4; bin [.5, 1]: .875 vs 1 -> .125 * 2/4.
    assert ece(p, y, n_bins=2) == pytest.approx(0.1875 + 0.0625)
    # p = 1 falls in the last bin, and a perfectly calibrated constant has zero error.
    assert ece(np.array([1.0, 1.0]), np.array([1, 1])) == 0.0
    assert ece(np.full(4, 0.25), np.array([1, 0, 0, 0])) == pytest.approx(0.0)


def test_auc_hand_worked_with_ties():
    assert auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    # Positives {.5, .9}, negatives {.5, .2}: pairs score .5 (tie), 1, 1, 1.
    assert auc(np.array([0.5, 0.5, 0.2, 0.9]), np.array([1, 0, 0, 1])) == pytest.approx(3.5 / 4)
    assert auc(np.full(4, 0.3), np.array([0, 1, 0, 1])) == pytest.approx(0.5)


def test_auc_matches_pairwise_loop():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 30))
        p = rng.integers(0, 5, size=n) / 4.0  # coarse scores, so ties are common
        y = rng.integers(0, 2, size=n)
        if y.min() == y.max():
            continue
        pos, neg = p[y == 1], p[y == 0]
        naive = np.mean([1.0 if a > b else 0.5 if a == b else 0.0 for a, b in itertools.product(pos, neg)])
        assert auc(p, y) == pytest.approx(naive)


def test_metrics_reject_bad_input():
    with pytest.raises(ValueError, match="equal length"):
        brier(np.array([0.1, 0.2]), np.array([1]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        ece(np.array([1.2]), np.array([1]))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        brier(np.array([np.nan]), np.array([1]))
    with pytest.raises(ValueError, match="both classes"):
        auc(np.array([0.1, 0.2]), np.array([1, 1]))
    with pytest.raises(ValueError, match="binary"):
        auc(np.array([0.1, 0.2]), np.array([0.5, 1]))
    with pytest.raises(ValueError, match="empty"):
        brier(np.array([]), np.array([]))


# ---- featuriser ----


def test_hashed_features_are_stable_and_count_ngrams():
    cfg = HashedNgramConfig(dim=64, word_ngrams=(1, 2))
    a, b = HashedNgramFeaturizer(cfg), HashedNgramFeaturizer(cfg)
    x = a(["q1 topic2 | search | search", "q1 topic2"]).to_dense()  # [2, 64]
    assert x.shape == (2, 64) and x.dtype == torch.float32
    assert torch.equal(x, b(["q1 topic2 | search | search", "q1 topic2"]).to_dense())
    # 6 unigrams + 5 bigrams in the first text; counts enter as log(1 + c) (collisions add up).
    assert float(torch.expm1(x[0]).sum()) == pytest.approx(11, abs=1e-4)
    assert float(torch.expm1(x[1]).sum()) == pytest.approx(3, abs=1e-4)


def test_char_ngrams_add_features():
    words_only = HashedNgramFeaturizer(HashedNgramConfig(dim=256, word_ngrams=(1,)))
    with_chars = HashedNgramFeaturizer(HashedNgramConfig(dim=256, word_ngrams=(1,), char_ngrams=(3,)))
    # "ab" -> "<ab>" has 2 char trigrams.
    assert float(torch.expm1(words_only(["ab"]).to_dense()).sum()) == pytest.approx(1)
    assert float(torch.expm1(with_chars(["ab"]).to_dense()).sum()) == pytest.approx(3)


def test_config_validation():
    with pytest.raises(ValueError, match="dim"):
        HashedNgramConfig(dim=0)
    with pytest.raises(ValueError, match="at least one"):
        HashedNgramConfig(word_ngrams=(), char_ngrams=())
    with pytest.raises(ValueError, match="epochs"):
        HeadConfig(epochs=0)


# ---- online fitting ----


def _task(rng, n):
    """Histories whose success rate depends on a token and on a turn count, as in the simulator."""
    kind = rng.integers(0, 3, size=n)
    turns = rng.integers(0, 3, size=n)
    rate = np.array([0.9, 0.5, 0.1])[kind] * (1 - 0.2 * turns)
    text = [f"kind{k} " + " | deadend" * t for k, t in zip(kind, turns)]
    return text, rate, (rng.random(n) < rate).astype(float)


def test_predictor_learns_online_and_beats_constant():
    rng = np.random.default_rng(0)
    pred, const = HashedNgramPredictor(HashedNgramConfig(dim=512), HeadConfig(seed=1)), ConstantPredictor()
    for _ in range(15):
        text, _, y = _task(rng, 300)
        stats = pred.fit(text, y)
        const.fit(text, y)
        assert np.isfinite(stats["loss"]) and stats["examples"] > 0
    text, rate, y = _task(rng, 2000)
    p = pred.predict(text)
    assert p.shape == (2000,) and np.all((p >= 0) & (p <= 1))
    assert brier(p, y) < brier(const.predict(text), y) - 0.05
    assert np.mean((p - rate) ** 2) < 0.01


def test_weights_shift_the_fit():
    texts = ["same history"] * 40
    targets = np.array([1.0] * 20 + [0.0] * 20)
    heavy_ones = np.array([9.0] * 20 + [1.0] * 20)
    pred = HashedNgramPredictor(HashedNgramConfig(dim=64), HeadConfig(epochs=300, lr=1e-2, replay_steps=1))
    pred.fit(texts, targets, heavy_ones)
    # The weighted MSE optimum is the weighted mean, 0.9 (unweighted it would be 0.5).
    assert pred.predict(["same history"])[0] == pytest.approx(0.9, abs=0.02)


def test_same_seed_same_predictor_and_checkpoint_round_trip():
    rng = np.random.default_rng(4)
    text, _, y = _task(rng, 200)
    a = HashedNgramPredictor(HashedNgramConfig(dim=128), HeadConfig(seed=3))
    b = HashedNgramPredictor(HashedNgramConfig(dim=128), HeadConfig(seed=3))
    a.fit(text, y)
    b.fit(text, y)
    np.testing.assert_array_equal(a.predict(text), b.predict(text))
    # A fresh predictor loaded from a's checkpoint predicts and keeps learning exactly like a.
    c = HashedNgramPredictor(HashedNgramConfig(dim=128), HeadConfig(seed=99))
    c.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a.predict(text), c.predict(text))
    text2, _, y2 = _task(rng, 200)
    a.fit(text2, y2)
    c.fit(text2, y2)
    np.testing.assert_allclose(a.predict(text), c.predict(text), atol=1e-6)


def test_a_different_featurizer_plugs_in():
    class Length:
        dim = 1

        def __call__(self, histories):
            return torch.tensor([[len(h) / 10.0] for h in histories])  # [B, 1]

    pred = FeaturePredictor(Length(), HeadConfig(hidden=0, epochs=200, lr=5e-2))
    texts = ["a" * 2, "a" * 18] * 10
    pred.fit(texts, np.array([0.0, 1.0] * 10))
    p = pred.predict(["a" * 2, "a" * 18])
    assert p[0] < 0.3 and p[1] > 0.7


def test_fit_rejects_bad_input():
    pred = HashedNgramPredictor(HashedNgramConfig(dim=16))
    with pytest.raises(ValueError, match="equal length"):
        pred.fit(["a", "b"], np.array([0.5]))
    with pytest.raises(ValueError, match="targets"):
        pred.fit(["a"], np.array([1.5]))
    with pytest.raises(ValueError, match="weights"):
        pred.fit(["a"], np.array([0.5]), np.array([-1.0]))
    assert pred.predict([]).shape == (0,)
