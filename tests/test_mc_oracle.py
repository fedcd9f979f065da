"""The Monte-Carlo oracle (``TrainConfig.oracle_rollouts``): each Stage 1 and Stage 2 candidate
scored by the success rate of k extra rollouts of the current policy from it
(``tasks.expand.measure_roots``, ``measure_prefixes``), which are counted apart
(``predictor/oracle_*``) and never stored or trained on."""

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


def test_oracle_seed_is_per_step_and_stage_and_apart_from_the_trees_seeds():
    seeds = {oracle_seed(3, s, stage) for s in range(50) for stage in (1, 2)}
    kept = {rollout_seed(3, s, level, wave) for s in range(50) for level in (0, 1)
            for wave in range(3)}
    assert len(seeds) == 100 and not seeds & kept


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


CFG = {"engine": "hf", "steps": 1, "root_budget": 4, "pool_size": 8, "max_turns": 2,
       "max_new_tokens": 48, "multiplier": 1, "family": "synth_arith", "difficulty": 1,
       "plot_every": 0, "eval_items": 0, "allocator": "trace_cover", "oracle_rollouts": K}


def _values(store, run: str, level: int) -> list[dict]:
    """The stored allocation decisions of one level: item, depth, prediction and the node's
    backed-up value V^ (its leaves' mean reward; none for a candidate given no rollout)."""
    return store.query("SELECT a.item_id, n.depth, a.predicted_v, n.value FROM allocations a "
                       "LEFT JOIN nodes n USING (node_id) WHERE a.run_id = $r AND a.level = $l "
                       "ORDER BY a.node_id", {"r": run, "l": level}).to_pylist()


def _oracle_run(respond, tiny_model_dir, tmp_path):
    from flows.train import train
    from scripted_engine import scripted_rollouts
    from tasks.runtime import items_for
    from trace_rl.config import config_from_mapping
    from trace_rl.storage.store import TreeStore

    cfg = {**CFG, "policy": str(tiny_model_dir)}
    with scripted_rollouts(respond):
        summary = train(config=cfg, workdir=str(tmp_path))
    items = items_for(config_from_mapping(cfg, "test"), "train")
    return summary, TreeStore(tmp_path / "trace.duckdb", create=False), items


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.timeout(900)
def test_a_run_with_the_monte_carlo_oracle(tiny_model_dir, tmp_path):
    """One step of trace_cover with ``oracle_rollouts`` K, scripted so that a request's copy j is
    answered right at once iff j < ``_right(question)``: every Stage 1 candidate's stored value is
    that count over K, and so is every Stage 2 candidate's (one-turn episodes: each tree's root);
    the step's trees hold only the leaf budget's rollouts (the ledger too) and the oracle's K
    rollouts per candidate of both stages and their tokens are the step's ``predictor/oracle_*``."""
    from transformers import AutoTokenizer

    from scripted_engine import arith_answer, question_of, say

    def answer(question: str, j: int) -> str:
        return say("answer", arith_answer(question) + (j >= _right(question)), "at once")

    summary, store, items = _oracle_run(lambda context, j, seed: answer(question_of(context), j),
                                        tiny_model_dir, tmp_path)
    run, m = summary["run_id"], summary["last_metrics"]
    roots, prefixes = _values(store, run, 0), _values(store, run, 1)
    assert len(roots) == CFG["pool_size"] and prefixes and {p["depth"] for p in prefixes} == {0}
    for d in roots + prefixes:
        assert d["predicted_v"] == _right(items[d["item_id"]].question) / K
    assert len({d["predicted_v"] for d in roots}) > 1  # a ranking, not one value
    stored = store.query("SELECT count(*) AS n FROM nodes WHERE run_id = $r AND is_leaf",
                         {"r": run}).to_pylist()[0]
    leaves = CFG["root_budget"] * (1 + CFG["multiplier"])
    assert stored["n"] == m["rollout/leaves"] == m["ledger/trajectories"] <= leaves
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokens = {d["item_id"]: sum(len(tok.encode(answer(items[d["item_id"]].question, j),
                                               add_special_tokens=False)) for j in range(K))
              for d in roots}
    oracle_tokens = sum(tokens.values()) + sum(tokens[p["item_id"]] for p in prefixes)
    assert m["predictor/oracle_rollouts"] == (len(roots) + len(prefixes)) * K
    assert m["predictor/oracle_tokens"] == oracle_tokens
    row = store.query("SELECT metrics_json FROM steps WHERE run_id = $r", {"r": run}).to_pylist()
    assert json.loads(row[0]["metrics_json"])["predictor/oracle_tokens"] == oracle_tokens
    assert m["ledger/generated_tokens"] < oracle_tokens  # the oracle's cost is not the method's


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.timeout(900)
def test_the_oracle_measures_prefixes_from_their_own_turns(tiny_model_dir, tmp_path):
    """Two-turn episodes: copy j of a request makes the calculator call right iff
    j < ``_right(question)``, then answers what the calculator returned, so an episode succeeds
    iff its call was right. A prompt's oracle value is ``_right / K`` and a depth-1 prefix's is 1
    or 0 by its call, exactly its backed-up value and not its prompt's: the oracle's
    continuations were sampled from the prefix, not from the root."""
    from scripted_engine import arith_problem, observations_of, question_of, say

    def respond(context: str, j: int, seed: int | None) -> str:
        question, seen = question_of(context), observations_of(context)
        if seen:
            return say("answer", seen[-1], "what it returned")
        value, [(op, n)] = arith_problem(question)
        return say("call", f"{value} {op} {n + (j >= _right(question))}", "one step")

    summary, store, items = _oracle_run(respond, tiny_model_dir, tmp_path)
    run = summary["run_id"]
    for d in _values(store, run, 0):
        assert d["predicted_v"] == _right(items[d["item_id"]].question) / K
    deep = [d for d in _values(store, run, 1) if d["depth"] == 1]
    assert deep and all(d["predicted_v"] == d["value"] in (0.0, 1.0) for d in deep)
    assert any(d["predicted_v"] != _right(items[d["item_id"]].question) / K for d in deep)
