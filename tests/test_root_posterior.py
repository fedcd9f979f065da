"""The per-prompt posterior in Stage 1 and the per-step prediction metrics, on a hand-built step
in a real DuckDB store (``tasks.roots.prompt_posterior``, ``tasks.track.prediction_metrics``),
and both through a real two-step train flow on synth_chain (Prefect, DuckDB, MLflow, HF engine)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from tasks import roots, runtime, track
from tasks.runtime import Paths, StepRef
from test_prefix_stage import node
from trace_rl.config import config_from_mapping
from trace_rl.storage import TreeStore
from trace_rl.storage.schema import ALLOCATION_INPUT, NODE_INPUT_SCHEMA
from trace_rl.storage.store import make_node_id

RUN = "posterior"
LEDGER = dict(method="trace", trajectories=6, prompt_tokens=18, generated_tokens=10, tool_calls=4,
              wall_seconds=0.1)
# Step 0: tree 0 (Stage 1 predicted 0.7) has two two-turn bare rollouts, a success and a
# failure; trees 1 (0.2) and 2 (0.4) two failures each. Stage 2 scored tree 0's turn-1 nodes:
# slot 1 (on the success) 0.8, continued twice, both continuations failed; slot 3 (on the
# failure) 0.3, not continued.
LEVEL0 = [node(0, 0, -1, 0, predicted_v=0.7), node(0, 1, 0, 1), node(0, 2, 1, 2, True, 1.0),
          node(0, 3, 0, 1), node(0, 4, 3, 2, True, 0.0),
          node(1, 0, -1, 0, predicted_v=0.2), node(1, 1, 0, 1), node(1, 2, 1, 2, True, 0.0),
          node(1, 3, 0, 1), node(1, 4, 3, 2, True, 0.0),
          node(2, 0, -1, 0, predicted_v=0.4), node(2, 1, 0, 1, True, 0.0),
          node(2, 2, 0, 1, True, 0.0)]


@pytest.fixture
def workdir(tmp_path):
    store = TreeStore(Paths(tmp_path).db)
    store.init_run(RUN, {"allocator": "trace"})
    store.write_level(RUN, 0, 0, pa.Table.from_pylist(LEVEL0, schema=NODE_INPUT_SCHEMA), None, LEDGER)
    alloc = pa.Table.from_pylist(
        [{"node_id": make_node_id(RUN, 0, 0, slot), "allocator": "trace", "k": k, "item_id": "q0",
          "predicted_v": v, "true_v": None, "gain": None} for slot, k, v in ((1, 2, 0.8), (3, 0, 0.3))],
        schema=pa.schema([(k, t) for k, (t, _) in ALLOCATION_INPUT.items()]))
    conts = [node(0, 5, 1, 2, True, 0.0), node(0, 6, 1, 2, True, 0.0)]
    store.write_level(RUN, 0, 1, pa.Table.from_pylist(conts, schema=NODE_INPUT_SCHEMA), alloc,
                      {**LEDGER, "trajectories": 2})
    return str(tmp_path)


def test_prompt_posterior_counts_the_bare_rollouts_of_earlier_steps(workdir):
    cfg = config_from_mapping({"root_posterior": 2.0})
    after = roots.prompt_posterior(cfg, workdir, RUN, 1)
    s, n = after.counts(["q0", "q1", "q2", "q9"])
    # q0: one success in two bare rollouts; its two failed continuations are not counted
    assert s.tolist() == [1.0, 0.0, 0.0, 0.0] and n.tolist() == [2.0, 2.0, 2.0, 0.0]
    prior = np.array([0.5, 0.5, 0.9, 0.3])
    np.testing.assert_allclose(after.predict(["q0", "q1", "q2", "q9"], prior),
                               [(1 + 1.0) / 4, 1.0 / 4, 1.8 / 4, 0.3])
    assert len(roots.prompt_posterior(cfg, workdir, RUN, 0)) == 0  # step 0 sees no earlier step


def test_prediction_metrics_of_a_stored_step(workdir):
    m = track.prediction_metrics(StepRef(workdir, RUN, 0))
    # roots, one pair per bare rollout: (0.7, 1), (0.7, 0), (0.2, 0) x 2, (0.4, 0) x 2
    assert m["predictor/root_auc"] == pytest.approx(4.5 / 5)
    assert m["predictor/root_brier"] == pytest.approx((0.09 + 0.49 + 2 * 0.04 + 2 * 0.16) / 6)
    # prefixes: (0.8, 1) and (0.3, 0)
    assert m["predictor/prefix_auc"] == 1.0
    assert m["predictor/prefix_brier"] == pytest.approx((0.04 + 0.09) / 2)
    # slot 1 ended in a success predicted 0.8: a continuation flips with 0.2; both flipped
    assert m["predictor/flip_predicted"] == pytest.approx(0.2)
    assert m["predictor/flip_realised"] == 1.0


def test_a_finished_steps_correlation_terms_are_kept_not_read_again(workdir, monkeypatch):
    """The metrics of a finished step keep its calibration terms in the session: the next
    steps' rho uses them without reading the step back, and they are what a read gives."""
    from tasks import correlation
    from trace_rl.session import Session

    with Session().use():
        read = correlation._step_terms(workdir, RUN, 0)  # from the store
    with Session().use():
        track.prediction_metrics(StepRef(workdir, RUN, 0))
        monkeypatch.setattr(runtime, "store", lambda *a: pytest.fail("the store was read again"))
        kept = correlation._step_terms(workdir, RUN, 0)
    assert kept == read and len(kept) == 3 + 1  # three roots, the one continued prefix


