"""tasks/track.py on a hand-built run in a real DuckDB store: the step's tree metrics (what the
store's SQL views give) and the run's summary (evaluations, steps, spend) against hand-worked figures,
and the summary's MLflow metrics through a real MLflow store."""

from __future__ import annotations

import json

import pytest

from trace_rl.config import TrainConfig
from tasks import learn, runtime, track
from tasks.runtime import StepRef
from trace_core.stats import paired_gain
from trace_rl.rollout.treeio import LevelBatch
from trace_rl.rollout.types import Action, Episode, Turn

RUN = "tracked"


def turn(n: int, final: bool = False) -> Turn:
    action = Action(kind="answer", answer=str(n)) if final else \
        Action(kind="tool", tool="calculator", arguments={"expression": f"{n}+1"})
    return Turn(gen_ids=[100 + n] * (n + 1), gen_logprobs=[-0.5] * (n + 1), text=f"turn {n}",
                action=action, obs_text=None if final else "x", obs_ids=[] if final else [7])


def rollouts(batch: LevelBatch, tree: int, outcomes: list[tuple[int, float]]) -> None:
    """Tree ``tree``: one bare rollout per (turns, reward)."""
    batch.open_tree(tree, f"q{tree}")
    batch.add_root(tree, [1, 2], f"question {tree}", 0.5, len(outcomes))
    for turns, reward in outcomes:
        ts = [turn(i) for i in range(turns - 1)] + [turn(turns - 1, True)]
        batch.add_episode(tree, 0, 0, Episode("q", [1, 2], ts, True, reward))


@pytest.fixture
def workdir(tmp_path):
    """Step 0 of RUN, backed up. Tree 0: two two-turn rollouts, 1.0 and 0.0 (a mixed root);
    tree 1: a two-turn and a one-turn rollout, both 0.0."""
    store = runtime.store(str(tmp_path))
    store.init_run(RUN, TrainConfig(allocator="trace").to_dict())  # what the train flow stores
    batch = LevelBatch("synth_arith", "trace")
    rollouts(batch, 0, [(2, 1.0), (2, 0.0)])
    rollouts(batch, 1, [(2, 0.0), (1, 0.0)])
    store.write_level(RUN, 0, 0, batch.table(), ledger=dict(
        method="trace", trajectories=4, prompt_tokens=8, generated_tokens=30, tool_calls=3,
        wall_seconds=1.5))
    learn.tree_advantages.fn(TrainConfig(allocator="trace"), StepRef(str(tmp_path), RUN, 0))
    return str(tmp_path)


def test_tree_metrics_of_a_hand_worked_step(workdir):
    m = track.tree_metrics(StepRef(workdir, RUN, 0))
    assert m["rollout/leaves"] == 4 and m["alloc/active_roots"] == 2
    assert m["rollout/reward_mean"] == pytest.approx(0.25)
    assert m["rollout/depth_mean"] == pytest.approx((2 + 2 + 2 + 1) / 4)
    assert m["tree/effective_ratio"] == pytest.approx(0.5)  # tree 0's root only
    # Internal nodes: two roots and three first turns; mixed: tree 0's root.
    assert m["tree/mixed_anchor_share"] == pytest.approx(1 / 5)
    # One ordered sibling pair differs: tree 0's success turn over its failure turn.
    assert m["tree/contrast_pairs_per_100_leaves"] == pytest.approx(100 / 4)
    assert (m["ledger/trajectories"], m["ledger/generated_tokens"], m["ledger/tool_calls"],
            m["ledger/wall_seconds"]) == (4, 30, 3, 1.5)


VIEWS_SQL = (  # the figures as a user reads them with the store's views
    "SELECT count(*) FILTER (WHERE is_leaf) AS leaves, avg(reward) FILTER (WHERE is_leaf) AS "
    "reward, avg(depth) FILTER (WHERE is_leaf) AS depth, count(*) FILTER (WHERE NOT is_leaf) AS "
    "internal, count(*) FILTER (WHERE depth = 0) AS roots, "
    "count(*) FILTER (WHERE depth = 0 AND value > 0 AND value < 1) AS mixed, "
    "(SELECT count(*) FROM mixed_anchors WHERE run_id = $r AND step = $s) AS anchors, "
    "(SELECT count(*) FROM contrast_pairs WHERE run_id = $r AND step = $s) AS pairs "
    "FROM nodes WHERE run_id = $r AND step = $s")


