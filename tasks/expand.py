"""Expansion phases: roll out a tree level on the engine (rewards come from the verifier as each
episode ends, where the environment state a stateful verifier needs still lives), then persist it
in one DuckDB transaction."""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa
from prefect import task

from tasks import runtime
from trace_rl.config import TrainConfig
from trace_rl.rollout.react import Start, run_episodes
from trace_rl.rollout.treeio import TreeRows, prefix_rows, to_table, turns_from_rows
from trace_rl.rollout.types import Ledger, SamplingSettings


def _sampling(cfg: TrainConfig) -> SamplingSettings:
    return SamplingSettings(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed)


def _rollout(cfg: TrainConfig, policy_dir: str, starts: list[Start], seed: int) -> tuple[list, Ledger]:
    engine = runtime.engine_for(cfg, policy_dir)
    t0 = time.perf_counter()
    episodes = run_episodes(engine, runtime.env_for(cfg), starts, sampling=_sampling(cfg),
                            max_turns=cfg.max_turns, tool_timeout_s=cfg.tool_timeout_s, seed=seed,
                            max_context=runtime.context_for(cfg, policy_dir))
    total = Ledger()
    for ep in episodes:
        total += ep.ledger
    total.wall_seconds = time.perf_counter() - t0  # episodes run concurrently: wall time, not a sum
    return episodes, total


def _ledger_dict(method: str, ledger: Ledger) -> dict[str, Any]:
    return {"method": method, "trajectories": ledger.trajectories,
            "prompt_tokens": ledger.prompt_tokens, "generated_tokens": ledger.generated_tokens,
            "tool_calls": ledger.tool_calls, "wall_seconds": ledger.wall_seconds}


@task(name="expand-roots", cache_policy=runtime.PHASE_KEY, retries=1)
def expand_roots(cfg: TrainConfig, run_id: str, step: int, level: int, policy_dir: str,
                 allocation: pa.Table, wave: int = 0) -> dict[str, Any]:
    """Bare rollouts: m_i complete episodes for every candidate with m_i > 0 (one tree each).
    Trees of refill wave ``wave`` (DAPO) are numbered after the earlier waves' trees."""
    tree_offset = wave * cfg.pool_size
    items = runtime.items_for(cfg, cfg.train_split)
    rows_ = allocation.to_pylist()
    active = [(t, r) for t, r in enumerate(rows_) if r["m"] > 0]
    starts = [Start(items[r["item_id"]], (), int(r["m"])) for _, r in active]
    episodes, ledger = _rollout(cfg, policy_dir, starts,
                                seed=cfg.seed * 100_003 + step * 17 + level + 7919 * wave)
    fmt_rows: list[dict[str, Any]] = []
    allocs: list[dict[str, Any]] = []
    pos = 0
    for t, r in active:
        tree = TreeRows(tree_id=tree_offset + t, item_id=r["item_id"], family=cfg.family,
                        allocator=cfg.allocator, rows=[])
        eps = episodes[pos:pos + r["m"]]
        pos += r["m"]
        tree.add_root(eps[0].prompt_ids, items[r["item_id"]].question, r["predicted_v"], int(r["m"]))
        for ep in eps:
            tree.add_episode(0, 0, ep)
        fmt_rows += tree.rows
        allocs.append({"tree_id": tree_offset + t, "local_index": 0, "allocator": cfg.allocator,
                       "k": int(r["m"]), "item_id": r["item_id"], "predicted_v": r["predicted_v"]})
    if wave == 0:  # the filtered candidates too (k = 0): the whole Stage 1 decision is stored
        allocs += [{"tree_id": t, "local_index": 0, "allocator": cfg.allocator, "k": 0,
                    "item_id": r["item_id"], "predicted_v": r["predicted_v"]}
                   for t, r in enumerate(rows_) if r["m"] <= 0]
    # The ledger is keyed by (run, step, level, method): a refill wave is its own row.
    method = cfg.allocator if wave == 0 else f"{cfg.allocator}:refill{wave}"
    return {"nodes": to_table(fmt_rows), "allocations": allocs, "ledger": _ledger_dict(method, ledger)}


@task(name="expand-prefixes", cache_policy=runtime.PHASE_KEY, retries=1)
def expand_prefixes(cfg: TrainConfig, workdir: str, run_id: str, step: int, level: int,
                    policy_dir: str, chosen: pa.Table) -> dict[str, Any]:
    """Continuations: K_ijt episodes from each chosen stored prefix, appended to its tree."""
    items = runtime.items_for(cfg, cfg.train_split)
    store = runtime.store(workdir)
    picks = [r for r in chosen.to_pylist() if r["k"] > 0]
    trees = {t: store.read_tree(run_id, step, t).to_pylist() for t in sorted({r["tree_id"] for r in picks})}
    starts = []
    for r in picks:
        prefix = turns_from_rows(prefix_rows(trees[r["tree_id"]], r["local_index"]))
        starts.append(Start(items[r["item_id"]], tuple(prefix), int(r["k"])))
    episodes, ledger = _rollout(cfg, policy_dir, starts, seed=cfg.seed * 100_003 + step * 17 + level)
    builders = {t: TreeRows(tree_id=t, item_id=rows[0]["item_id"], family=cfg.family,
                            allocator=cfg.allocator, rows=[], first_index=len(rows))
                for t, rows in trees.items()}
    pos = 0
    for r in picks:
        for ep in episodes[pos:pos + r["k"]]:
            builders[r["tree_id"]].add_episode(r["local_index"], r["depth"], ep)
        pos += r["k"]
    allocs = [{"tree_id": r["tree_id"], "local_index": r["local_index"], "allocator": cfg.allocator,
               "k": int(r["k"]), "item_id": r["item_id"], "predicted_v": r["predicted_v"]}
              for r in chosen.to_pylist()]
    rows_out = [row for b in builders.values() for row in b.rows]
    return {"nodes": to_table(rows_out), "allocations": allocs,
            "ledger": _ledger_dict(cfg.allocator, ledger)}


@task(name="persist-level", cache_policy=runtime.PHASE_KEY, retries=2, retry_delay_seconds=2)
def persist_level(workdir: str, run_id: str, step: int, level: int, expansion: dict[str, Any],
                  wave: int = 0) -> int:
    """Write the level's nodes, allocation decisions and ledger in ONE transaction; idempotent
    (deterministic node ids), so a retry after a crash leaves exactly one copy. ``wave`` tells
    DAPO's refill waves of level 0 apart (part of the cache key)."""
    allocs = expansion["allocations"]
    alloc_table = None
    if allocs:
        alloc_table = pa.table({
            "node_id": [runtime.node_id(run_id, step, a["tree_id"], a["local_index"]) for a in allocs],
            "allocator": [a["allocator"] for a in allocs],
            "k": pa.array([a["k"] for a in allocs], pa.int64()),
            "item_id": [a["item_id"] for a in allocs],
            "predicted_v": pa.array([a["predicted_v"] for a in allocs], pa.float64()),
        })
    result = runtime.store(workdir).write_level(run_id, step, level, expansion["nodes"],
                                                allocations=alloc_table, ledger=expansion["ledger"])
    return result.inserted_nodes
