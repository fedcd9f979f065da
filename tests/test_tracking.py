"""MLflow tracking against a real local store, and the figures logged to it."""

from __future__ import annotations

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from pathlib import Path  # noqa: E402

from trace_rl.storage.plots import calibration_plot, contrast_curve, render_tree, tree_layout  # noqa: E402
from trace_rl.storage.tracking import Tracker, TrackingError, flatten  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"
CONFIG = {"run": {"steps": 3, "lr": 1e-5}, "allocator": "trace", "budget": {"roots": 8, "n": 2},
          "note": None}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    # One sqlite store for the module: creating its tables costs a few seconds per store.
    return tmp_path_factory.mktemp("work")


def test_metrics_and_params_land(workdir):
    tr = Tracker(workdir)
    run_id = tr.start_or_resume("run-a")
    assert tr.log_config(CONFIG) == 6
    tr.log_metrics(0, {"rollout/reward_mean": 0.25, "alloc/active_prompts": 4, "loss/policy": 1.5})
    tr.log_metrics(1, {"rollout/reward_mean": 0.5, "tree/mixed_anchors": np.int64(3)})
    run = tr.client.get_run(run_id)
    assert run.data.params == {"run.steps": "3", "run.lr": "1e-05", "allocator": "trace",
                               "budget.roots": "8", "budget.n": "2", "note": "None"}
    hist = tr.client.get_metric_history(run_id, "rollout/reward_mean")
    assert sorted((m.step, m.value) for m in hist) == [(0, 0.25), (1, 0.5)]
    assert run.data.metrics["tree/mixed_anchors"] == 3.0
    assert (workdir / "mlflow.db").exists()
    assert "sqlite:///" in tr.ui_command


def test_mutable_fields_are_tags_and_a_refused_resume_changes_none(workdir):
    tr = Tracker(workdir)
    run_id = tr.start_or_resume("run-mutable")
    assert tr.log_config({**CONFIG, "keep": 3}, mutable=["keep"]) == 6  # keep is not a param
    data = tr.client.get_run(run_id).data
    assert "keep" not in data.params and data.tags["trace.keep"] == "3"
    assert tr.log_config({**CONFIG, "keep": 5}, mutable=["keep"]) == 0  # resumed with another value
    assert tr.client.get_run(run_id).data.tags["trace.keep"] == "5"
    with pytest.raises(TrackingError, match="run.lr"):
        tr.log_config({**CONFIG, "run": {"steps": 3, "lr": 3e-4}, "keep": 9}, mutable=["keep"])
    assert tr.client.get_run(run_id).data.tags["trace.keep"] == "5"
    tr.end()


def test_resume_continues_the_same_run(workdir):
    first = Tracker(workdir)
    run_id = first.start_or_resume("run-b", run_name="trial")
    first.log_config(CONFIG)
    first.log_metrics(0, {"rollout/reward_mean": 0.1})
    first.end("FAILED")  # the process died
    again = Tracker(workdir)  # a fresh process after the crash
    assert again.start_or_resume("run-b") == run_id
    assert again.client.get_run(run_id).info.status == "RUNNING"
    assert again.log_config(CONFIG) == 0  # same config: nothing new, no error
    again.log_metrics(1, {"rollout/reward_mean": 0.2})
    steps = [m.step for m in again.client.get_metric_history(run_id, "rollout/reward_mean")]
    assert sorted(steps) == [0, 1]
    with pytest.raises(TrackingError, match="run.lr"):
        again.log_config({**CONFIG, "run": {"steps": 3, "lr": 3e-4}})
    assert Tracker(workdir).start_or_resume("run-b", mlflow_run_id=run_id) == run_id
    with pytest.raises(TrackingError, match="belongs to"):
        Tracker(workdir).start_or_resume("run-c", mlflow_run_id=run_id)
    assert Tracker(workdir).start_or_resume("run-c") != run_id
    again.end()
    assert again.client.get_run(run_id).info.status == "FINISHED"


