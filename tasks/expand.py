"""Expansion phases: roll out a tree level on the engine (rewards come from the verifier as each
episode ends, where the environment state a stateful verifier needs still lives) and persist it
in one DuckDB transaction, in the same task (a retry re-runs both: the write is idempotent)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
from prefect import task

from tasks import runtime
from tasks.runtime import StepRef
from trace_core.allocators import Allocator
from trace_core.seeds import oracle_seed, rollout_seed
from trace_core.waves import outcome_counts
from trace_rl.config import TrainConfig
from trace_rl.engines import context_limit
from trace_rl.rollout.react import Start, run_episodes
from trace_rl.rollout.treeio import LevelBatch, StepTrees
from trace_rl.rollout.types import Ledger, SamplingSettings


def _sampling(cfg: TrainConfig) -> SamplingSettings:
    return SamplingSettings(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)


def _rollout(cfg: TrainConfig, at: StepRef, policy_dir: str, starts: list[Start],
             seed: int) -> tuple[list, Ledger]:
    engine = runtime.engine_for(cfg.engine, cfg.cluster_section, at.run_id, policy_dir)
    t0 = time.perf_counter()
    episodes = run_episodes(engine, runtime.env_for(cfg), starts, sampling=_sampling(cfg),
                            max_turns=cfg.max_turns, tool_timeout_s=cfg.tool_timeout_s,
                            seed=seed, max_context=context_limit(policy_dir))
    total = Ledger()
    for ep in episodes:
        total += ep.ledger
    total.wall_seconds = time.perf_counter() - t0  # episodes run concurrently: wall time, not a sum
    return episodes, total


def _ledger_dict(method: str, ledger: Ledger) -> dict[str, Any]:
    return {"method": method, "trajectories": ledger.trajectories,
            "prompt_tokens": ledger.prompt_tokens, "generated_tokens": ledger.generated_tokens,
            "tool_calls": ledger.tool_calls, "wall_seconds": ledger.wall_seconds}


def _allocations(cfg: TrainConfig, tree_id: list[int], local_index: list[int], k: list[int],
                 item_id: list[str], predicted_v: list[float | None]) -> pa.Table:
    """One level's allocation decisions (tree, slot, k, item, prediction), as columns."""
    return pa.table({"tree_id": pa.array(tree_id, pa.int64()),
                     "local_index": pa.array(local_index, pa.int64()),
                     "allocator": pa.array([cfg.allocator] * len(k), pa.string()),
                     "k": pa.array(k, pa.int64()), "item_id": pa.array(item_id, pa.string()),
                     "predicted_v": pa.array(predicted_v, pa.float64())})


def roots_level(cfg: TrainConfig, at: StepRef, policy_dir: str, allocation: pa.Table,
                wave: int = 0) -> dict[str, Any]:
    """Bare rollouts: m_i complete episodes for every candidate with m_i > 0 (one tree each),
    as the level's nodes, allocation decisions and ledger. Trees of level-0 wave ``wave``
    (refills, fresh prompts) are numbered after the earlier waves' trees."""
    tree_offset = wave * cfg.pool_size
    items = runtime.items_for(cfg, cfg.train_split)
    item_id = allocation.column("item_id").to_pylist()
    m = allocation.column("m").to_pylist()
    predicted = allocation.column("predicted_v").to_pylist()
    active = [t for t in range(len(m)) if m[t] > 0]
    starts = [Start(items[item_id[t]], (), int(m[t])) for t in active]
    episodes, ledger = _rollout(cfg, at, policy_dir, starts,
                                seed=rollout_seed(cfg.seed, at.step, 0, wave))
    batch = LevelBatch(cfg.family, cfg.allocator)
    pos = 0
    for t in active:
        eps = episodes[pos:pos + m[t]]
        pos += m[t]
        batch.open_tree(tree_offset + t, item_id[t])
        batch.add_root(tree_offset + t, eps[0].prompt_ids, items[item_id[t]].question,
                       predicted[t], int(m[t]))
        for ep in eps:
            batch.add_episode(tree_offset + t, 0, 0, ep)
    # Wave 0 stores the filtered candidates too (k = 0): the whole Stage 1 decision is stored.
    decided = active + ([t for t in range(len(m)) if m[t] <= 0] if wave == 0 else [])
    allocs = _allocations(cfg, [tree_offset + t for t in decided],
                          [0] * len(decided), [max(int(m[t]), 0) for t in decided],
                          [item_id[t] for t in decided], [predicted[t] for t in decided])
    # The ledger is keyed by (run, step, level, method): a refill wave is its own row.
    method = cfg.allocator if wave == 0 else f"{cfg.allocator}:refill{wave}"
    return {"nodes": batch.table(), "allocations": allocs, "ledger": _ledger_dict(method, ledger)}


