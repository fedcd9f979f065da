"""Learning phases: backup, predictor fit, tree advantages, policy update, weight sync."""

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
from trace_core import advantages as adv
from trace_core.predictor import auc, brier
from trace_rl.config import TrainConfig
from trace_rl.policy.update import PathSample, PolicyTrainer, warmup_scale
from trace_rl.rollout.treeio import StepTrees

@task(name="backup", cache_policy=runtime.PHASE_KEY)
def backup(workdir: str, run_id: str, step: int, cfg: TrainConfig | None = None,
           trees: StepTrees | None = None) -> dict[str, float]:
    """V^ and n for every node (success rate of the leaves below), stored on the nodes.
    ``trees``: the step's trees as the flow read them (else read here)."""
    trees = runtime.step_trees(workdir, run_id, step, trees)
    values, counts = trees.batch.backup()
    roots = values[trees.batch.roots]
    mixed = int(np.count_nonzero((roots > 0.0) & (roots < 1.0)))
    runtime.store(workdir).update_values(run_id, step, pa.table({
        "node_id": trees.table.column("node_id"), "value": pa.array(values, pa.float64()),
        "n_leaves": pa.array(counts, pa.int64())}))
    return {"tree/effective_ratio": mixed / len(trees) if len(trees) else 0.0,
            "tree/trees": float(len(trees))}


@task(name="fit-predictor", cache_policy=runtime.PHASE_KEY)
def fit_predictor(cfg: TrainConfig, workdir: str, run_id: str, step: int,
                  trees: StepTrees | None = None) -> dict[str, float]:
    """Regress V~(H_y) onto V^(y) (weights n_y) on this step's roots and prefixes; the metrics
    are those of the predictions made BEFORE the fit (what allocation actually used)."""
    trees = runtime.step_trees(workdir, run_id, step, trees)
    histories, y, weights = trees.predictor_examples(*trees.batch.backup())
    predictor = runtime.load_predictor(cfg, workdir, run_id, step - 1)
    before = predictor.predict(histories)
    stats = {"predictor/brier": brier(before, y), "predictor/examples": float(len(y))}
    hard = (y == 0) | (y == 1)
    if hard.any() and 0 < y[hard].mean() < 1:
        stats["predictor/auc"] = auc(before[hard], y[hard])
    fit = predictor.fit(histories, y, weights)
    stats.update({f"predictor/fit_{k}": float(v) for k, v in fit.items()})
    runtime.save_predictor(predictor, workdir, run_id, step)
    return stats


@task(name="tree-advantages", cache_policy=runtime.PHASE_KEY)
def tree_advantages(cfg: TrainConfig, workdir: str, run_id: str, step: int,
                    trees: StepTrees | None = None) -> pa.Table:
    """Per root-to-leaf path: its node ids and the advantage of each turn (estimator from the
    config). Each node also stores the mean advantage over the paths through it."""
    trees = runtime.step_trees(workdir, run_id, step, trees)
    batch = trees.batch
    turned = np.flatnonzero(batch.sizes >= 2)  # a root alone has no turn to train
    mine = batch.select(turned)
    a = adv.advantages(mine, cfg.advantage, centre=cfg.centre_advantages,
                       turns_once=cfg.count_turns_once)  # [L, D]
    paths = mine.paths()  # [L, D+1] rows of ``mine``
    back = batch.rows_of(turned)  # the step's row of each row of ``mine``
    on = paths >= 0
    rows = back[paths[on]]  # every path's rows, root first, path after path
    ends = np.cumsum(on.sum(axis=1))  # [L]
    turns = on[:, 1:]
    node_sum = np.zeros(batch.num_rows, dtype=np.float64)  # per row: advantages summed
    node_cnt = np.zeros(batch.num_rows, dtype=np.int64)  # per row: paths through it
    turn_rows = back[paths[:, 1:][turns]]
    np.add.at(node_sum, turn_rows, a[turns])
    np.add.at(node_cnt, turn_rows, 1)
    node_id = trees.table.column("node_id")
    leaf_ids = node_id.take(rows[ends - 1]) if len(ends) else pa.array([], pa.string())
    path_nodes = pa.ListArray.from_arrays(pa.array(np.r_[0, ends], pa.int32()),
                                          node_id.take(rows).combine_chunks()
                                          if len(rows) else pa.array([], pa.string()))
    path_adv = pa.ListArray.from_arrays(pa.array(np.r_[0, np.cumsum(turns.sum(axis=1))],
                                                 pa.int32()), pa.array(a[turns], pa.float64()))
    through = np.flatnonzero(node_cnt)
    if through.size:
        runtime.store(workdir).update_values(run_id, step, pa.table({
            "node_id": trees.table.column("node_id").take(through),
            "advantage": pa.array(node_sum[through] / node_cnt[through], pa.float64())}))
    return pa.table({"leaf_id": leaf_ids, "path": path_nodes, "advantages": path_adv})


_LIVE: dict[str, PolicyTrainer] = {}


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
def policy_update(cfg: TrainConfig, workdir: str, run_id: str, step: int, policy_dir: str,
                  paths: pa.Table, trees: StepTrees | None = None) -> dict[str, Any]:
    """Clipped tree-aware PG on every root-to-leaf path; saves the new policy checkpoint.
    ``trees``: the step's trees as the flow read them (else read here)."""
    nodes = runtime.step_trees(workdir, run_id, step, trees).table
    settings = cfg.update_settings
    out = runtime.Paths(Path(workdir)).policy_dir(run_id, step)
    lr_scale = warmup_scale(cfg.lr_warmup_steps, step)
    if cfg.cluster:  # the trainer ranks on Ray; rank 0 writes the checkpoint (docs/cluster.md)
        stats = runtime.cluster_for(cfg).update(settings, cfg.seed, policy_dir,
                                                _samples(nodes, paths),
                                                cfg.seed * 7919 + step, lr_scale, out)
        return {"policy_dir": str(out), "stats": {f"loss/{k}": v for k, v in stats.items()}}
    # The trainer stays in memory across steps of one process (keyed by the directory it last
    # saved), so the optimiser state is not reloaded each step; a resumed process reloads it.
    trainer = _LIVE.pop(policy_dir, None) or PolicyTrainer(policy_dir, settings, seed=cfg.seed)
    rng = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    stats = trainer.update(_samples(nodes, paths), rng, lr_scale=lr_scale)
    trainer.save(out)
    _LIVE[str(out)] = trainer
    return {"policy_dir": str(out), "stats": {f"loss/{k}": v for k, v in stats.items()}}


@task(name="sync-weights")
def sync_weights(cfg: TrainConfig, policy_dir: str, step: int | None = None) -> float:
    """Load the new weights into the process's rollout engine (on a cluster: every engine
    actor, from the checkpoint or by a broadcast from trainer rank 0); returns seconds taken.
    ``step``: the step whose policy it is (it names the task run)."""
    t0 = time.perf_counter()
    runtime.engine_for(cfg, policy_dir)
    return time.perf_counter() - t0
