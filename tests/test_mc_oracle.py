"""The Monte-Carlo oracle of Stage 1 (``TrainConfig.oracle_rollouts``): each candidate scored by
the success rate of k extra rollouts of the current policy (``tasks.expand.measure_roots``),
which are counted apart (``predictor/oracle_*``) and never stored or trained on."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trace_core.posterior import root_values
from trace_core.seeds import oracle_seed, rollout_seed
from trace_rl.config import TrainConfig


def test_measured_rates_are_the_values_as_they_are():
    """Measured rates win over the text predictions, the posterior and no scaling applies (the
    family's oracle is scaled to the policy's success so far; a measured rate is the policy's)."""
    text = np.array([0.9, 0.9, 0.9])
    v = root_values(text, ["a", "b", "c"], ["a"], np.array([0.0]), np.array([4.0]), strength=4.0,
                    measured=np.array([0.0, 0.25, 1.0]))
    assert v.tolist() == [0.0, 0.25, 1.0]


def test_oracle_seed_is_per_step_and_apart_from_the_trees_seeds():
    seeds = {oracle_seed(3, s) for s in range(50)}
    kept = {rollout_seed(3, s, level, wave) for s in range(50) for level in (0, 1)
            for wave in range(3)}
    assert len(seeds) == 50 and not seeds & kept


def test_oracle_rollouts_enter_the_run_id_only_when_set():
    base = TrainConfig(family="synth_arith", allocator="trace_cover")
    assert TrainConfig(family="synth_arith", allocator="trace_cover",
                       oracle_rollouts=0).config_hash == base.config_hash
    assert TrainConfig(family="synth_arith", allocator="trace_cover",
                       oracle_rollouts=8).config_hash != base.config_hash
    with pytest.raises(ValueError, match="one\\s+oracle"):
        TrainConfig(family="synth_arith", root_oracle=True, oracle_rollouts=8)


K = 4


def _right(question: str) -> int:
    """How many of the K copies of a request the script answers right: 0 to K, fixed per
    question, so a candidate's oracle success rate is exactly ``_right(question) / K``."""
    from scripted_engine import uniform

    return int((K + 1) * uniform("oracle", question))


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.timeout(900)
def test_a_run_with_the_monte_carlo_oracle(tiny_model_dir, tmp_path):
    """One step of trace_cover with ``oracle_rollouts`` K, scripted so that a request's copy j is
    answered right iff j < ``_right(question)``: every candidate's stored Stage 1 value is that
    count over K; the step's trees hold only the leaf budget's rollouts (the ledger too) and the
    oracle's K rollouts per candidate and their tokens are the step's ``predictor/oracle_*``."""
    from transformers import AutoTokenizer

    from flows.train import train
    from scripted_engine import arith_answer, question_of, say, scripted_rollouts
    from trace_rl.storage.store import TreeStore

    def respond(context: str, j: int, seed: int | None) -> str:
        question = question_of(context)
        gold = arith_answer(question)
        return say("answer", gold if j < _right(question) else gold + 1, "at once")

    cfg = {"engine": "hf", "steps": 1, "root_budget": 4, "pool_size": 8, "max_turns": 2,
           "max_new_tokens": 48, "multiplier": 1, "family": "synth_arith", "difficulty": 1,
           "plot_every": 0, "eval_items": 0, "allocator": "trace_cover", "oracle_rollouts": K,
           "policy": str(tiny_model_dir)}
    with scripted_rollouts(respond):
        summary = train(config=cfg, workdir=str(tmp_path))
    store = TreeStore(tmp_path / "trace.duckdb", create=False)
    run = summary["run_id"]
    decided = store.query("SELECT item_id, predicted_v FROM allocations WHERE run_id = $r AND "
                          "level = 0", {"r": run}).to_pylist()
    from tasks.runtime import items_for
    from trace_rl.config import config_from_mapping

    items = items_for(config_from_mapping(cfg, "test"), "train")
    questions = {d["item_id"]: items[d["item_id"]].question for d in decided}
    assert len(decided) == cfg["pool_size"]
    assert {d["item_id"]: d["predicted_v"] for d in decided} == \
        {i: _right(q) / K for i, q in questions.items()}
    assert len({d["predicted_v"] for d in decided}) > 1  # a ranking, not one value
    m = summary["last_metrics"]
    leaves = cfg["root_budget"] * (1 + cfg["multiplier"])
    stored = store.query("SELECT count(*) AS n, sum(gen_tokens) AS t FROM nodes WHERE run_id = $r "
                         "AND is_leaf", {"r": run}).to_pylist()[0]
    assert stored["n"] == m["rollout/leaves"] == m["ledger/trajectories"] <= leaves
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    oracle_tokens = sum(len(tok.encode(say("answer", arith_answer(q) + (j >= _right(q)),
                                           "at once"), add_special_tokens=False))
                        for q in questions.values() for j in range(K))
    assert m["predictor/oracle_rollouts"] == cfg["pool_size"] * K
    assert m["predictor/oracle_tokens"] == oracle_tokens
    row = store.query("SELECT metrics_json FROM steps WHERE run_id = $r", {"r": run}).to_pylist()
    assert json.loads(row[0]["metrics_json"])["predictor/oracle_tokens"] == oracle_tokens
    assert m["ledger/generated_tokens"] < oracle_tokens  # the oracle's cost is not the method's
