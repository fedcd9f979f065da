"""The train flow for real: Prefect flow runs (embedded server), a DuckDB file, an MLflow store,
the HF engine on the tiny test policy. Slow by nature (each run starts Prefect's temporary server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.runtime import Paths
from trace_rl.storage.store import TreeStore

REPO = Path(__file__).resolve().parents[1]
TINY = {"engine": "hf", "steps": 2, "root_budget": 4, "pool_size": 4, "max_turns": 2,
        "max_new_tokens": 16, "multiplier": 1, "family": "synth_arith", "difficulty": 1,
        "plot_every": 1, "eval_items": 6, "eval_samples": 2}
# Train flows: 4-47 s each here at load 3, the first with the harness; one took 337 s at load 45-70.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness"), pytest.mark.timeout(900)]


def _env() -> dict[str, str]:
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("PREFECT_API_URL", None)
    return env


def _spawn_train(config: dict, workdir: Path, log: Path) -> subprocess.Popen:
    code = ("import json, sys\nfrom flows.train import train\n"
            "if __name__ == '__main__':\n"
            "    train(config=json.loads(sys.argv[1]), workdir=sys.argv[2])\n")
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(config), str(workdir)],
                            cwd=REPO, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _count(store: TreeStore, sql: str, **params) -> int:
    return store.query(sql, params).to_pylist()[0]["n"]


def _check_trees(store: TreeStore, run_id: str, steps: int, leaves_per_step: int) -> None:
    """Every step has levels 0 and 1, the leaf budget is spent exactly, ids are unique, and each
    stored V^ equals the success rate of the leaves below it."""
    rows = store.query("SELECT step, level, count(*) AS n FROM nodes WHERE run_id = $r "
                       "GROUP BY ALL ORDER BY ALL", {"r": run_id}).to_pylist()
    assert {(r["step"], r["level"]) for r in rows} == {(s, lv) for s in range(steps) for lv in (0, 1)}
    for s in range(steps):
        assert _count(store, "SELECT count(*) AS n FROM nodes WHERE run_id = $r AND step = $s AND is_leaf",
                      r=run_id, s=s) == leaves_per_step
    assert _count(store, "SELECT count(*) - count(DISTINCT node_id) AS n FROM nodes") == 0
    assert _count(store, "SELECT count(*) AS n FROM nodes WHERE run_id = $r AND value IS NULL",
                  r=run_id) == 0
    assert _count(store, "SELECT count(*) AS n FROM nodes n JOIN subtree_stats s USING (node_id) "
                         "WHERE abs(n.value - s.leaf_mean) > 1e-9", ) == 0


def test_train_flow_completes_and_leaves_trees_metrics_checkpoints(tiny_model_dir, tmp_path):
    from mlflow import MlflowClient

    from flows.run_lifecycle import registered
    from flows.train import train
    from trace_rl.config import config_from_mapping

    cfg = {**TINY, "policy": str(tiny_model_dir)}
    state = train(config=cfg, workdir=str(tmp_path), return_state=True)
    assert state.is_completed()
    summary = state.result()
    store = TreeStore(tmp_path / "trace.duckdb", create=False)
    leaves = TINY["root_budget"] * (1 + TINY["multiplier"])
    _check_trees(store, summary["run_id"], TINY["steps"], leaves)
    ledger = store.query("SELECT sum(trajectories) AS n FROM ledger WHERE run_id = $r",
                         {"r": summary["run_id"]}).to_pylist()[0]["n"]
    assert ledger == TINY["steps"] * leaves

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["allocator"] == "trace"
    history = client.get_metric_history(run.info.run_id, "tree/effective_ratio")
    assert sorted(m.step for m in history) == list(range(TINY["steps"]))
    for key in ("rollout/reward_mean", "ledger/generated_tokens", "predictor/brier", "time/step_s"):
        assert key in run.data.metrics
    assert "loss/tis_weight_mean" not in run.data.metrics  # TIS is off by default
    arts = [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints/policy")]
    assert arts and len(arts) == sum(registered(config_from_mapping(cfg).run, s)
                                     for s in range(TINY["steps"]))  # every checkpoint_every, the last
    assert "MLmodel" in [Path(a.path).name for a in client.list_artifacts(run.info.run_id, arts[-1])]
    last = [a.path for a in client.list_artifacts(run.info.run_id, arts[-1] + "/model")]
    assert any(p.endswith("model.safetensors") for p in last)  # an MLflow transformers model
    assert not any(p.endswith("optimizer.pt") for p in last)  # resume state stays local
    ckpts = [Paths(tmp_path).policy_dir(summary["run_id"], s) for s in range(TINY["steps"])]
    assert all((c / "model.safetensors").exists() for c in ckpts)
    assert [(c / "optimizer.pt").exists() for c in ckpts] == [False] * (TINY["steps"] - 1) + [True]
    images = [a.path for a in client.list_artifacts(run.info.run_id, "images")]
    assert any("tree+step+1+" in f for f in images)  # one key, a step slider
    assert client.search_model_versions("name = 'trace-policy'")
    _check_summary(summary, tmp_path, client)

    # The predictor refit over the stored trees, with the last step held out.
    from flows.retrain_predictor import retrain_predictor

    refit = retrain_predictor(run_id=summary["run_id"], workdir=str(tmp_path), epochs=2)
    assert refit["held_out_step"] == TINY["steps"] - 1 and Path(refit["path"]).exists()
    _check_refit(refit, tmp_path, summary["run_id"])

    # The same config again resumes the finished run: nothing is rolled out twice.
    again = train(config=cfg, workdir=str(tmp_path))
    assert again["steps_run"] == 0
    _check_trees(store, summary["run_id"], TINY["steps"], leaves)
    assert again["summary"] == summary["summary"]  # the stored evaluations, not new ones


def _check_refit(refit: dict, workdir: Path, run_id: str) -> None:
    """The refit's reported Brier scores are those of the predictor it saved, on the examples
    of the held-out step (and of the constant prediction of their mean)."""
    import numpy as np
    import torch

    from flows.retrain_predictor import _examples
    from tasks import runtime
    from trace_core.predictor import brier
    from trace_rl.config import config_from_mapping

    cfg = config_from_mapping(TreeStore(workdir / "trace.duckdb", create=False).get_run(run_id)["config"])
    predictor = runtime.new_predictor(cfg.predictor, cfg.seed)
    predictor.load_state_dict(torch.load(refit["path"], weights_only=False))
    histories, y, _ = _examples(str(workdir), run_id, refit["held_out_step"])
    assert refit["examples"] == len(y) > 0
    assert refit["brier"] == pytest.approx(brier(predictor.predict(histories), y))
    assert refit["brier_constant"] == pytest.approx(brier(np.full_like(y, y.mean()), y))


def _check_summary(result: dict, workdir: Path, client) -> None:
    """The run's summary equals what `trace sql` and the MLflow store hold."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from trace_core.stats import paired_gain

    s, run_id = result["summary"], result["run_id"]
    sql = subprocess.run([sys.executable, "-m", "cli", "sql", "--workdir",
                          str(workdir), "--format", "json",
                          f"SELECT step, accuracy, ci_low, ci_high, items, samples, per_item "
                          f"FROM evals WHERE run_id = '{run_id}' ORDER BY step"],
                         env=_env(), capture_output=True, text=True, check=True)
    before, after = json.loads(sql.stdout)
    assert (before["step"], after["step"]) == (0, TINY["steps"])
    for mine, stored in ((s["before"], before), (s["after"], after)):
        for k in ("step", "accuracy", "ci_low", "ci_high", "items", "samples"):
            assert mine[k] == stored[k], k
    assert before["items"] == TINY["eval_items"] and before["samples"] == TINY["eval_samples"]
    gain = paired_gain(before["per_item"], after["per_item"])
    assert (s["gain"]["mean"], s["gain"]["low"], s["gain"]["high"]) == (gain.mean, gain.low,
                                                                        gain.high)
    store = TreeStore(workdir / "trace.duckdb", create=False)
    q = {"r": run_id}
    assert s["leaves"] == _count(store, "SELECT count(*) AS n FROM nodes WHERE run_id = $r "
                                        "AND is_leaf", **q)
    assert s["generated_tokens"] == _count(store, "SELECT sum(generated_tokens) AS n FROM ledger "
                                                  "WHERE run_id = $r", **q)

    run = result["mlflow_run_id"]
    metric = lambda key: {m.step: m.value for m in client.get_metric_history(run, key)}  # noqa: E731
    assert metric("eval/accuracy") == {0: before["accuracy"], TINY["steps"]: after["accuracy"]}
    assert metric("eval/ci_low") == {0: before["ci_low"], TINY["steps"]: after["ci_low"]}
    assert metric("eval/gain") == {TINY["steps"]: gain.mean}
    assert metric("rollout/reward_mean") == {st["step"]: st["reward"] for st in s["steps"]}
    assert metric("tree/effective_ratio") == {st["step"]: st["effective_ratio"]
                                              for st in s["steps"]}
    assert "figures/reward.png" in [a.path for a in client.list_artifacts(run, "figures")]

    with get_client(sync_client=True) as prefect:
        [artifact] = prefect.read_artifacts(artifact_filter=ArtifactFilter(
            key=ArtifactFilterKey(any_=[f"summary-{run_id.lower()}"])))
    assert f"| {after['accuracy']:.3f} |" in artifact.data and "generated tokens" in artifact.data


