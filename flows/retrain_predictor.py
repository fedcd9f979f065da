"""The ``retrain-predictor`` flow: fit a fresh predictor on every stored tree of a run (all steps),
report its held-out calibration (the last step is held out), and save it next to the run's
checkpoints. Useful after changing the predictor's features, without re-running rollouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from prefect import flow, task

from flows.common import resolve_workdir
from tasks import runtime
from trace_core.predictor import auc, brier, ece
from trace_rl.config import config_from_mapping
from trace_rl.rollout.treeio import StepTrees


def _examples(workdir: str, run_id: str, step: int) -> tuple[list[str], np.ndarray, np.ndarray]:
    return StepTrees(runtime.store(workdir).read_step(run_id, step)).predictor_examples()


@task(name="refit-predictor")
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
    predictor = runtime.new_predictor(cfg)
    for _ in range(epochs):
        for s in steps[:-1]:
            h, y, w = _examples(workdir, run_id, s)
            if h:
                predictor.fit(h, y, w)
    h, y, _ = _examples(workdir, run_id, steps[-1])
    p = predictor.predict(h)
    hard = (y == 0) | (y == 1)
    out = {"held_out_step": steps[-1], "examples": len(y), "brier": brier(p, y), "ece": ece(p, y),
           "brier_constant": brier(np.full_like(y, y.mean()), y)}
    if hard.any() and 0 < y[hard].mean() < 1:
        out["auc"] = auc(p[hard], y[hard])
    path = Path(workdir) / "checkpoints" / run_id / "predictor-retrained.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(predictor.state_dict(), path)
    out["path"] = str(path)
    return out


@flow(name="retrain-predictor", log_prints=True)
def retrain_predictor(run_id: str, workdir: str | None = None, epochs: int = 3) -> dict[str, Any]:
    """Refit the predictor over a run's stored trees; returns held-out calibration figures."""
    result = refit(run_id, resolve_workdir(workdir), epochs)
    print(f"held-out step {result['held_out_step']}: Brier {result['brier']:.4f} "
          f"(constant {result['brier_constant']:.4f})")
    return result
