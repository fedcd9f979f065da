"""A work dir is relocatable: a finished work dir copied elsewhere and resumed
from the copy writes nothing under the original, logs its MLflow artifacts into the copy, and
finds the finished phases of its Prefect cache (the cache keys and result records of the copy
name it, not the original)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from trace_rl.storage.store import TreeStore

TINY = {"engine": "hf", "steps": 1, "root_budget": 4, "pool_size": 4, "max_turns": 2,
        "max_new_tokens": 16, "multiplier": 1, "family": "synth_arith", "difficulty": 1,
        "plot_every": 1, "eval_items": 4, "eval_samples": 2}
# Train flows (66 s for the first test here at load 6, with the harness; 404 s for both at load 20+).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness"), pytest.mark.timeout(900)]


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


def test_a_copied_work_dir_resumes_in_place_and_leaves_the_original_alone(tiny_model_dir, tmp_path):
    from mlflow import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.train import train

    cfg = {**TINY, "policy": str(tiny_model_dir)}
    original, copy = tmp_path / "original", tmp_path / "copy"
    first = train(config=cfg, workdir=str(original))
    shutil.copytree(original, copy)
    before = _snapshot(original)
    # The copy forgets that its last step finished, so the resume runs that step again: every
    # cached phase must be found in the copy's cache, and every artifact land in the copy.
    TreeStore(copy).mark_step(first["run_id"], 0, "running")

    state = train(config=cfg, workdir=str(copy), return_state=True)
    assert state.is_completed()
    again = state.result()
    assert again["steps_run"] == 1 and again["run_id"] == first["run_id"]
    assert _snapshot(original) == before, "the resume from the copy wrote under the original"

    client = MlflowClient(tracking_uri=f"sqlite:///{copy / 'mlflow.db'}")
    run = client.get_run(again["mlflow_run_id"])
    assert run.info.artifact_uri.startswith((copy / "mlruns").as_uri())
    assert client.get_experiment(run.info.experiment_id).artifact_location == (
        copy / "mlruns").as_uri()
    assert Path(again["policy_dir"]).is_relative_to(copy)

    # The phases that ran in the original are cache hits in the copy.
    with get_client(sync_client=True) as prefect:
        runs = prefect.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    states = sorted((r.name, r.state.name) for r in runs)
    for phase in ("allocate-roots", "expand-roots", "allocate-prefixes",
                  "expand-prefixes", "tree-advantages", "fit-predictor", "policy-update"):
        assert any(name.startswith(phase) and s == "Cached" for name, s in states), (phase, states)


def test_phase_keys_do_not_depend_on_where_the_work_dir_lies(tmp_path):
    """The cache key of a phase names paths inside the work dir relative to it."""
    from types import SimpleNamespace

    from flows.common import bind
    from tasks import learn

    keys = []
    for wd in (tmp_path / "a", tmp_path / "b"):
        policy = bind(learn.tree_advantages, str(wd)).cache_policy
        ctx = SimpleNamespace(task=learn.tree_advantages)
        keys.append(policy.compute_key(ctx, {"workdir": str(wd), "run_id": "r", "step": 3,
                                             "policy_dir": str(wd / "checkpoints" / "p")}, {}))
    assert keys[0] == keys[1]
    other = bind(learn.tree_advantages, str(tmp_path / "a")).cache_policy.compute_key(
        SimpleNamespace(task=learn.tree_advantages), {"workdir": str(tmp_path / "a"), "run_id": "r",
                                             "step": 4}, {})
    assert other != keys[0]
