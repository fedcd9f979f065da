"""Learning phases: backup and tree advantages, predictor fit, policy update, weight sync."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from prefect import task

from tasks import runtime
from tasks.runtime import StepRef
from trace_core import advantages as adv
from trace_core.seeds import update_seed
from trace_core.predictor import auc, brier
from trace_rl.config import TrainConfig
from trace_rl.config.sections import Cluster
from trace_rl.policy.update import PathSample, PolicyTrainer, warmup_scale
from trace_rl.rollout.treeio import StepTrees
from trace_rl.session import Session


@task(name="tree-advantages", cache_policy=runtime.PHASE_KEY)
def tree_advantages(cfg: TrainConfig, at: StepRef, trees: StepTrees | None = None) -> pa.Table:
    """The backup, V^ and n of every node (success rate of the leaves below), then per
    root-to-leaf path its node ids and the advantage of each turn
    (``trace_core.advantages.path_advantages``, estimator from the config), stored on the nodes
    in one write (a node's advantage: the mean over the paths through it). ``trees``: the step's
    trees as the flow read them (else read here)."""
    trees = runtime.step_trees(at, trees)
    values, counts = trees.batch.backup()
    a = adv.path_advantages(trees.batch, cfg.advantage, centre=cfg.centre_advantages,
                            turns_once=cfg.count_turns_once)
    advantage = np.full(len(values), np.nan)
    advantage[a.nodes] = a.node_mean
    node_id = trees.table.column("node_id")
    runtime.store(at.workdir).update_values(at.run_id, at.step, pa.table({
        "node_id": node_id, "value": pa.array(values, pa.float64()),
        "n_leaves": pa.array(counts, pa.int64()),
        "advantage": pa.array(advantage, pa.float64(), from_pandas=True)}))
    return pa.table({
        "leaf_id": node_id.take(a.rows[a.ends - 1]) if len(a.ends) else pa.array([], pa.string()),
        "path": pa.ListArray.from_arrays(pa.array(np.r_[0, a.ends], pa.int32()),
                                         node_id.take(a.rows).combine_chunks() if len(a.rows)
                                         else pa.array([], pa.string())),
        "advantages": pa.ListArray.from_arrays(pa.array(np.r_[0, a.turn_ends], pa.int32()),
                                               pa.array(a.turn_advantages, pa.float64()))})


@task(name="fit-predictor", cache_policy=runtime.PHASE_KEY)
def fit_predictor(cfg: TrainConfig, at: StepRef, trees: StepTrees | None = None
                  ) -> dict[str, float]:
    """Regress V~(H_y) onto V^(y) (weights n_y) on this step's roots and prefixes; the metrics
    are those of the predictions made BEFORE the fit (what allocation actually used)."""
    trees = runtime.step_trees(at, trees)
    histories, y, weights = trees.predictor_examples(*trees.batch.backup())
    predictor = runtime.load_predictor(cfg.predictor, cfg.seed, at.workdir, at.run_id, at.step - 1,
                                       take=True)
    before = predictor.predict(histories)
    stats = {"predictor/brier": brier(before, y), "predictor/examples": float(len(y))}
    hard = (y == 0) | (y == 1)
    if hard.any() and 0 < y[hard].mean() < 1:
        stats["predictor/auc"] = auc(before[hard], y[hard])
    fit = predictor.fit(histories, y, weights)
    stats.update({f"predictor/fit_{k}": float(v) for k, v in fit.items()})
    runtime.save_predictor(predictor, at.workdir, at.run_id, at.step)
    return stats


def _samples(nodes: pa.Table, paths: pa.Table) -> list[PathSample]:
    """Each path's tokens, loss mask and per-token advantages, read from the step's columns."""
    flat = pc.list_flatten(paths.column("path"))
    found = pc.index_in(flat, value_set=nodes.column("node_id"))
    if found.null_count:
        raise ValueError(f"policy_update: {found.null_count} path node(s) are not among the "
                         f"step's stored nodes")
    rows = found.to_numpy().astype(np.int64)
    ends = np.cumsum(pc.list_value_length(paths.column("path")).to_numpy())
    gen, obs = nodes.column("gen_token_ids").to_pylist(), nodes.column("obs_token_ids").to_pylist()
    gen_lp = nodes.column("gen_logprobs").to_pylist()
    tree_id = nodes.column("tree_id").to_pylist()
    out = []
    for path, advs in zip(np.split(rows, ends[:-1]),
                          paths.column("advantages").to_pylist()):
        root = path[0]
        ids, mask, a = list(obs[root]), [0] * len(obs[root]), [0.0] * len(obs[root])
        lp = [0.0] * len(obs[root])  # the engine's log-probs, where it sampled
        known = True  # every turn of the path came with its engine log-probs
        for r, x in zip(path[1:], advs):
            ids += gen[r]
            mask += [1] * len(gen[r])
            a += [x] * len(gen[r])
            known = known and len(gen_lp[r] or ()) == len(gen[r])
            lp += (gen_lp[r] or []) + [0.0] * len(obs[r])
            ids += obs[r]
            mask += [0] * len(obs[r])
            a += [0.0] * len(obs[r])
        out.append(PathSample(ids, mask, a, group=int(tree_id[root]),
                              engine_logprobs=lp if known else None))
    return out


@task(name="policy-update", cache_policy=runtime.PHASE_KEY)
def policy_update(cfg: TrainConfig, at: StepRef, policy_dir: str, paths: pa.Table,
                  trees: StepTrees | None = None) -> dict[str, Any]:
    """Clipped tree-aware PG on every root-to-leaf path; saves the new policy checkpoint.
    ``trees``: the step's trees as the flow read them (else read here)."""
    samples = _samples(runtime.step_trees(at, trees).table, paths)
    lr_scale = warmup_scale(cfg.lr_warmup_steps, at.step)
    seed = update_seed(cfg.seed, at.step)
    if cfg.cluster:  # the trainer ranks on Ray; rank 0 writes the checkpoint (docs/cluster.md)
        ray = runtime.cluster_for(cfg.cluster_section, at.run_id, runtime.engine_kind(cfg.engine))
        stats = ray.update(cfg.update_settings, cfg.seed, policy_dir, samples, seed, lr_scale,
                           Path(at.policy_dir))
        return {"policy_dir": at.policy_dir, "stats": {f"loss/{k}": v for k, v in stats.items()}}
    # The trainer stays in the session across steps (keyed by the directory it last saved), so
    # the optimiser state is not reloaded each step; a resumed process reloads it.
    session = Session.current()
    trainer = session.take_trainer(policy_dir) or PolicyTrainer(policy_dir, cfg.update_settings,
                                                                seed=cfg.seed)
    stats = trainer.update(samples, torch.Generator().manual_seed(seed), lr_scale=lr_scale)
    trainer.save(Path(at.policy_dir))
    session.keep_trainer(at.policy_dir, trainer)
    return {"policy_dir": at.policy_dir, "stats": {f"loss/{k}": v for k, v in stats.items()}}


@task(name="sync-weights")
def sync_weights(engine: str, cluster: Cluster, run_id: str, policy_dir: str,
                 step: int | None = None) -> float:
    """Load the new weights into run ``run_id``'s rollout engine (``runtime.engine_for``; on a
    cluster: every engine actor, from the checkpoint or by a broadcast from trainer rank 0);
    returns seconds taken. ``step``: the step whose policy it is (it names the task run)."""
    t0 = time.perf_counter()
    runtime.engine_for(engine, cluster, run_id, policy_dir)
    return time.perf_counter() - t0