def test_keep_checkpoints_keeps_the_newest_and_the_registered(tiny_model_dir, tmp_path):
    """keep_checkpoints=1 with checkpoint_every=2 over 4 steps: steps 1 and 3 are registered in
    MLflow and stay, steps 0 and 2 go once a later step is complete; the run id is the one the
    default retention gives (it resumes with either), and a resume after the run still finds
    its newest checkpoint."""
    from flows.train import train
    from trace_rl.config import config_from_mapping

    cfg = {**TINY, "policy": str(tiny_model_dir), "steps": 4, "eval_items": 0, "plot_every": 0,
           "checkpoint_every": 2, "keep_checkpoints": 1}
    same = {k: v for k, v in cfg.items() if k != "keep_checkpoints"}
    assert config_from_mapping(cfg).resolved_run_id == config_from_mapping(same).resolved_run_id
    summary = train(config=cfg, workdir=str(tmp_path))
    kept = [Paths(tmp_path).policy_dir(summary["run_id"], s).is_dir() for s in range(4)]
    assert kept == [False, True, False, True]
    assert (Paths(tmp_path).policy_dir(summary["run_id"], 3) / "optimizer.pt").exists()
    again = train(config=same, workdir=str(tmp_path))
    assert again["steps_run"] == 0
    from mlflow import MlflowClient  # not a param (immutable): a tag, with the latest value

    run = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(again["mlflow_run_id"])
    assert run.data.tags["trace.keep_checkpoints"] == "0" and "keep_checkpoints" not in run.data.params


