"""The ``evaluate`` flow (flows/evaluate.py) run through Prefect with the tiny test policy: the
figures it returns are those of the predictions file it writes, on the items it was asked for."""

from __future__ import annotations

import json

import pytest

from tasks import runtime
from trace_rl.config import TrainConfig

# Evaluate flows; the first test starts Prefect's harness (54 s here at load 6, up to 180 s alone).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness"), pytest.mark.timeout(900)]


def test_evaluate_flow_reports_what_its_predictions_file_holds(tiny_model_dir, tmp_path):
    from flows.evaluate import evaluate

    cfg = TrainConfig(engine="hf", family="synth_arith", difficulty=1, max_turns=2,
                      max_new_tokens=16, policy=str(tiny_model_dir), run_name="evaluated")
    out = tmp_path / "preds.jsonl"
    result = evaluate(policy_dir=str(tiny_model_dir), config=cfg, limit=5, samples=3,
                      workdir=str(tmp_path), skip=2, predictions=str(out))
    assert result["predictions"] == str(out) and "per_item" not in result
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # The items after the first ``skip`` of the config's eval split, in order.
    assert [r["id"] for r in rows] == list(runtime.items_for(cfg, cfg.eval_split))[2:7]
    assert (result["items"], result["samples"]) == (5, 3)
    rates = []
    for r in rows:
        rewards = [s["reward"] for s in r["samples"]]
        assert len(rewards) == 3 and set(rewards) <= {0.0, 1.0}
        assert (r["answer"], r["reward"]) == (r["samples"][0]["answer"], rewards[0])
        rates.append(sum(rewards) / 3)
    assert result["accuracy"] == pytest.approx(sum(rates) / 5)
    assert result["mixed_share"] == pytest.approx(sum(0 < x < 1 for x in rates) / 5)
    assert result["any_success"] == pytest.approx(sum(x > 0 for x in rates) / 5)
    assert result["generated_tokens"] > 0


def test_evaluate_flow_names_a_split_with_nothing_left(tiny_model_dir, tmp_path):
    from flows.evaluate import evaluate

    cfg = TrainConfig(engine="hf", family="synth_arith", policy=str(tiny_model_dir))
    n = len(runtime.items_for(cfg, "test"))
    with pytest.raises(ValueError, match=f"split 'test' of synth_arith has no items after the "
                                         f"first {n}"):
        evaluate(policy_dir=str(tiny_model_dir), config=cfg, split="test", skip=n,
                 workdir=str(tmp_path))
