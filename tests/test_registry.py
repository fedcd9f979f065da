"""MLflow used as its users use it, on a real local store: runs named
from the config, datasets as inputs with digests, the policy as a transformers model that
``mlflow.pyfunc.load_model("models:/<name>@champion")`` loads and generates with, registry
aliases and descriptions, the champion moved only by a better held-out score, retraining
resolving its start point from it, step figures under one key, the classic experiment view, and
a no-op resume that keeps a finished run's end time."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trace_rl.config import TrainConfig
from trace_rl.storage import plots
from trace_rl.storage.tracking import CANDIDATE, CHAMPION, CLASSIC_ML, EXPERIMENT_KIND, Tracker


def _train_run(workdir: Path, run_id: str, policy: Path, score: float, name: str) -> dict:
    """What the train flow records for a run: a registered policy and a held-out score."""
    tr = Tracker(workdir)
    tr.start_or_resume(run_id, run_name=name)
    tr.log_metrics(0, {"rollout/reward_mean": score})
    version = tr.log_checkpoint("policy", policy, 0, description=f"policy of {run_id}")
    promotion = tr.promote("policy", score, "synth_arith/test (4 items x 2 samples)",
                           description=f"{run_id}: held-out accuracy {score}")
    tr.end("FINISHED")
    return {"version": version, **promotion}


@pytest.mark.slow  # MLflow logs and loads two policy models (17 s here)
def test_registry_champion_candidate_and_pyfunc_generation(tiny_model_dir, tmp_path, monkeypatch):
    import mlflow.pyfunc

    from deployments.retrain import champion_checkpoint

    best = _train_run(tmp_path, "lineage-aaa", tiny_model_dir, 0.5, "synth_arith-trace-tiny-aaa")
    assert best["champion"] and best["reason"] == "the first version scored: there was no champion"
    # A 1-step smoke run and a GRPO baseline finish later, with lower held-out scores: the
    # newest registered policy is the candidate, the champion stays where it was.
    smoke = _train_run(tmp_path, "lineage-bbb", tiny_model_dir, 0.25, "synth_arith-trace-tiny-bbb")
    grpo = _train_run(tmp_path, "lineage-ccc", tiny_model_dir, 0.4, "synth_arith-grpo-tiny-ccc")
    assert not smoke["champion"] and not grpo["champion"]
    assert "does not beat champion v1's 0.5000" in grpo["reason"]

    tr = Tracker(tmp_path)
    client, name = tr.client, tr.model_name("policy")
    assert client.get_model_version_by_alias(name, CHAMPION).version == best["version"]
    assert client.get_model_version_by_alias(name, CANDIDATE).version == grpo["version"]
    assert "TRACE policies" in client.get_registered_model(name).description
    champ = client.get_model_version(name, best["version"])
    assert champ.description.startswith("lineage-aaa: held-out accuracy 0.5")
    # The description says what the promotion did, not the state before it.
    assert champ.description.endswith("Promotion: made the champion (the first version scored: "
                                      "there was no champion)."), champ.description
    assert "Promotion: not made the champion (held-out score 0.2500" in client.get_model_version(
        name, smoke["version"]).description
    assert champ.tags["eval.score"] == "0.500000"

    # Retraining starts from the champion, read from the registry (not the newest run on disk).
    found = champion_checkpoint(tmp_path)
    assert found is not None and found[1] == best["version"]
    assert Path(found[0]).is_relative_to(tmp_path / "registry")
    assert (Path(found[0]) / "config.json").exists()

    # as a user would: point MLflow at the work dir's store, then load by alias
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tr.tracking_uri)
    model = mlflow.pyfunc.load_model(f"models:/{name}@{CHAMPION}")
    assert model.metadata.get_input_schema().input_types()[0].name == "string"
    out = model.predict(["<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"],
                        params={"max_new_tokens": 8})
    assert len(out) == 1 and isinstance(out[0], str) and len(out[0]) > 0

    # A better score on the same split moves the champion; a score on another split cannot.
    better = _train_run(tmp_path, "lineage-ddd", tiny_model_dir, 0.75, "synth_arith-trace-tiny-ddd")
    assert better["champion"] and better["previous"] == best["version"]
    tr2 = Tracker(tmp_path)
    tr2.start_or_resume("lineage-eee")
    tr2.log_checkpoint("policy", tiny_model_dir, 0)
    other = tr2.promote("policy", 1.0, "synth_arith/test (64 items x 4 samples)")
    assert not other["champion"] and "no score" in other["reason"]
    assert client.get_model_version_by_alias(name, CHAMPION).version == better["version"]


@pytest.mark.slow  # MLflow datasets, figures and three resumes (8 s here)
def test_experiment_view_datasets_step_figures_and_resume_time(tmp_path):
    from trace_rl.envs.registry import make_env

    tr = Tracker(tmp_path)
    assert tr.client.get_experiment(tr.experiment_id).tags[EXPERIMENT_KIND] == CLASSIC_ML
    cfg = TrainConfig(family="synth_arith")
    from tasks.track import mlflow_run_name, run_tags

    name = mlflow_run_name(cfg)
    assert name.startswith("synth_arith-trace-tiny-") and cfg.config_hash[:6] in name
    run_id = tr.start_or_resume(cfg.resolved_run_id, run_name=name, tags=run_tags(cfg))
    run = tr.client.get_run(run_id)
    assert run.info.run_name == name and run.data.tags["trace.run_name"] == cfg.run_name

    items = make_env("synth_arith", difficulty=1).load("train")
    rows = [{"id": it.id, "question": it.question, "gold": str(it.gold)} for it in items]
    src = {"family": "synth_arith", "split": "train"}
    digest = tr.log_dataset(rows, "synth_arith/train", "train", source=src)
    assert tr.log_dataset(rows, "synth_arith/train", "train", source=src) == digest
    tr.log_dataset(rows[:3], "synth_arith/test", "eval", source={**src, "split": "test"})
    inputs = tr.client.get_run(run_id).inputs.dataset_inputs
    got = {(i.dataset.name, i.dataset.digest, {t.key: t.value for t in i.tags}["mlflow.data.context"])
           for i in inputs}
    assert len(inputs) == 2 and ("synth_arith/train", digest, "train") in got
    assert {c for _, _, c in got} == {"train", "eval"}

    for step in (0, 1):
        tr.log_step_figure(plots.calibration_plot([0.1, 0.9, 0.5], [0.0, 1.0, 1.0]), "calibration",
                           step)
    images = [a.path for a in tr.client.list_artifacts(run_id, "images")]
    assert sum("calibration+step+0+" in p for p in images) >= 1
    assert sum("calibration+step+1+" in p for p in images) >= 1

    # A finished run resumed with nothing new keeps its end time; one that logs more does not.
    tr.log_metrics(0, {"rollout/reward_mean": 0.5})
    tr.end("FINISHED")
    ended = tr.client.get_run(run_id).info.end_time
    time.sleep(0.05)
    again = Tracker(tmp_path)
    again.start_or_resume(cfg.resolved_run_id)
    again.log_metrics(0, {"rollout/reward_mean": 0.5})  # already there: nothing new
    again.end("FINISHED")
    assert again.client.get_run(run_id).info.end_time == ended
    more = Tracker(tmp_path)
    more.start_or_resume(cfg.resolved_run_id)
    more.log_metrics(1, {"rollout/reward_mean": 0.6})
    more.end("FINISHED")
    assert more.client.get_run(run_id).info.end_time > ended


@pytest.mark.slow  # an MLflow pyfunc model logged and loaded back (6 s here)
def test_the_predictor_is_a_pyfunc_model(tmp_path, monkeypatch):
    import mlflow.pyfunc
    import numpy as np
    import torch

    from trace_core.predictor import HashedNgramPredictor

    predictor = HashedNgramPredictor()
    histories = ["What is 2 + 2?", "What is 17 * 23?", "Name the capital of France."]
    predictor.fit(histories, np.asarray([1.0, 0.0, 1.0]), np.ones(3))
    state = tmp_path / "predictor-step0000.pt"
    torch.save(predictor.state_dict(), state)
    tr = Tracker(tmp_path / "wd")
    tr.start_or_resume("run-p")
    version = tr.log_checkpoint("predictor", state, 0)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tr.tracking_uri)
    model = mlflow.pyfunc.load_model(f"models:/{tr.model_name('predictor')}/{version}")
    got = model.predict(histories)
    assert np.allclose(got, predictor.predict(histories))
    assert all(0.0 <= p <= 1.0 for p in got)


@pytest.mark.parametrize("kind", ["policy", "predictor"])
def test_checkpoint_of_a_missing_path_is_refused(tmp_path, kind):
    from trace_rl.storage.tracking import TrackingError

    tr = Tracker(tmp_path)
    tr.start_or_resume("r")
    with pytest.raises(TrackingError, match="does not exist"):
        tr.log_checkpoint(kind, tmp_path / "nope", 0)