def test_checkpoint_is_logged_and_registered(workdir, tmp_path, tiny_model_dir):
    import shutil

    ckpt = tmp_path / "policy"
    shutil.copytree(tiny_model_dir, ckpt)
    (ckpt / "optimizer.pt").write_bytes(b"\0" * 128)
    tr = Tracker(workdir)
    run_id = tr.start_or_resume("run-d")
    version = tr.log_checkpoint("policy", ckpt, step=2, exclude=("optimizer.pt",))
    assert tr.log_checkpoint("policy", ckpt, step=2) == version  # a retried task
    mv = tr.client.get_model_version("trace-policy", version)
    assert mv.run_id == run_id and mv.tags["step"] == "2" and mv.tags["trace.run_id"] == "run-d"
    assert mv.source == f"runs:/{run_id}/checkpoints/policy/step_000002"
    assert tr.client.get_model_version_by_alias("trace-policy", "candidate").version == version
    # an MLflow transformers model: MLmodel at the top, the Hugging Face files under model/,
    # without the optimiser state (it stays in the local checkpoint, for resuming)
    top = {Path(f.path).name for f in tr.client.list_artifacts(run_id, "checkpoints/policy/step_000002")}
    assert {"MLmodel", "model"} <= top
    files = {Path(f.path).name for f in tr.client.list_artifacts(
        run_id, "checkpoints/policy/step_000002/model")}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert "optimizer.pt" not in files
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(TrackingError, match="broken could not be saved as an MLflow"):
        tr.log_checkpoint("policy", broken, step=5)
    pred = tmp_path / "predictor.pt"
    pred.write_bytes(b"weights")
    v2 = tr.log_checkpoint("predictor", pred, step=2)
    assert tr.client.get_model_version("trace-predictor", v2).run_id == run_id
    with pytest.raises(TrackingError, match="kind"):
        tr.log_checkpoint("optimizer", ckpt, step=2)
    with pytest.raises(TrackingError, match="does not exist"):
        tr.log_checkpoint("policy", tmp_path / "missing", step=3)


def test_bad_metric_names_and_values_are_rejected(workdir):
    tr = Tracker(workdir)
    run_id = tr.start_or_resume("run-e")
    for bad in ({"reward": 1.0}, {"policy/loss": 1.0}, {"rollout/": 1.0}):
        with pytest.raises(TrackingError, match="namespaces"):
            tr.log_metrics(0, {"rollout/ok": 1.0, **bad})
    with pytest.raises(TrackingError, match="not a number"):
        tr.log_metrics(0, {"rollout/ok": "high"})
    with pytest.raises(TrackingError, match="step"):
        tr.log_metrics(-1, {"rollout/ok": 1.0})
    assert tr.client.get_run(run_id).data.metrics == {}  # a rejected batch logs nothing
    with pytest.raises(TrackingError, match="start_or_resume"):
        Tracker(workdir).log_metrics(0, {"rollout/ok": 1.0})


def test_figures_are_logged_as_pngs(workdir):
    tr = Tracker(workdir)
    run_id = tr.start_or_resume("run-f")
    parent = [-1, 0, 1, 0, 3, 1, 3, 3, 7]
    value = [0.4, 0.5, np.nan, 1 / 3, np.nan, np.nan, np.nan, 1.0, np.nan]
    reward = [np.nan, np.nan, 1, np.nan, 0, 0, 0, np.nan, 1]
    figs = {"figures/tree.png": render_tree(parent, value, reward, labels=[str(i) for i in range(9)]),
            "figures/calibration.png": calibration_plot(np.linspace(0, 1, 50),
                                                        (np.arange(50) % 3 == 0).astype(float)),
            "figures/contrast.png": contrast_curve([0, 1, 2], {"trace": [0.3, 0.5, 0.6],
                                                               "grpo": [0.3, 0.3, 0.35]})}
    for path, fig in figs.items():
        tr.log_figure(fig, path)
    local = tr.client.download_artifacts(run_id, "figures")
    for path in figs:
        data = open(os.path.join(local, os.path.basename(path)), "rb").read()
        assert data.startswith(PNG) and len(data) > 5000


def test_tree_layout_centres_parents_over_their_leaves():
    x, y = tree_layout([-1, 0, 1, 0, 3, 1])
    # Leaves in depth-first order: 2, 5 under node 1, then 4 under node 3.
    assert list(x[[2, 5, 4]]) == [0.0, 1.0, 2.0]
    assert x[1] == 0.5 and x[3] == 2.0 and x[0] == 1.25
    assert list(y) == [0, -1, -2, -1, -2, -2]
    with pytest.raises(ValueError, match="parent"):
        tree_layout([-1, 2, 0])