def test_sigkill_mid_step_then_resume(tiny_model_dir, tmp_path):
    """Kill -9 the flow while step 1 is being written; the re-run resumes: finished phases are
    cache hits, no node is duplicated or lost, the same MLflow run continues."""
    from mlflow import MlflowClient

    cfg = {**TINY, "policy": str(tiny_model_dir), "steps": 3}
    proc = _spawn_train(cfg, tmp_path, tmp_path / "first.log")
    deadline = time.time() + 400
    before: set[str] = set()
    try:
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            if (tmp_path / "trace.duckdb").exists():
                store = TreeStore(tmp_path / "trace.duckdb", create=False, read_timeout_s=60)
                ids = store.query("SELECT node_id FROM nodes WHERE step = 1 AND level = 0")
                if ids.num_rows:
                    before = set(store.query("SELECT node_id FROM nodes").column("node_id").to_pylist())
                    break
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert before, "step 1 never started"
    run_id = store.query("SELECT run_id FROM runs").to_pylist()[0]["run_id"]
    assert store.last_complete_step(run_id) == 0

    second = _spawn_train(cfg, tmp_path, tmp_path / "second.log")
    assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    log = (tmp_path / "second.log").read_text()
    # Step 1's finished phases (its root pool and level 0 at least) come back from the cache.
    assert "allocate-roots" in log and "Cached" in log
    after = set(store.query("SELECT node_id FROM nodes").column("node_id").to_pylist())
    assert before <= after  # nothing lost
    _check_trees(store, run_id, 3, TINY["root_budget"] * (1 + TINY["multiplier"]))
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "rollout/leaves"))
    assert steps == [0, 1, 2]