def test_tree_figures_are_what_the_store_views_give(tmp_path):
    """On 40 random trees (1-3 children a node, rewards 0, 0.5 or 1, backed up as the flow
    does), the in-memory figures equal the mixed_anchors and contrast_pairs views' counts."""
    import numpy as np
    import pyarrow as pa

    from test_prefix_stage import node
    from trace_rl.storage.schema import NODE_INPUT_SCHEMA

    rng, rows = np.random.default_rng(7), []
    for tree in range(40):
        rows.append(node(tree, 0, -1, 0))
        frontier = [(0, 0)]
        while frontier:
            parent, depth = frontier.pop(0)
            for _ in range(int(rng.integers(1, 4))):
                slot = len([r for r in rows if r["tree_id"] == tree])
                if depth + 1 == 3 or rng.random() < 0.4:
                    rows.append(node(tree, slot, parent, depth + 1, True,
                                     float(rng.choice([0.0, 0.5, 1.0]))))
                else:
                    rows.append(node(tree, slot, parent, depth + 1))
                    frontier.append((slot, depth + 1))
    store = runtime.store(str(tmp_path))
    store.init_run(RUN, TrainConfig().to_dict())
    store.write_level(RUN, 0, 0, pa.Table.from_pylist(rows, schema=NODE_INPUT_SCHEMA))
    at = StepRef(str(tmp_path), RUN, 0)
    learn.tree_advantages.fn(TrainConfig(), at)  # the stored values the views' "mixed" reads
    v = store.query(VIEWS_SQL, {"r": RUN, "s": 0}).to_pylist()[0]
    m = track.tree_figures(runtime.step_trees(at).batch)
    assert v["anchors"] > 10 and v["pairs"] > 10 and 0 < v["mixed"] < v["roots"] == 40
    assert m == pytest.approx({
        "rollout/reward_mean": v["reward"], "rollout/leaves": v["leaves"],
        "rollout/depth_mean": v["depth"], "tree/effective_ratio": v["mixed"] / v["roots"],
        "tree/mixed_anchor_share": v["anchors"] / v["internal"],
        "tree/contrast_pairs_per_100_leaves": 100 * v["pairs"] / v["leaves"],
        "alloc/active_roots": v["roots"]})


def record_evals(workdir: str, before: list[float], after: list[float]) -> None:
    store = runtime.store(workdir)
    for step, per_item in ((0, before), (2, after)):
        store.record_eval(dict(run_id=RUN, step=step, policy_dir="p", split="test", skip=0,
                               items=len(per_item), samples=2, temperature=1.0,
                               accuracy=sum(per_item) / len(per_item), ci_low=0.1, ci_high=0.9,
                               per_item=per_item, generated_tokens=10, tool_calls=1))


def test_run_summary_reads_evaluations_steps_and_spend(workdir):
    store = runtime.store(workdir)
    store.mark_step(RUN, 0, "complete", {"rollout/reward_mean": 0.25, "tree/effective_ratio": 0.5,
                                          "rollout/leaves": 4, "ledger/generated_tokens": 30})
    store.mark_step(RUN, 1, "failed")  # not complete: not in the summary
    before, after = [0.0, 0.5, 0.5, 1.0], [0.5, 1.0, 0.5, 1.0]
    record_evals(workdir, before, after)
    s = track.run_summary(workdir, RUN)
    assert s["steps"] == [{"step": 0, "reward": 0.25, "effective_ratio": 0.5, "leaves": 4,
                           "generated_tokens": 30}]
    assert (s["leaves"], s["generated_tokens"]) == (4, 30)
    assert s["before"] == {"step": 0, "accuracy": 0.5, "ci_low": 0.1, "ci_high": 0.9,
                           "items": 4, "samples": 2}
    assert s["after"]["step"] == 2 and s["after"]["accuracy"] == pytest.approx(0.75)
    g = paired_gain(before, after)
    assert s["gain"]["mean"] == pytest.approx(0.25) and g.mean == pytest.approx(0.25)
    assert (s["gain"]["low"], s["gain"]["high"]) == (g.low, g.high) and g.low < 0.25 < g.high
    md = track.summary_markdown(s, {"SQL": "trace sql"})
    assert "| before (step 0) | 0.500 | [0.100, 0.900] |" in md
    assert "| after (step 2) | 0.750 | [0.100, 0.900] |" in md
    assert f"| gain (paired over 4 items) | +0.250 | [{g.low:+.3f}, {g.high:+.3f}] |" in md
    assert "| 0 | 0.250 | 0.50 | 4 | 30 |" in md and "* SQL: `trace sql`" in md
    assert "Spent: 4 leaves, 30 generated tokens in training." in md


def test_a_run_without_evaluations_has_no_gain(workdir):
    s = track.run_summary(workdir, RUN)
    assert s["before"] is None and s["after"] is None and s["gain"] is None and s["steps"] == []
    assert "held-out accuracy" not in track.summary_markdown(s, {})


@pytest.mark.slow  # starts the session's Prefect server (17 s here) and logs to MLflow
@pytest.mark.timeout(600)  # the server may take its 180 s start-up limit on a loaded machine
@pytest.mark.usefixtures("prefect_harness")
def test_log_summary_puts_the_evaluations_into_mlflow(workdir, monkeypatch):
    from trace_rl.storage.tracking import Tracker

    # This hand-made run registered no policy version; promotion is tests/test_registry.py's.
    monkeypatch.setattr(track, "promote_policy", lambda *a, **k: None)

    record_evals(workdir, [0.0, 0.5, 0.5, 1.0], [0.5, 1.0, 0.5, 1.0])
    tracker = Tracker(workdir)
    mlflow_run = tracker.start_or_resume(RUN, run_name=RUN)
    track.log_summary.fn(workdir, mlflow_run, RUN, {})
    client = tracker.client
    history = {m.step: m.value for m in client.get_metric_history(mlflow_run, "eval/accuracy")}
    assert history == {0: 0.5, 2: pytest.approx(0.75)}
    gain = client.get_metric_history(mlflow_run, "eval/gain")
    assert [(m.step, m.value) for m in gain] == [(2, pytest.approx(0.25))]
    assert "figures/reward.png" in [a.path for a in client.list_artifacts(mlflow_run, "figures")]
    # What the flow returns is plain data (it was a numpy bool in "excludes_zero").
    assert json.loads(json.dumps(track.run_summary(workdir, RUN)))["gain"]["excludes_zero"] is False