def test_plot_inputs_are_checked():
    with pytest.raises(ValueError, match="value"):
        render_tree([-1, 0], [0.5], [np.nan, 1.0])
    with pytest.raises(ValueError, match="p must lie"):
        calibration_plot([1.5], [1.0])
    with pytest.raises(ValueError, match="series"):
        contrast_curve([0, 1], {"trace": [0.1]})


def test_flatten_dots_nested_keys():
    assert flatten({"a": {"b": {"c": 1}}, "d": 2}) == {"a.b.c": 1, "d": 2}


def test_a_step_logged_again_after_a_crash_is_not_duplicated(workdir):
    """Killed after logging step 1 but before the store marked it complete, a resumed run
    redoes step 1: its metrics keep one point per step, and keys new to the step are added."""
    tr = Tracker(workdir)
    run_id = tr.start_or_resume("run-d")
    tr.log_metrics(1, {"rollout/leaves": 32.0})
    again = Tracker(workdir)
    again.start_or_resume("run-d")
    again.log_metrics(1, {"rollout/leaves": 32.0, "loss/lr": 1e-4})
    again.log_metrics(2, {"rollout/leaves": 32.0})
    hist = again.client.get_metric_history
    assert sorted(m.step for m in hist(run_id, "rollout/leaves")) == [1, 2]
    assert [m.step for m in hist(run_id, "loss/lr")] == [1]


def _schema(db):
    import sqlite3

    # Names and columns, not the CREATE statements' text: MLflow's own migrations write a table's
    # CHECK constraints in an order that varies from one process to the next.
    con = sqlite3.connect(db)
    try:
        names = con.execute("SELECT type, name FROM sqlite_master ORDER BY type, name").fetchall()
        tables = [(kind, name, con.execute(f"PRAGMA table_info('{name}')").fetchall())
                  for kind, name in names]
        version = con.execute("SELECT version_num FROM alembic_version").fetchall()
        default = con.execute("SELECT name, artifact_location FROM experiments").fetchall()
    finally:
        con.close()
    return tables, version, default


def test_a_new_store_is_a_copy_of_one_empty_store_with_mlflows_own_schema(tmp_path, monkeypatch):
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    from trace_rl.storage.tracking import empty_store

    monkeypatch.setenv("TRACE_CACHE_DIR", str(tmp_path / "cache"))
    first = Tracker(tmp_path / "a")
    template = empty_store()
    assert template.parent == tmp_path / "cache" / "mlflow"
    made = template.stat().st_mtime_ns
    second = Tracker(tmp_path / "b")
    assert template.stat().st_mtime_ns == made  # made once, copied for every later work dir
    # MLflow's own creation of a store, for comparison
    SqlAlchemyStore(f"sqlite:///{tmp_path / 'own.db'}", str(tmp_path / "own")).engine.dispose()
    own_tables, own_version, _ = _schema(tmp_path / "own.db")
    for tracker, where in ((first, "a"), (second, "b")):
        tables, version, experiments = _schema(tmp_path / where / "mlflow.db")
        assert (tables, version) == (own_tables, own_version)
        assert ("Default", str(tmp_path / where / "mlruns" / "0")) in experiments
        run_id = tracker.start_or_resume(f"run-{where}")
        tracker.log_metrics(0, {"loss/policy": 1.0})
        assert tracker.client.get_run(run_id).data.metrics == {"loss/policy": 1.0}
    assert not list((tmp_path / "a").glob(".mlflow.db.*"))  # no partial copy left behind


def test_without_an_empty_store_mlflow_creates_the_store_as_before(tmp_path, monkeypatch):
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("TRACE_CACHE_DIR", str(blocked))
    with pytest.warns(UserWarning, match="no empty store to copy"):
        tracker = Tracker(tmp_path / "w")
    run_id = tracker.start_or_resume("run-w")
    tracker.log_metrics(0, {"loss/policy": 2.0})
    assert tracker.client.get_run(run_id).data.metrics == {"loss/policy": 2.0}
