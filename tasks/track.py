"""Tracking phases: tree metrics from the store's views, and the one place metrics are logged."""

from __future__ import annotations

from typing import Mapping

import numpy as np
from prefect import task

from tasks import runtime
from trace_rl.policy.update import OPTIMIZER_STATE
from trace_rl.rollout.treeio import parent_array
from trace_rl.storage import plots
from trace_rl.storage.tracking import Tracker


@task(name="tree-metrics", cache_policy=runtime.PHASE_KEY)
def tree_metrics(workdir: str, run_id: str, step: int) -> dict[str, float]:
    """Contrast and cost figures of a finished step, read with the same SQL users run."""
    store = runtime.store(workdir)
    q = {"r": run_id, "s": step}
    one = lambda sql: store.query(sql, q).to_pylist()[0]  # noqa: E731
    leaves = one("SELECT count(*) AS n, avg(reward) AS mean_reward, avg(depth) AS depth "
                 "FROM nodes WHERE run_id = $r AND step = $s AND is_leaf")
    internal = one("SELECT count(*) AS n FROM nodes WHERE run_id = $r AND step = $s "
                   "AND NOT is_leaf")
    roots = one("SELECT count(*) AS n, count(*) FILTER (WHERE value > 0 AND value < 1) AS mixed "
                "FROM nodes WHERE run_id = $r AND step = $s AND depth = 0")
    anchors = one("SELECT count(*) AS n FROM mixed_anchors WHERE run_id = $r AND step = $s")
    pairs = one("SELECT count(*) AS n FROM contrast_pairs WHERE run_id = $r AND step = $s")
    ledger = one("SELECT sum(trajectories) AS trajectories, sum(prompt_tokens) AS prompt_tokens, "
                 "sum(generated_tokens) AS generated_tokens, sum(tool_calls) AS tool_calls, "
                 "sum(wall_seconds) AS wall_seconds FROM ledger WHERE run_id = $r AND step = $s")
    n_leaves = max(leaves["n"], 1)
    out = {
        "rollout/reward_mean": float(leaves["mean_reward"] or 0.0),
        "rollout/leaves": float(leaves["n"]),
        "rollout/depth_mean": float(leaves["depth"] or 0.0),
        "tree/effective_ratio": roots["mixed"] / roots["n"] if roots["n"] else 0.0,
        "tree/mixed_anchor_share": anchors["n"] / internal["n"] if internal["n"] else 0.0,
        "tree/contrast_pairs_per_100_leaves": 100.0 * pairs["n"] / n_leaves,
        "alloc/active_roots": float(roots["n"]),
    }
    out.update({f"ledger/{k}": float(v or 0.0) for k, v in ledger.items()})
    return out


@task(name="log-step")
def log_step(workdir: str, mlflow_run_id: str, run_id: str, step: int,
             metrics: Mapping[str, float], policy_dir: str, predictor_file: str,
             plot: bool, register_policy: bool = True) -> None:
    """Metrics, checkpoints (artifacts + registered versions) and pictures of one step. The
    policy is registered without its optimiser state (that stays in the local checkpoint, for
    resuming) and only where ``register_policy`` (``TrainConfig.checkpoint_every``)."""
    tracker = Tracker(workdir)
    tracker.start_or_resume(run_id, mlflow_run_id=mlflow_run_id)
    tracker.log_metrics(step, metrics)
    if register_policy:
        tracker.log_checkpoint("policy", policy_dir, step, exclude=(OPTIMIZER_STATE,))
    tracker.log_checkpoint("predictor", predictor_file, step)
    if not plot:
        return
    store = runtime.store(workdir)
    step_nodes = store.read_step(run_id, step)
    trees = step_nodes.column("tree_id").to_pylist()
    if trees:
        # The most contrastive tree of the step: the root whose value is closest to 1/2.
        roots = [r for r in step_nodes.to_pylist() if r["depth"] == 0]
        best = min(roots, key=lambda r: abs((r["value"] if r["value"] is not None else 0) - 0.5))
        tree = store.read_tree(run_id, step, best["tree_id"])
        value = [np.nan if v is None else v for v in tree.column("value").to_pylist()]
        reward = [np.nan if (r is None or not leaf) else r for r, leaf in
                  zip(tree.column("reward").to_pylist(), tree.column("is_leaf").to_pylist())]
        fig = plots.render_tree(parent_array(tree), value, reward,
                                title=f"{run_id} step {step} item {best['item_id']}")
        tracker.log_figure(fig, f"figures/tree_step_{step:04d}.png")
    scored = store.query("SELECT predicted_v, value FROM nodes WHERE run_id = $r AND step = $s "
                         "AND NOT is_leaf AND predicted_v IS NOT NULL AND value IS NOT NULL",
                         {"r": run_id, "s": step})
    if scored.num_rows >= 2:
        fig = plots.calibration_plot(scored.column("predicted_v").to_pylist(),
                                     scored.column("value").to_pylist(),
                                     title=f"predictor calibration, step {step}")
        tracker.log_figure(fig, f"figures/calibration_step_{step:04d}.png")