def test_trace_sql_answers_while_training_writes(tiny_model_dir, tmp_path):
    cfg = {**TINY, "policy": str(tiny_model_dir), "steps": 3}
    proc = _spawn_train(cfg, tmp_path, tmp_path / "train.log")
    trace = [sys.executable, "-m", "cli", "sql", "--workdir", str(tmp_path), "--format",
             "json", "SELECT count(*) AS n FROM nodes"]
    answers = []
    deadline = time.time() + 600
    try:
        while proc.poll() is None and time.time() < deadline:
            if (tmp_path / "trace.duckdb").exists():
                out = subprocess.run(trace, cwd=REPO, env=_env(), capture_output=True, text=True,
                                     timeout=120)
                assert out.returncode == 0, out.stdout + out.stderr
                if proc.poll() is None:
                    answers.append(json.loads(out.stdout)[0]["n"])
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, (tmp_path / "train.log").read_text()[-3000:]
    # Several answers while the run was alive, seeing the tree grow between them.
    assert len(answers) >= 3
    assert answers[-1] > answers[0]


SCRIPTED = {**TINY, "max_new_tokens": 48, "eval_items": 0, "plot_every": 0}
"""The tiny config for scripted rollouts (tests/scripted_engine.py): room for a scripted turn
(at most 31 tokens), no held-out evaluation."""


def test_engine_mismatch_and_truncated_importance_sampling_through_the_flow(tiny_model_dir, tmp_path):
    """Every step measures the engine/trainer mismatch of the tokens it trains on, logs it to
    MLflow and to the step's row in DuckDB, and with ``tis_cap`` weights each token by
    min(pi_train / pi_engine, cap). Scripted so that the engines disagree on every token: the
    scripted engine (tests/scripted_engine.py, a stand-in) reports log-prob -0.5 for each token it
    writes, which the tiny policy gives far less; every group is mixed (right in even copies,
    wrong in odd ones), so every path is trained on. Then most weights are below 1 (a few tokens
    the tiny policy is sure of, such as a closing tag, it gives more than exp(-0.5))."""
    from mlflow import MlflowClient

    from flows.train import train
    from scripted_engine import arith_answer, question_of, say, scripted_rollouts

    def respond(context: str, j: int, seed: int | None) -> str:
        gold = arith_answer(question_of(context))
        return say("answer", gold if j % 2 == 0 else gold + 1, "at once")

    cfg = {**SCRIPTED, "policy": str(tiny_model_dir), "steps": 1, "tis_cap": 2.0}
    with scripted_rollouts(respond):
        summary = train(config=cfg, workdir=str(tmp_path))
    m = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(
        summary["mlflow_run_id"]).data.metrics
    assert m["loss/paths_with_signal"] == m["loss/paths"] > 0
    assert m["loss/mismatch_abs_mean"] > 0.5 and m["loss/mismatch_kl"] > 0
    # measured 2026-12-07 (Intel Xeon): 5.0, 0.83 of tokens below 1, mean weight 0.26
    assert 0.5 < m["loss/tis_below_one"] <= 1.0 and 0 < m["loss/tis_weight_mean"] < 1
    row = TreeStore(tmp_path / "trace.duckdb", create=False).query(
        "SELECT metrics_json FROM steps WHERE run_id = $r", {"r": summary["run_id"]})
    stored = json.loads(row.column("metrics_json")[0].as_py())
    assert stored["loss/mismatch_kl"] == pytest.approx(m["loss/mismatch_kl"])
    assert stored["loss/tis_below_one"] == pytest.approx(m["loss/tis_below_one"])


def test_dapo_refills_through_the_flow(tiny_model_dir, tmp_path):
    """DAPO's first wave fills half its groups; groups that are not mixed are refilled with fresh
    prompts in later waves, never past the leaf budget. Scripted so that no group can be mixed
    (each prompt is always answered right, or always wrong): the first wave's 2 groups of 2 are
    uniform, so a refill wave must follow, and its 2 groups spend the rest of the 8 leaves."""
    from flows.train import train
    from scripted_engine import ArithAgent, scripted_rollouts, uniform

    cfg = {**SCRIPTED, "policy": str(tiny_model_dir), "allocator": "dapo", "steps": 1,
           "group_size": 2, "pool_size": 8}
    with scripted_rollouts(ArithAgent(lambda question: float(uniform("dapo", question) < 0.5))):
        summary = train(config=cfg, workdir=str(tmp_path))
    m = summary["last_metrics"]
    store = TreeStore(tmp_path / "trace.duckdb", create=False)
    leaves = TINY["root_budget"] * (1 + TINY["multiplier"])
    assert m["tree/effective_ratio"] == 0.0 and m["alloc/refill_waves"] == 1
    assert m["rollout/leaves"] == leaves
    waves = store.query("SELECT method, trajectories FROM ledger ORDER BY method").to_pylist()
    assert waves == [{"method": "dapo", "trajectories": 4},
                     {"method": "dapo:refill1", "trajectories": 4}]
    assert m["ledger/trajectories"] == leaves
    roots = store.query("SELECT tree_id, item_id FROM nodes WHERE depth = 0 ORDER BY tree_id").to_pylist()
    first = [r for r in roots if r["tree_id"] < cfg["pool_size"]]
    refill = [r for r in roots if r["tree_id"] >= cfg["pool_size"]]  # numbered after the first wave's
    assert len(first) == len(refill) == 2
    assert not {r["item_id"] for r in first} & {r["item_id"] for r in refill}  # fresh prompts


