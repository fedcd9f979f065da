"""The ``retrain-predictor`` flow: fit a fresh predictor on every stored tree of a run but the last
step, which is held out, and judge it there against two rivals: the constant prediction (the
held-out mean) and the run's current predictor (the one saved after the step before the held-out
one, which saw the same trees). Its held-out Brier and ECE and the rivals' are logged as metrics
of an MLflow run nested under the train run's; the new predictor is saved next to the run's
checkpoints and registered (``<experiment>-predictor``) only when its Brier beats both, and the
flow's final state says which. Useful after changing the predictor's features, without re-running
rollouts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prefect import flow, task
from prefect.states import Completed

from flows.common import RELEASES_ENGINES, prepare_workdir
from tasks import runtime
from trace_core.predictor import auc, brier, ece
from trace_rl.config import config_from_mapping
from trace_rl.rollout.treeio import StepTrees
from trace_rl.storage.tracking import Tracker


def _examples(workdir: str, run_id: str, step: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    return StepTrees(runtime.store(workdir).read_step(run_id, step)).predictor_examples()


@task(name="refit-predictor", task_run_name="refit-predictor {run_id}")
def refit(run_id: str, workdir: str, epochs: int) -> dict[str, Any]:
    known = runtime.store(workdir).get_run(run_id)
    if known is None:
        raise ValueError(f"retrain_predictor: no run {run_id!r} in {workdir}")
    cfg = config_from_mapping(known["config"], f"run {run_id} config")
    steps = runtime.store(workdir).query(
        "SELECT DISTINCT step FROM nodes WHERE run_id = $r AND value IS NOT NULL ORDER BY step",
        {"r": run_id}).column("step").to_pylist()
    if len(steps) < 2:
        raise ValueError(f"retrain_predictor: run {run_id} needs at least 2 backed-up steps, has {len(steps)}")
    predictor = runtime.new_predictor(cfg.predictor, cfg.seed)
    for _ in range(epochs):
        for s in steps[:-1]:
            h, y, w = _examples(workdir, run_id, s)
            if h:
                predictor.fit(h, y, w)
    h, y, _ = _examples(workdir, run_id, steps[-1])
    p = predictor.predict(h)
    hard = (y == 0) | (y == 1)
    constant = np.full_like(y, y.mean())
    current = runtime.load_predictor(cfg.predictor, cfg.seed, workdir, run_id, steps[-1] - 1).predict(h)
    out = {"held_out_step": steps[-1], "examples": len(y), "brier": brier(p, y), "ece": ece(p, y),
           "brier_constant": brier(constant, y), "ece_constant": ece(constant, y),
           "brier_current": brier(current, y), "ece_current": ece(current, y)}
    if hard.any() and 0 < y[hard].mean() < 1:
        out["auc"] = auc(p[hard], y[hard])
    path = Path(workdir) / "checkpoints" / run_id / "predictor-retrained.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(predictor.state_dict(), path)
    out["path"] = str(path)
    out.update(_track(workdir, run_id, known.get("mlflow_run_id"), out, path))
    return out


def _track(workdir: str, run_id: str, parent: str | None, out: dict[str, Any],
           path: Path) -> dict[str, Any]:
    """The refit's figures as metrics of a new MLflow run nested under the train run, and the
    predictor registered if its held-out Brier beats both the constant and the current one."""
    beats = {rival: out["brier"] < out[f"brier_{rival}"] for rival in ("constant", "current")}
    tracker = Tracker(workdir)
    tracker.start_or_resume(f"{run_id}.refit-{time.strftime('%Y%m%dT%H%M%S')}",
                            run_name=f"retrain-predictor {run_id}",
                            tags={"trace.parent_run": run_id,
                                  **({"mlflow.parentRunId": parent} if parent else {})})
    step = out["held_out_step"]
    tracker.log_metrics(step, {f"predictor/held_out_{k}": out[k] for k in (
        "brier", "ece", "brier_constant", "ece_constant", "brier_current", "ece_current")})
    version = None
    if all(beats.values()):
        version = tracker.log_checkpoint("predictor", path, step, description=(
            f"Predictor refit over steps 0-{step - 1} of TRACE run {run_id}: held-out Brier "
            f"{out['brier']:.4f} against {out['brier_constant']:.4f} (constant) and "
            f"{out['brier_current']:.4f} (the run's current predictor) on step {step}."))
    verdict = (f"held-out Brier {out['brier']:.4f} on step {step} vs constant "
               f"{out['brier_constant']:.4f} and current {out['brier_current']:.4f}: "
               + (f"registered as {tracker.model_name('predictor')} v{version}" if version else
                  "not registered (it does not beat "
                  + " and ".join(r for r, won in beats.items() if not won) + ")"))
    tracker.end("FINISHED")
    return {"registered": version is not None, "version": version, "verdict": verdict,
            "mlflow_run_id": tracker.run_id}


@flow(name="retrain-predictor", log_prints=True, flow_run_name="retrain-predictor {run_id}",
      **RELEASES_ENGINES)
def retrain_predictor(run_id: str, workdir: str | None = None, epochs: int = 3) -> Any:
    """Refit the predictor over a run's stored trees; returns held-out calibration figures
    against the constant and the current predictor, and whether it was registered (the final
    state's message says so too).

    Args:
        run_id: The train run whose trees are refit (its last step is held out).
        workdir: The work dir that holds the run (default trace_runs).
        epochs: Passes over the run's steps.
    """
    result = refit(run_id, prepare_workdir(workdir), epochs)
    print(result["verdict"])
    return Completed(message=result["verdict"], data=result)