def test_a_finished_steps_prompt_counts_are_kept_not_read_again(workdir, monkeypatch):
    """After a step, its bare rollouts are added to the counts as of its start and kept in the
    session: the next step's Stage 1 gets, without reading the store, the rows a read gives."""
    from trace_rl.session import Session

    rows = []  # step 1: tree 0 asks q0 again, tree 1 asks q7 (new)
    for tree, item, rewards in ((0, "q0", (1.0, 1.0)), (1, "q7", (0.5, 0.0))):
        rows.append(dict(node(tree, 0, -1, 0), item_id=item))
        rows += [dict(node(tree, 1 + i, 0, 1, True, r), item_id=item) for i, r in enumerate(rewards)]
    TreeStore(Paths(Path(workdir)).db).write_level(
        RUN, 1, 0, pa.Table.from_pylist(rows, schema=NODE_INPUT_SCHEMA), None, LEDGER)
    with Session().use():
        read = [roots.bare_counts(workdir, RUN, s) for s in (1, 2)]  # from the store
    with Session().use():
        for step in (0, 1):
            roots.remember_bare_counts(workdir, RUN, step,
                                       runtime.step_trees(StepRef(workdir, RUN, step)))
        monkeypatch.setattr(runtime, "store", lambda *a: pytest.fail("the store was read again"))
        kept = [roots.bare_counts(workdir, RUN, s) for s in (1, 2)]
    assert kept == read
    assert [(r["item_id"], r["s"], r["n"], r["last"]) for r in kept[1]] == [
        ("q0", 3.0, 4, 1), ("q1", 0.0, 2, 0), ("q2", 0.0, 2, 0), ("q7", 0.5, 2, 1)]


CHAIN = {"engine": "hf", "steps": 2, "root_budget": 8, "pool_size": 4, "max_per_root": 2,
         "max_turns": 5, "max_new_tokens": 16, "multiplier": 1, "family": "synth_chain",
         "chain_hops": "2:1", "chain_train_items": 4, "root_posterior": 4.0, "plot_every": 0,
         "eval_items": 0}
"""Every step rolls out each of the 4 prompts twice, so step 1 scores prompts seen at step 0."""


@pytest.mark.slow
@pytest.mark.timeout(900)  # Prefect's harness (up to 180 s) and a train flow: 51 s here at load 5
@pytest.mark.usefixtures("prefect_harness")
def test_chain_flow_scores_roots_by_the_posterior_and_logs_prediction_metrics(tiny_model_dir, tmp_path):
    from mlflow import MlflowClient

    from flows.train import train
    from trace_rl.rollout.treeio import history_text

    config = {**CHAIN, "policy": str(tiny_model_dir)}
    result = train(config=config, workdir=str(tmp_path))
    run_id, workdir = result["run_id"], str(tmp_path)
    cfg = config_from_mapping(config)
    store = TreeStore(Path(workdir) / "trace.duckdb", create=False)
    seen = {r["item_id"]: (r["s"], r["n"]) for r in store.query(
        "SELECT item_id, sum(reward) AS s, count(*) AS n FROM nodes WHERE run_id = $r AND step = 0 "
        "AND is_leaf AND level = 0 GROUP BY item_id", {"r": run_id}).to_pylist()}
    scored = store.query("SELECT item_id, predicted_v FROM nodes WHERE run_id = $r AND step = 1 "
                         "AND depth = 0 ORDER BY item_id", {"r": run_id}).to_pylist()
    assert {r["item_id"] for r in scored} == set(seen) and len(seen) == 4
    items = runtime.items_for(cfg, "train")
    text = runtime.load_predictor(cfg.predictor, cfg.seed, workdir, run_id, 0).predict(
        [history_text(items[r["item_id"]].question, []) for r in scored])
    for r, p in zip(scored, text):
        s, n = seen.get(r["item_id"], (0.0, 0))
        assert r["predicted_v"] == pytest.approx((s + 4.0 * p) / (n + 4.0)), r
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = client.get_run(result["mlflow_run_id"]).data.metrics
    history = client.get_metric_history(result["mlflow_run_id"], "predictor/root_brier")
    assert sorted(h.step for h in history) == [0, 1]
    # what was logged is what the stored step says
    for step in (0, 1):
        expect = track.prediction_metrics(StepRef(workdir, run_id, step))
        got = {h.step: h.value for h in history}[step]
        assert got == pytest.approx(expect["predictor/root_brier"])
    assert set(track.prediction_metrics(StepRef(workdir, run_id, 1))) <= set(logged)
    # studies.roots reads the same run: the stored ranker's AUC is the logged one, and the
    # posterior ranker over the text predictor (strength 4) is what Stage 1 used
    from studies.roots import root_aucs

    rows = root_aucs(workdir, run_id, strength=4.0)
    assert [r["step"] for r in rows] == [0, 1] and [r["rollouts"] for r in rows] == [8, 8]
    assert rows[1]["recurring"] == 4
    for r in rows:
        expect = track.prediction_metrics(StepRef(workdir, run_id, r["step"])).get("predictor/root_auc")
        assert (np.isnan(r["stored"]) and expect is None) or r["stored"] == pytest.approx(expect)
        assert (np.isnan(r["stored"]) and np.isnan(r["posterior 4"])) or \
            r["posterior 4"] == pytest.approx(r["stored"])