def test_joint_split_through_the_flow(tiny_model_dir, tmp_path):
    """TRACE with the joint split: after the bare rollouts the rest of the leaf budget goes to
    continuations or to a level-0 wave of prompts not yet rolled out; the budget is spent exactly
    and the wave's trees are numbered after the first wave's. Scripted so that the fresh prompts
    must win: every episode answers at once, right in the even copies of a request and wrong in
    the odd ones, so every group is mixed; a mixed root is no candidate for continuations and a
    one-turn episode leaves no deeper prefix, so all M N leaves after the bare rollouts go to
    fresh prompts, in both steps."""
    from flows.train import train
    from scripted_engine import arith_answer, question_of, say, scripted_rollouts

    def respond(context: str, j: int, seed: int | None) -> str:
        gold = arith_answer(question_of(context))
        return say("answer", gold if j % 2 == 0 else gold + 1, "at once")

    cfg = {**SCRIPTED, "policy": str(tiny_model_dir), "steps": 2, "pool_size": 8,
           "joint_split": True, "correlation_window": 1, "correlation_min_terms": 1}
    with scripted_rollouts(respond):
        summary = train(config=cfg, workdir=str(tmp_path))
    store = TreeStore(tmp_path / "trace.duckdb", create=False)
    bare, fresh = TINY["root_budget"], TINY["root_budget"] * TINY["multiplier"]
    run = summary["run_id"]
    for step in range(2):
        ledger = store.query("SELECT method, trajectories FROM ledger WHERE run_id = $r AND "
                             "step = $s ORDER BY method", {"r": run, "s": step}).to_pylist()
        assert ledger == [{"method": "trace", "trajectories": bare},
                          {"method": "trace:refill1", "trajectories": fresh}]
        wave = _count(store, "SELECT count(*) AS n FROM nodes WHERE run_id = $r AND step = $s AND "
                             "is_leaf AND level = 0 AND tree_id >= $p", r=run, s=step, p=cfg["pool_size"])
        assert wave == fresh
        assert _count(store, "SELECT count(*) AS n FROM nodes WHERE run_id = $r AND step = $s AND "
                             "level = 1", r=run, s=step) == 0  # no continuation
        mixed = store.query("SELECT tree_id, avg(reward) AS mean FROM nodes WHERE run_id = $r AND "
                            "step = $s AND is_leaf GROUP BY tree_id", {"r": run, "s": step}).to_pylist()
        assert all(0 < t["mean"] < 1 for t in mixed)
    m = summary["last_metrics"]
    assert m["alloc/fresh_leaves"] == fresh and m["rollout/leaves"] == bare + fresh
    assert m["tree/effective_ratio"] == 1.0


def test_staleness_counts_from_first_offer_not_from_the_start():
    from tasks.roots import candidate_pool, staleness
    from trace_rl.config import config_from_mapping

    cfg = config_from_mapping({"family": "synth_arith", "pool_size": 8, "extra": {"n_train": 40}})
    pools = [candidate_pool(cfg, s) for s in range(6)]
    assert pools[3] == candidate_pool(cfg, 3) and len(set(pools[0])) == 8
    fresh = next(i for i in pools[5] if not any(i in p for p in pools[:5]))  # first offered at 5
    offered = next(i for i in pools[5] if i in pools[1] and not any(i in p for p in pools[:1]))
    rolled = pools[5][0] if pools[5][0] not in (fresh, offered) else pools[5][1]
    got = staleness(cfg, 5, [fresh, offered, rolled], {rolled: 3})
    assert got == [0.0, 4.0, 2.0]  # new: trusted; offered at 1, never chosen: 4; rolled at 3: 2