@task(name="expand-roots", cache_policy=runtime.PHASE_KEY, retries=1)
def expand_roots(cfg: TrainConfig, at: StepRef, policy_dir: str, allocation: pa.Table,
                 wave: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Level 0, one wave: the bare rollouts of ``allocation`` (``roots_level``), persisted;
    returns ([P] rollouts, [P] mixed) per candidate (``trace_core.waves.outcome_counts``)."""
    level = roots_level(cfg, at, policy_dir, allocation, wave)
    persist(at, 0, level, wave)
    nodes = level["nodes"]
    return outcome_counts(nodes.column("tree_id").to_numpy(), nodes.column("reward").to_numpy(),
                          nodes.column("is_leaf").to_numpy(), len(allocation),
                          wave * cfg.pool_size)


def _measured(cfg: TrainConfig, at: StepRef, policy_dir: str, starts: list[Start],
              seed: int) -> pa.Table:
    """The Monte-Carlo oracle's measurement (``TrainConfig.oracle_rollouts``): the ``k`` episodes
    of each start, sampled with ``seed``; per start its ``successes`` (summed rewards) of
    ``rollouts`` and their ``generated_tokens``. A diagnostic, outside the step's budget: the
    episodes are neither persisted (no tree node, no ledger row) nor trained on."""
    episodes, _ = _rollout(cfg, at, policy_dir, starts, seed=seed)
    shape = (len(starts), cfg.oracle_rollouts)
    reward = np.asarray([ep.reward or 0.0 for ep in episodes], np.float64).reshape(shape)
    tokens = np.asarray([ep.ledger.generated_tokens for ep in episodes], np.int64).reshape(shape)
    return pa.table({"successes": reward.sum(axis=1),
                     "rollouts": pa.array([cfg.oracle_rollouts] * len(starts), pa.int64()),
                     "generated_tokens": tokens.sum(axis=1)})


@task(name="measure-roots", cache_policy=runtime.PHASE_KEY, retries=1)
def measure_roots(cfg: TrainConfig, at: StepRef, policy_dir: str, item_ids: list[str]) -> pa.Table:
    """Stage 1's Monte-Carlo oracle: k episodes of the current policy from each candidate of
    ``item_ids`` with the step's Stage 1 oracle seed (``trace_core.seeds.oracle_seed``),
    measured (``_measured``) with the candidate's ``item_id``."""
    items = runtime.items_for(cfg, cfg.train_split)
    measured = _measured(cfg, at, policy_dir,
                         [Start(items[i], (), cfg.oracle_rollouts) for i in item_ids],
                         oracle_seed(cfg.seed, at.step, 1))
    return measured.add_column(0, "item_id", pa.array(item_ids, pa.string()))


@task(name="measure-prefixes", cache_policy=runtime.PHASE_KEY, retries=1)
def measure_prefixes(cfg: TrainConfig, allocator: Allocator, at: StepRef, policy_dir: str,
                     trees: StepTrees | None = None) -> pa.Table:
    """Stage 2's Monte-Carlo oracle: k continuations of the current policy from each of the
    step's Stage 2 candidates (``TreeBatch.candidates``, in ``score_prefixes``' order) with the
    step's Stage 2 oracle seed, measured (``_measured``). ``trees``: the step's level-0 trees
    as the flow read them."""
    items, trees = runtime.items_for(cfg, cfg.train_split), runtime.step_trees(at, trees)
    rows, _ = trees.batch.candidates(allocator.branches_from_root)
    item = trees.column("item_id")
    starts = [Start(items[item[r]], tuple(trees.turns(int(r))), cfg.oracle_rollouts) for r in rows]
    return _measured(cfg, at, policy_dir, starts, oracle_seed(cfg.seed, at.step, 2))


def prefixes_level(cfg: TrainConfig, at: StepRef, policy_dir: str, chosen: pa.Table,
                   trees: StepTrees | None = None) -> dict[str, Any]:
    """Continuations: K_ijt episodes from each chosen stored prefix, appended to its tree, as
    the level's nodes, allocation decisions and ledger. ``trees``: the step's stored trees as
    the flow read them (else read here)."""
    items = runtime.items_for(cfg, cfg.train_split)
    trees = runtime.step_trees(at, trees)
    tree_id = chosen.column("tree_id").to_numpy()
    local = chosen.column("local_index").to_numpy()
    depth = chosen.column("depth").to_numpy()
    k = chosen.column("k").to_numpy()
    item_id = chosen.column("item_id").to_pylist()
    picks = np.flatnonzero(k > 0)
    position = trees.positions(tree_id[picks])  # each pick's tree among the step's
    starts = [Start(items[item_id[p]], tuple(trees.turns(int(trees.offsets[t] + local[p]))),
                    int(k[p])) for p, t in zip(picks, position)]
    episodes, ledger = _rollout(cfg, at, policy_dir, starts, seed=rollout_seed(cfg.seed, at.step, 1))
    batch = LevelBatch(cfg.family, cfg.allocator)
    for p in np.unique(position):  # trees continue after their stored rows
        rows = trees.rows(int(p))
        batch.open_tree(int(trees.tree_ids[p]), trees.column("item_id")[rows[0]], len(rows))
    pos = 0
    for p in picks:
        for ep in episodes[pos:pos + k[p]]:
            batch.add_episode(int(tree_id[p]), int(local[p]), int(depth[p]), ep)
        pos += int(k[p])
    allocs = _allocations(cfg, tree_id.tolist(), local.tolist(), k.astype(int).tolist(), item_id,
                          chosen.column("predicted_v").to_pylist())
    return {"nodes": batch.table(), "allocations": allocs,
            "ledger": _ledger_dict(cfg.allocator, ledger)}


@task(name="expand-prefixes", cache_policy=runtime.PHASE_KEY, retries=1)
def expand_prefixes(cfg: TrainConfig, at: StepRef, policy_dir: str, chosen: pa.Table,
                    trees: StepTrees | None = None) -> int:
    """Level 1: the continuations of ``chosen`` (``prefixes_level``), persisted; returns the
    nodes stored."""
    return persist(at, 1, prefixes_level(cfg, at, policy_dir, chosen, trees))


def persist(at: StepRef, level: int, expansion: dict[str, Any], wave: int = 0) -> int:
    """Write the level's nodes, allocation decisions and ledger in ONE transaction; idempotent
    (deterministic node ids), so a retry after a crash leaves exactly one copy."""
    allocs = expansion["allocations"]
    alloc_table = None
    if allocs.num_rows:
        node_ids = [runtime.node_id(at.run_id, at.step, t, i) for t, i in
                    zip(allocs.column("tree_id").to_pylist(), allocs.column("local_index").to_pylist())]
        alloc_table = allocs.drop_columns(["tree_id", "local_index"]).add_column(
            0, "node_id", pa.array(node_ids, pa.string()))
    result = runtime.store(at.workdir).write_level(at.run_id, at.step, level, expansion["nodes"],
                                                   allocations=alloc_table,
                                                   ledger=expansion["ledger"])
    return result.inserted_nodes
