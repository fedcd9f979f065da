"""Learning phases: backup, predictor fit, tree advantages, policy update, weight sync."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from prefect import task

from tasks import runtime
from trace_core import advantages as adv
from trace_core.predictor import auc, brier
from trace_core.tree import backup as tree_backup
from trace_core.tree import root_to_leaf_paths
from trace_rl.config import TrainConfig
from trace_rl.policy.update import PathSample, PolicyTrainer, warmup_scale
from trace_rl.rollout.treeio import group_trees, parent_array, predictor_examples

def _trees(workdir: str, run_id: str, step: int) -> dict[int, list[dict[str, Any]]]:
    """The step's trees, each as rows in local-index order (= trace_core.tree arrays)."""
    return group_trees(runtime.store(workdir).read_step(run_id, step).to_pylist())


def _arrays(tree: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    parent = parent_array(pa.Table.from_pylist(tree))
    reward = np.array([np.nan if r["reward"] is None or not r["is_leaf"] else r["reward"]
                       for r in tree], dtype=np.float64)
    return parent, reward


@task(name="backup", cache_policy=runtime.PHASE_KEY)
def backup(workdir: str, run_id: str, step: int, cfg: TrainConfig | None = None) -> dict[str, float]:
    """V^ and n for every node (success rate of the leaves below), stored on the nodes."""
    ids, values, counts = [], [], []
    mixed = roots = 0
    for tree in _trees(workdir, run_id, step).values():
        parent, reward = _arrays(tree)
        value, n = tree_backup(parent, reward)
        ids += [r["node_id"] for r in tree]
        values += value.tolist()
        counts += n.tolist()
        roots += 1
        mixed += int(0.0 < value[0] < 1.0)
    runtime.store(workdir).update_values(run_id, step, pa.table({
        "node_id": ids, "value": pa.array(values, pa.float64()), "n_leaves": pa.array(counts, pa.int64())}))
    return {"tree/effective_ratio": mixed / roots if roots else 0.0, "tree/trees": float(roots)}


@task(name="fit-predictor", cache_policy=runtime.PHASE_KEY)
def fit_predictor(cfg: TrainConfig, workdir: str, run_id: str, step: int) -> dict[str, float]:
    """Regress V~(H_y) onto V^(y) (weights n_y) on this step's roots and prefixes; the metrics
    are those of the predictions made BEFORE the fit (what allocation actually used)."""
    histories, y, weights = predictor_examples(_trees(workdir, run_id, step).values())
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
def tree_advantages(cfg: TrainConfig, workdir: str, run_id: str, step: int) -> pa.Table:
    """Per root-to-leaf path: its node ids and the advantage of each turn (estimator from the
    config). Each node also stores the mean advantage over the paths through it."""
    estimator = adv.ESTIMATORS[cfg.advantage]
    leaf_ids, path_nodes, path_adv = [], [], []
    node_sum: dict[str, float] = defaultdict(float)
    node_cnt: dict[str, int] = defaultdict(int)
    for tree in _trees(workdir, run_id, step).values():
        parent, reward = _arrays(tree)
        if len(parent) < 2:
            continue
        a = estimator(parent, reward)  # [L, D]
        if cfg.centre_advantages:
            a = adv.centred(a)
        if cfg.count_turns_once:
            a = adv.per_node(parent, reward, a)
        paths = root_to_leaf_paths(parent)  # [L, D+1]
        for l in range(paths.shape[0]):
            nodes = [tree[i]["node_id"] for i in paths[l] if i >= 0]
            advs = [float(x) for x in a[l, : len(nodes) - 1]]
            leaf_ids.append(nodes[-1])
            path_nodes.append(nodes)
            path_adv.append(advs)
            for nid, x in zip(nodes[1:], advs):
                node_sum[nid] += x
                node_cnt[nid] += 1
    if node_sum:
        runtime.store(workdir).update_values(run_id, step, pa.table({
            "node_id": list(node_sum), "advantage": pa.array(
                [node_sum[k] / node_cnt[k] for k in node_sum], pa.float64())}))
    return pa.table({"leaf_id": leaf_ids, "path": path_nodes,
                     "advantages": pa.array(path_adv, pa.list_(pa.float64()))})


_LIVE: dict[str, PolicyTrainer] = {}


def _samples(workdir: str, run_id: str, step: int, paths: pa.Table) -> list[PathSample]:
    rows = {r["node_id"]: r for r in runtime.store(workdir).read_step(run_id, step).to_pylist()}
    out = []
    for nodes, advs in zip(paths.column("path").to_pylist(), paths.column("advantages").to_pylist()):
        root = rows[nodes[0]]
        ids, mask, a = list(root["obs_token_ids"]), [0] * len(root["obs_token_ids"]), [0.0] * len(root["obs_token_ids"])
        for nid, x in zip(nodes[1:], advs):
            r = rows[nid]
            ids += r["gen_token_ids"]
            mask += [1] * len(r["gen_token_ids"])
            a += [x] * len(r["gen_token_ids"])
            ids += r["obs_token_ids"]
            mask += [0] * len(r["obs_token_ids"])
            a += [0.0] * len(r["obs_token_ids"])
        out.append(PathSample(ids, mask, a, group=int(root["tree_id"])))
    return out


@task(name="policy-update", cache_policy=runtime.PHASE_KEY)
def policy_update(cfg: TrainConfig, workdir: str, run_id: str, step: int, policy_dir: str,
                  paths: pa.Table) -> dict[str, Any]:
    """Clipped tree-aware PG on every root-to-leaf path; saves the new policy checkpoint."""
    settings = cfg.update_settings
    out = runtime.Paths(Path(workdir)).policy_dir(run_id, step)
    lr_scale = warmup_scale(cfg.lr_warmup_steps, step)
    if cfg.cluster:  # the trainer ranks on Ray; rank 0 writes the checkpoint (docs/cluster.md)
        stats = runtime.cluster_for(cfg).update(settings, cfg.seed, policy_dir,
                                                _samples(workdir, run_id, step, paths),
                                                cfg.seed * 7919 + step, lr_scale, out)
        return {"policy_dir": str(out), "stats": {f"loss/{k}": v for k, v in stats.items()}}
    # The trainer stays in memory across steps of one process (keyed by the directory it last
    # saved), so the optimiser state is not reloaded each step; a resumed process reloads it.
    trainer = _LIVE.pop(policy_dir, None) or PolicyTrainer(policy_dir, settings, seed=cfg.seed)
    rng = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    stats = trainer.update(_samples(workdir, run_id, step, paths), rng, lr_scale=lr_scale)
    trainer.save(out)
    _LIVE[str(out)] = trainer
    return {"policy_dir": str(out), "stats": {f"loss/{k}": v for k, v in stats.items()}}


@task(name="sync-weights")
def sync_weights(cfg: TrainConfig, policy_dir: str) -> float:
    """Load the new weights into the process's rollout engine (on a cluster: every engine
    actor, from the checkpoint or by a broadcast from trainer rank 0); returns seconds taken."""
    t0 = time.perf_counter()
    runtime.engine_for(cfg, policy_dir)
    return time.perf_counter() - t0