def _nodes(workdir: Path) -> list[tuple]:
    """A run's trees without its run id: what two runs of one config must agree on."""
    store = TreeStore(workdir, create=False)
    rows = store.query("SELECT node_id, parent_id, text, reward, value, is_leaf FROM nodes "
                       "ORDER BY step, tree_id, local_index").to_pylist()
    return [(r["node_id"].split("/", 1)[1], r["text"], r["reward"], r["value"], r["is_leaf"])
            for r in rows]


def test_a_reader_holding_the_database_does_not_stall_training(tiny_model_dir, tmp_path):
    """A separate process holds `duckdb.connect(trace.duckdb, read_only=True)` (what
    `duckdb -readonly` does) from before the run starts until after it ends. The run finishes
    without waiting on it and leaves the same trees as a run with no reader."""
    from flows.train import train

    cfg = {**TINY, "policy": str(tiny_model_dir), "plot_every": 0}
    held = tmp_path / "held"
    TreeStore(held)  # the schema, published, so there is a file to hold before the run starts
    hold = ("import duckdb, sys\n"
            f"con = duckdb.connect({str(held / 'trace.duckdb')!r}, read_only=True)\n"
            "print(con.execute('SELECT count(*) FROM nodes').fetchone()[0], flush=True)\n"
            "sys.stdin.readline()\n"
            "print(con.execute('SELECT count(*) FROM nodes').fetchone()[0], flush=True)\n")
    reader = subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "0"
        t0 = time.perf_counter()
        summary = train(config=cfg, workdir=str(held))
        with_reader_s = time.perf_counter() - t0
        assert reader.poll() is None  # still holding its connection
        reader.stdin.write("\n")
        reader.stdin.flush()
        assert reader.stdout.readline().strip() == "0"  # its snapshot, never torn or changed
    finally:
        reader.kill()
        reader.wait()
    assert summary["steps_run"] == TINY["steps"]
    t0 = time.perf_counter()
    train(config=cfg, workdir=str(tmp_path / "free"))
    print(f"\ntrain with a reader holding the file {with_reader_s:.1f}s, "
          f"without {time.perf_counter() - t0:.1f}s")
    assert _nodes(held) == _nodes(tmp_path / "free")
    assert len(_nodes(held)) > 0


def test_two_trains_on_one_fresh_work_dir_one_runs_one_refuses(tiny_model_dir, tmp_path):
    """Two `trace train` started together on a fresh work dir: one runs, the other
    exits at once (status 3) naming the running one's pid and run id; no MLflow set-up race."""
    from prefect.settings import PREFECT_API_URL

    env = dict(_env(), PREFECT_API_URL=PREFECT_API_URL.value())  # the harness's server: no start-up
    overrides = [f"{k}={v}" for k, v in {**TINY, "policy": str(tiny_model_dir), "steps": 1,
                                         "plot_every": 0}.items()]
    wd = tmp_path / "wd"
    cmd = [sys.executable, "-m", "cli", "train", "--workdir", str(wd), *overrides]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    started = time.perf_counter()
    ended: dict[int, float] = {}
    while len(ended) < 2 and time.perf_counter() - started < 400:
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = time.perf_counter() - started
        time.sleep(0.1)
    outs = [p.communicate(timeout=60)[0] for p in procs]
    codes = sorted((p.returncode, i) for i, p in enumerate(procs))
    assert [c for c, _ in codes] == [0, 3], outs
    winner, loser = codes[0][1], codes[1][1]
    assert ended[loser] < min(ended[winner], 30)  # refused before torch or Prefect load
    run_id = json.loads((wd / ".trace-train.lock").read_text() or "{}").get("run_id")
    assert run_id is None  # released when the run ended
    msg = " ".join(outs[loser].split())
    assert f"pid {procs[winner].pid}" in msg and "run trace-" in msg and "--wait" in msg, msg
    store = TreeStore(wd, create=False)
    assert store.query("SELECT count(*) AS n FROM runs").to_pylist()[0]["n"] == 1
    print(f"\nloser exited after {ended[loser]:.1f}s, winner finished after {ended[winner]:.1f}s")
