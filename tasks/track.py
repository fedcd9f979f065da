"""Tracking phases: a step's tree metrics, and the one place metrics are logged
(the summaries and Markdown they log: ``tasks.reports``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
from prefect import task

from tasks import runtime
from tasks.correlation import remember_step_terms
from tasks.roots import remember_bare_counts
from tasks.runtime import StepRef
from tasks.reports import (artifact_key, complete_steps, fmt_value, promotion_line,  # noqa: F401
                           run_summary, step_markdown, summary_markdown)
from tasks.reports import slug as _slug  # re-exported under its old name
from trace_core import calibration
from trace_core.tree import TreeBatch, sibling_contrast_pairs
from trace_core.predictor import auc, brier
from trace_rl.policy.update import OPTIMIZER_STATE
from trace_rl.rollout.treeio import StepTrees
from trace_rl.session import Session
from trace_rl.storage import background, plots
from trace_rl.storage.tracking import Tracker
from trace_rl.view.page import step_page


def tree_metrics(at: StepRef, trees: StepTrees | None = None) -> dict[str, float]:
    """Contrast and cost figures of a finished step (``tree_figures``, on its trees in memory:
    the figures the store's views give, ``tests/test_track.py``), its cost from the ledger, and
    how well its allocation inputs predicted its outcomes (``prediction_metrics``), the ledger
    and the scores read on one read-only snapshot (the first half of ``log_step``). ``trees``:
    the step's trees as the flow read them (else read here)."""
    trees = runtime.step_trees(at, trees)
    with runtime.store(at.workdir).snapshot() as con:
        params = {"r": at.run_id, "s": at.step}
        ledger = con.sql(LEDGER_SQL, params=params).to_arrow_table().to_pylist()[0]["ledger"]
        scores = con.sql(SCORES_SQL, params=params).to_arrow_table()
    return {**tree_figures(trees.batch),
            **{f"ledger/{k}": float(v or 0.0) for k, v in (ledger or {}).items()},
            **prediction_metrics(at, trees, scores)}


LEDGER_SQL = (
    "SELECT struct_pack(trajectories := sum(trajectories), prompt_tokens := sum(prompt_tokens), "
    "generated_tokens := sum(generated_tokens), tool_calls := sum(tool_calls), "
    "wall_seconds := sum(wall_seconds)) AS ledger FROM ledger WHERE run_id = $r AND step = $s")
"""A step's sampling cost: the ledger's sums over its levels and waves."""
SCORES_SQL = ("SELECT node_id, predicted_v FROM allocations WHERE run_id = $r AND step = $s AND "
              "level = 1")
"""Stage 2's scores of a step's prefixes, as the allocation used them."""


def tree_figures(batch: TreeBatch) -> dict[str, float]:
    """A step's tree figures from its trees: its leaves (their mean reward and depth), roots
    (the share mixed), mixed anchors per internal node (``TreeBatch.reward_range``: the
    ``mixed_anchors`` view) and sibling pairs whose leaf success rates differ per 100 leaves
    (``sibling_contrast_pairs``: the ``contrast_pairs`` view). In memory: the views recurse over
    every stored step, ~45 ms a step here and growing with the run."""
    if batch.num_rows == 0:
        return {"rollout/reward_mean": 0.0, "rollout/leaves": 0.0, "rollout/depth_mean": 0.0,
                "tree/effective_ratio": 0.0, "tree/mixed_anchor_share": 0.0,
                "tree/contrast_pairs_per_100_leaves": 0.0, "alloc/active_roots": 0.0}
    value, _ = batch.backup()
    lo, hi = batch.reward_range()
    leaf, root = batch.is_leaf, batch.up < 0
    leaves, internal, roots = int(leaf.sum()), int((~leaf).sum()), int(root.sum())
    anchors = int((~leaf & (lo < hi)).sum())
    return {
        "rollout/reward_mean": float(batch.reward[leaf].mean()) if leaves else 0.0,
        "rollout/leaves": float(leaves),
        "rollout/depth_mean": float(batch.depth[leaf].mean()) if leaves else 0.0,
        "tree/effective_ratio": float((root & (value > 0) & (value < 1)).sum() / roots)
        if roots else 0.0,
        "tree/mixed_anchor_share": anchors / internal if internal else 0.0,
        "tree/contrast_pairs_per_100_leaves":
            100.0 * sibling_contrast_pairs(batch.up, value) / max(leaves, 1),
        "alloc/active_roots": float(roots),
    }


def prediction_metrics(at: StepRef, trees: StepTrees | None = None,
                       scores: pa.Table | None = None) -> dict[str, float]:
    """How well the step's allocation inputs predicted its outcomes (``trace_core.calibration.
    batch_pairs``, ``batch_terms``): Stage 1's root predictions against the bare rollouts'
    rewards, Stage 2's prefix predictions against the reward of the bare rollout each prefix lies
    on (AUC where both outcomes occur, Brier), and the continuations' flip rate: predicted (a
    continuation of a prefix whose bare rollout ended in r flips with probability 1 - q, q the
    predicted chance of r, as independent draws) against realised. Read from the store
    (``scores``: the rows of ``SCORES_SQL`` when already read)."""
    if scores is None:
        scores = runtime.store(at.workdir).query(SCORES_SQL, {"r": at.run_id, "s": at.step})
    trees = runtime.step_trees(at, trees)
    predicted = trees.allocation_scores(scores)
    pairs = calibration.batch_pairs(trees.batch, predicted)
    terms = calibration.batch_terms(trees.batch, predicted)
    remember_step_terms(at.workdir, at.run_id, at.step, terms)  # the next steps' rho reads them
    flips = [t for t in terms if t.depth >= 1]
    out: dict[str, float] = {}
    for name, p, y in (("root", pairs[0], pairs[1]), ("prefix", pairs[2], pairs[3])):
        if len(p):
            out[f"predictor/{name}_brier"] = brier(p, y)
        if len(p) and 0 < y.mean() < 1:
            out[f"predictor/{name}_auc"] = auc(p, y)
    units = sum(t.units for t in flips)
    if units:
        out["predictor/flip_predicted"] = sum(t.expected for t in flips) / units
        out["predictor/flip_realised"] = sum(t.observed for t in flips) / units
    return out


def allocation_metrics(roots: pa.Table, prefixes: pa.Table, waves: int) -> dict[str, float]:
    """``alloc/`` metrics of a step from its allocations (``roots`` with ``m`` of the joint
    split's fresh prompts, ``prefixes`` with ``k``): the outcome correlations they used, prefixes
    continued, level-0 waves after the first (refills and fresh prompts) and fresh leaves."""
    depth = prefixes.column("depth").to_numpy()
    rho_prefix = prefixes.column("correlation").to_numpy()[depth >= 1]
    return {"alloc/rho_root": float(roots.column("correlation")[0].as_py() if len(roots) else 0.0),
            "alloc/rho_prefix": float(np.mean(rho_prefix)) if rho_prefix.size else 0.0,
            "alloc/prefixes_expanded": float(np.count_nonzero(prefixes.column("k").to_numpy())),
            "alloc/refill_waves": float(waves - 1),
            "alloc/fresh_leaves": float(np.sum(roots.column("m").to_numpy()))}


def oracle_metrics(*measured: pa.Table | None) -> dict[str, float]:
    """What the step's Monte-Carlo oracle cost (``tasks.expand.measure_roots`` and
    ``measure_prefixes``; none without one): its rollouts and their generated tokens, apart
    from the ledger's."""
    tables = [t for t in measured if t is not None]
    if not tables:
        return {}
    return {f"predictor/oracle_{name}":
            float(sum(np.sum(t.column(column).to_numpy()) for t in tables))
            for name, column in (("rollouts", "rollouts"), ("tokens", "generated_tokens"))}


def mlflow_run_name(cfg: Any) -> str:
    """The MLflow run's name: family, allocator, policy and the config's short hash (e.g.
    ``synth_arith-trace-tiny-3f2a9c``), so that runs tell themselves apart in the UI; the
    config's ``run_name`` (the lineage) is the tag ``trace.run_name``."""
    policy = Path(cfg.policy)
    short = policy.parent.name if policy.name == "model" else policy.name
    return f"{cfg.family}-{cfg.allocator}-{short}-{cfg.config_hash[:6]}"


def run_tags(cfg: Any) -> dict[str, str]:
    """Tags of a new MLflow run: the lineage, family, allocator and policy."""
    return {"trace.run_name": cfg.run_name, "trace.family": cfg.family,
            "trace.allocator": cfg.allocator, "trace.policy": str(cfg.policy)}


@task(name="log-datasets", task_run_name="log-datasets")
def log_datasets(cfg: Any, workdir: str, mlflow_run_id: str, run_id: str) -> dict[str, str]:
    """The task items of the train and eval splits as the run's MLflow inputs (``log_input``:
    name ``<family>/<split>``, context ``train`` / ``eval``, MLflow's digest of the rows);
    returns name -> digest. A split that does not load (a family without the default eval
    split) is left out and said so in the log."""
    from prefect import get_run_logger

    tracker = Tracker(workdir)
    tracker.start_or_resume(run_id, mlflow_run_id=mlflow_run_id)
    out = {}
    for context, split in (("train", cfg.train_split), ("eval", cfg.eval_split)):
        try:
            items = runtime.env_for(cfg).load(split)
        except (OSError, ValueError, KeyError) as exc:
            get_run_logger().warning("dataset %s/%s not logged: %s", cfg.family, split, exc)
            continue
        rows = [{"id": it.id, "question": it.question, "gold": json.dumps(it.gold, default=str)}
                for it in items]
        name = f"{cfg.family}/{split}"
        where = {"family": cfg.family, "split": split}
        if Path(split).is_file():
            where["path"] = str(Path(split).resolve())
        out[name] = tracker.log_dataset(rows, name, context, source=where)
    return out


PENDING = ".pending-logs"
"""Folder of the work dir holding each step's logging job until it has run (``log_step``)."""


@task(name="log-step")
def log_step(at: StepRef, mlflow_run_id: str, metrics: Mapping[str, float], plot: bool,
             register_policy: bool = True, trees: StepTrees | None = None) -> dict[str, float]:
    """The step's metrics: its tree figures (``tree_metrics``; ``trees`` as the flow read them)
    and ``metrics``, returned (the step's prompt counts kept for the next step:
    ``remember_bare_counts``); and their MLflow logging (``log_step_now``) handed to the work
    dir's logging thread (``trace_rl.storage.background``), so the next step does not wait. Never
    lost: the job is first written to the work dir's journal (``PENDING``) and removed from it
    once it has run; a journal entry a killed or failed process left is run before the next
    step's logging and before the run's summary (``replay_pending``). The run's ``Tracker.end``
    (finished or failed) waits for the thread, and a job's error fails the run."""
    workdir, run_id = at.workdir, at.run_id
    metrics = {**tree_metrics(at, trees), **metrics}
    remember_bare_counts(workdir, run_id, at.step, runtime.step_trees(at, trees))
    job = {"workdir": workdir, "mlflow_run_id": mlflow_run_id, "run_id": run_id, "step": at.step,
           "metrics": {k: float(v) for k, v in metrics.items()}, "policy_dir": at.policy_dir,
           "predictor_file": at.predictor_file, "plot": bool(plot),
           "register_policy": bool(register_policy)}
    replay_pending(workdir, run_id)
    entry = Path(workdir) / PENDING / f"{_slug(run_id)}-step-{at.step:06d}.json"
    entry.parent.mkdir(exist_ok=True)
    tmp = entry.with_suffix(".tmp")
    tmp.write_text(json.dumps(job))
    os.replace(tmp, entry)
    session = Session.current()  # remembers the journal files it submitted and not yet finished
    session.queue(entry)

    def run() -> None:
        try:
            log_step_now(**job)
            entry.unlink(missing_ok=True)
        finally:
            session.finish(entry)

    background.submit(workdir, run)
    return dict(job["metrics"])


def replay_pending(workdir: str, run_id: str) -> list[int]:
    """Run the journal's logging jobs of ``run_id`` that no thread of this process holds (those
    a killed or failed process left), in step order; returns their steps. Logging a step again
    is harmless: metrics already logged for a step are skipped and a registered checkpoint is
    found again (``Tracker.log_metrics``, ``log_checkpoint``)."""
    done, session = [], Session.current()
    for entry in sorted((Path(workdir) / PENDING).glob(f"{_slug(run_id)}-step-*.json")):
        if session.queued(entry):
            continue
        job = json.loads(entry.read_text())
        log_step_now(**job)
        entry.unlink(missing_ok=True)
        done.append(job["step"])
    return done


def log_step_now(workdir: str, mlflow_run_id: str, run_id: str, step: int,
                 metrics: Mapping[str, float], policy_dir: str, predictor_file: str,
                 plot: bool, register_policy: bool = True) -> None:
    """Metrics, checkpoints (artifacts + registered versions) and pictures of one step. The
    policy and the predictor are registered only where ``register_policy``
    (``TrainConfig.checkpoint_every``), the policy without its optimiser state (that stays in
    the local checkpoint, for resuming)."""
    tracker = Tracker(workdir)
    tracker.start_or_resume(run_id, mlflow_run_id=mlflow_run_id)
    tracker.log_metrics(step, metrics)
    if register_policy:
        about = (f"after step {step} of TRACE run {run_id} (MLflow run "
                 f"{tracker.client.get_run(mlflow_run_id).info.run_name})")
        tracker.log_checkpoint("policy", policy_dir, step, exclude=(OPTIMIZER_STATE,),
                               description=f"Policy {about}; reward "
                                           f"{metrics.get('rollout/reward_mean', 0.0):.3f}.")
        tracker.log_checkpoint("predictor", predictor_file, step,
                               description=f"Predictor {about}.")
    log_step_page(tracker, workdir, run_id, step, metrics)
    if not plot:
        return
    store = runtime.store(workdir)
    before = store.get_eval(run_id, 0)
    _log_reward_curve(tracker, run_id, [before] if before else [],  # this step: not complete yet
                      [s for s in complete_steps(store, run_id) if s["step"] < step]
                      + [{"step": step, "reward": metrics["rollout/reward_mean"]}])
    trees = StepTrees(store.read_step(run_id, step))
    if len(trees):
        # The most contrastive tree of the step: the root whose value is closest to 1/2.
        value = trees.floats("value")
        roots = trees.offsets[:-1]
        k = int(np.argmin(np.abs(np.nan_to_num(value[roots], nan=0.0) - 0.5)))
        s = slice(trees.offsets[k], trees.offsets[k + 1])
        fig = plots.render_tree(trees.parent[s], value[s], trees.reward[s],
                                title=f"{run_id} step {step} item {trees.column('item_id')[roots[k]]}")
        tracker.log_step_figure(fig, "tree", step)
    scored = store.query("SELECT predicted_v, value FROM nodes WHERE run_id = $r AND step = $s "
                         "AND NOT is_leaf AND predicted_v IS NOT NULL AND value IS NOT NULL",
                         {"r": run_id, "s": step})
    if scored.num_rows >= 2:
        fig = plots.calibration_plot(scored.column("predicted_v").to_pylist(),
                                     scored.column("value").to_pylist(),
                                     title=f"predictor calibration, step {step}")
        tracker.log_step_figure(fig, "calibration", step)


def log_step_page(tracker: Tracker, workdir: str, run_id: str, step: int,
                  metrics: Mapping[str, float] | None = None) -> str:
    """The step's ``trace view`` page (its trees and allocation, one self-contained file) as the
    MLflow artifact ``view/step_NNNN.html``, which the MLflow UI shows as a page, and two
    artifacts on the Prefect flow run: a Markdown summary of the step (reward, effective ratio,
    leaves, the allocation, links to the MLflow run and the tree page) and a table of the root
    allocation. Returns the page's URI."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    store = runtime.store(workdir)
    uri = tracker.log_text(step_page(store, run_id, step), f"view/step_{step:04d}.html")
    # realised V: the root's backed-up value (success rate of the leaves below it), as the page
    # shows it; allocations.true_v is the true V, which only a simulation has
    roots = store.query("SELECT a.item_id, a.predicted_v, n.value AS realised_v, a.k "
                        "FROM allocations a LEFT JOIN nodes n ON n.run_id = a.run_id "
                        "AND n.node_id = a.node_id WHERE a.run_id = $r AND a.step = $s "
                        "AND a.level = 0 ORDER BY a.k DESC, a.item_id",
                        {"r": run_id, "s": step}).to_pylist()
    create_markdown_artifact(key=f"view-{_slug(run_id)}-step-{step}",
                             markdown=step_markdown(tracker, workdir, run_id, step, metrics or {},
                                                    roots),
                             description=f"TRACE run {run_id}, step {step}: what it did")
    if roots:
        create_table_artifact(
            key=f"allocation-{_slug(run_id)}-{step}",
            table=[{"item": r["item_id"], "predicted V": fmt_value(r["predicted_v"]),
                    "realised V": fmt_value(r["realised_v"]), "bare rollouts": r["k"]}
                   for r in roots],
            description=f"TRACE run {run_id}, step {step}: bare rollouts per prompt (root "
                        f"allocation), with the predicted and realised success rate")
    return uri


TASK_RUN_FIELDS = ("step", "level", "wave")
"""Parameters of a phase that name its task runs, in this order."""


def named(task: Any) -> Any:
    """The task with task-run names from its step (or its ``StepRef``'s), level and wave
    parameters (e.g. ``expand-roots step 3 wave 1``) instead of Prefect's ``expand-roots-718``."""
    import inspect

    params = inspect.signature(task.fn).parameters
    fields = [f for f in TASK_RUN_FIELDS if f in params or f == "step" and "at" in params]
    if not fields:
        return task

    def task_run_name(parameters: dict[str, Any]) -> str:
        at = parameters.get("at")
        given = {**({"step": at.step} if isinstance(at, StepRef) else {}), **parameters}
        return " ".join([task.name] + [f"{f} {given[f]}" for f in fields
                                       if given.get(f) is not None])

    return task.with_options(task_run_name=task_run_name)


@task(name="log-summary", task_run_name="log-summary")
def log_summary(workdir: str, mlflow_run_id: str, run_id: str, where: Mapping[str, str]
                ) -> dict[str, Any]:
    """The run's summary (``run_summary``) as MLflow metrics (``eval/accuracy`` at step 0 and at
    the last evaluation, their intervals, the paired gain), the reward curve as one figure, and a
    Markdown artifact of the Prefect flow run; returns the summary."""
    from prefect.artifacts import create_markdown_artifact

    background.drain(workdir)  # every step's logging, before the summary reads the registry
    replay_pending(workdir, run_id)
    summary = run_summary(workdir, run_id)
    tracker = Tracker(workdir)
    tracker.start_or_resume(run_id, mlflow_run_id=mlflow_run_id)
    for e in (summary["before"], summary["after"]):
        if e is not None:
            tracker.log_metrics(e["step"], {"eval/accuracy": e["accuracy"],
                                            **({"eval/ci_low": e["ci_low"],
                                                "eval/ci_high": e["ci_high"]}
                                               if e["ci_low"] is not None else {})})
    if summary["gain"] is not None and summary["after"] is not None:
        g = summary["gain"]
        tracker.log_metrics(summary["after"]["step"], {"eval/gain": g["mean"],
                                                       "eval/gain_low": g["low"],
                                                       "eval/gain_high": g["high"]})
    _log_reward_curve(tracker, run_id, [e for e in (summary["before"], summary["after"]) if e],
                      summary["steps"])
    promotion = promote_policy(tracker, workdir, run_id, summary)
    where = {**where, **({"Registry": promotion_line(tracker, promotion)} if promotion else {})}
    create_markdown_artifact(key=artifact_key(run_id), markdown=summary_markdown(summary, where),
                             description=f"TRACE run {run_id}: what training achieved")
    return summary


def promote_policy(tracker: Tracker, workdir: str, run_id: str,
                   summary: Mapping[str, Any]) -> dict[str, Any] | None:
    """Offer the run's last registered policy for ``champion`` with its held-out accuracy after
    training (``Tracker.promote``; compared only with a champion evaluated on the same split,
    items and samples). None when the run has no evaluation after training."""
    after = summary["after"]
    if after is None:
        return None
    cfg = runtime.store(workdir).get_run(run_id)["config"]
    split = (f"{cfg['family']}/{cfg['eval_split']} ({after['items']} items x "
             f"{after['samples']} samples)")
    from prefect import get_run_logger

    steps = f"{after['step']} step{'' if after['step'] == 1 else 's'}"
    promotion = tracker.promote("policy", after["accuracy"], split, description=(
        f"Policy after {steps} of TRACE run {run_id}: held-out accuracy "
        f"{after['accuracy']:.3f} on {split}."))
    get_run_logger().info("registry: %s", promotion_line(tracker, promotion))
    return promotion


def _log_reward_curve(tracker: Tracker, run_id: str, evals: list[Mapping[str, Any]],
                      steps: list[Mapping[str, Any]]) -> None:
    """``figures/reward.png``, one file per run, redrawn as steps finish."""
    marks = {e["step"]: (e["accuracy"], e["ci_low"], e["ci_high"])
             for e in evals if e["ci_low"] is not None}
    fig = plots.reward_curve([s["step"] for s in steps], [s["reward"] for s in steps],
                             evals=marks, title=run_id)
    tracker.log_figure(fig, "figures/reward.png")
