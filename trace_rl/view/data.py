"""What ``trace view`` shows, read from the tree store: runs, steps, and one step's trees with
their allocation, as plain JSON-ready dicts (``page_data``).

Every page is read on one read-only connection (``TreeStore.snapshot``), so its numbers come from
one published snapshot even while a run writes, and the connection is closed before the page is
sent: nothing is held between requests. The counts follow the definitions of the SQL views
(``subtree_stats``, ``mixed_anchors``, ``contrast_pairs``), computed on the step's rows only (the
views recurse over the whole store); the tests check them against ``trace sql``.

Per node the page gets the Stage 2 figures of docs/algorithm.md, rebuilt from what the store
keeps: p = V~(H) as the allocation used it (``allocations.predicted_v`` at level >= 1), the
observed outcome r of the bare rollout through the prefix (for the root: the shared outcome of its
bare rollouts), q = r p + (1 - r)(1 - p), the K continuations it was given and its score 1 - q^K
(the paper's objective term; the allocation itself may have used the rho-corrected q of
``trace_core.allocation``, whose rho is not stored per node).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import duckdb

from trace_rl.storage.store import DB_FILENAME, TreeStore

TEXT_LIMIT = 4000
"""Characters of a turn's text or observation kept in a page (the rest: ``trace sql``)."""

_NODE_COLUMNS = ("node_id, tree_id, local_index, parent_index, depth, level, item_id, family, "
                 "text, action_json, observation, tool_called, error, predicted_v, allocated_k, "
                 "reward, value, n_leaves, advantage, allocator, is_leaf, gen_tokens, obs_tokens")


class ViewError(ValueError):
    """Bad input to ``trace view`` (unknown run or step, no or unreadable database): one line
    naming what is wrong and where."""


def open_store(workdir: str | Path) -> TreeStore:
    """A reader of the work dir's published database (or of a ``.duckdb`` file), checked to be
    a readable TRACE store that holds at least one run."""
    path = Path(workdir)
    db = path if path.suffix in (".duckdb", ".db") else path / DB_FILENAME
    if not db.is_file():
        raise ViewError(f"no TRACE database at {db}: run `trace train` first or pass --workdir")
    store = TreeStore(db, create=False)
    try:
        with store.snapshot() as con:
            tables = {r[0] for r in con.execute(
                "SELECT table_name FROM information_schema.tables").fetchall()}
            missing = {"runs", "steps", "nodes", "allocations", "ledger"} - tables
            if missing:
                raise ViewError(f"{db} is not a TRACE database: it has no table(s) "
                                f"{', '.join(sorted(missing))}")
            if con.execute("SELECT count(*) FROM runs").fetchone()[0] == 0:
                raise ViewError(f"{db} holds no runs yet (empty store): run `trace train` first")
    except duckdb.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ViewError(f"{db} is not a readable DuckDB database ({first})") from exc
    return store


def page_data(store: TreeStore, run: str | None = None, step: int | None = None,
              all_steps: bool = False, mode: str = "server") -> dict[str, Any]:
    """Everything one page shows: the runs, the steps of ``run`` (default: the newest run) and
    the trees and allocation of ``step`` (default: its newest step with nodes), or of every step
    with ``all_steps`` (a self-contained file). Unknown run or step: ``ViewError``."""
    with store.snapshot() as con:
        runs = _runs(con)
        if not runs:
            raise ViewError(f"{store.path} holds no runs yet (empty store): run `trace train` first")
        if run is None:
            run = runs[-1]["run_id"]
        elif run not in {r["run_id"] for r in runs}:
            known = ", ".join(r["run_id"] for r in runs[-5:])
            raise ViewError(f"run {run!r} is not in {store.path} (runs: {known})")
        steps = _steps(con, run)
        with_nodes = [s["step"] for s in steps if s["nodes"]]
        if step is None:
            step = with_nodes[-1] if with_nodes else None
        elif step not in with_nodes:
            have = f"steps {_ranges(with_nodes)}" if with_nodes else "no step with nodes yet"
            raise ViewError(f"step {step} of run {run!r} has no stored trees in {store.path} "
                            f"({have})")
        shown = with_nodes if all_steps else ([] if step is None else [step])
        details = {str(s): step_detail(con, run, s) for s in shown}
    return {"db": str(store.path), "mode": mode, "run": run, "step": step, "runs": runs,
            "steps": steps, "details": details,
            "generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}


def _rows(con: duckdb.DuckDBPyConnection, sql: str, params: Iterable[Any] = ()) -> list[dict]:
    cur = con.execute(sql, list(params))
    names = [d[0] for d in cur.description]
    return [dict(zip(names, row)) for row in cur.fetchall()]


def _runs(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    rows = _rows(con, "SELECT run_id, status, created_at, config_json, mlflow_run_id, "
                      "(SELECT count(*) FROM steps s WHERE s.run_id = r.run_id) AS steps "
                      "FROM runs r ORDER BY created_at, run_id")
    out = []
    for r in rows:
        try:
            cfg = json.loads(r["config_json"] or "{}")
        except json.JSONDecodeError:
            cfg = {}
        out.append({"run_id": r["run_id"], "status": r["status"], "steps": r["steps"],
                    "created_at": str(r["created_at"])[:19], "family": cfg.get("family"),
                    "allocator": cfg.get("allocator"), "advantage": cfg.get("advantage"),
                    "planned_steps": cfg.get("steps", "?"), "mlflow_run_id": r["mlflow_run_id"]})
    return out


RUN_PROGRESS = """
SELECT r.run_id,
       (SELECT count(*) FROM steps s WHERE s.run_id = r.run_id AND s.status = 'complete') AS done,
       (SELECT s.metrics_json FROM steps s WHERE s.run_id = r.run_id AND s.status = 'complete'
        ORDER BY s.step DESC LIMIT 1) AS last_metrics,
       (SELECT sum(l.generated_tokens) FROM ledger l WHERE l.run_id = r.run_id) AS tokens,
       (SELECT e.accuracy FROM evals e WHERE e.run_id = r.run_id ORDER BY e.step LIMIT 1) AS before,
       (SELECT e.accuracy FROM evals e WHERE e.run_id = r.run_id AND e.step > 0
        ORDER BY e.step DESC LIMIT 1) AS after
FROM runs r
"""


def run_table(store: TreeStore) -> list[dict[str, Any]]:
    """The page's runs (``_runs``, oldest first) with how far each got (``trace runs``): complete
    steps of its configured steps, the newest complete step's mean reward, generated tokens, and
    held-out accuracy before training and after (None where not measured)."""
    with store.snapshot() as con:
        runs = _runs(con)
        progress = {r["run_id"]: r for r in _rows(con, RUN_PROGRESS)}
    out = []
    for run in runs:
        p = progress[run["run_id"]]
        last = json.loads(p["last_metrics"] or "{}")
        out.append({"run_id": run["run_id"], "status": run["status"], "family": run["family"],
                    "allocator": run["allocator"], "steps": f"{p['done']}/{run['planned_steps']}",
                    "reward": last.get("rollout/reward_mean"), "tokens": int(p["tokens"] or 0),
                    "before": p["before"], "after": p["after"], "created_at": run["created_at"]})
    return out


def _steps(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]]:
    marked = {r["step"]: r for r in _rows(
        con, "SELECT step, status, metrics_json FROM steps WHERE run_id = ?", [run_id])}
    counted = {r["step"]: r for r in _rows(
        con, "SELECT step, count(*) AS nodes, count(*) FILTER (WHERE is_leaf) AS leaves, "
             "count(DISTINCT tree_id) AS trees, avg(reward) FILTER (WHERE is_leaf) AS reward "
             "FROM nodes WHERE run_id = ? GROUP BY step", [run_id])}
    out = []
    for s in sorted(set(marked) | set(counted)):
        m = json.loads((marked.get(s) or {}).get("metrics_json") or "{}")
        c = counted.get(s, {})
        out.append({"step": s, "status": (marked.get(s) or {}).get("status", "unmarked"),
                    "nodes": int(c.get("nodes") or 0), "leaves": int(c.get("leaves") or 0),
                    "trees": int(c.get("trees") or 0), "reward": c.get("reward"),
                    "effective_ratio": m.get("tree/effective_ratio"),
                    "contrast_pairs_per_100_leaves": m.get("tree/contrast_pairs_per_100_leaves")})
    return out


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= TEXT_LIMIT:
        return text
    return text[:TEXT_LIMIT] + f"\n[... {len(text) - TEXT_LIMIT} more characters: trace sql]"


def _num(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def step_detail(con: duckdb.DuckDBPyConnection, run_id: str, step: int) -> dict[str, Any]:
    """One step: its trees (nodes with their allocation figures), the per-prompt allocation,
    leaves per level, the ledger and the counts of the SQL views."""
    q = [run_id, step]
    nodes = _rows(con, f"SELECT {_NODE_COLUMNS} FROM nodes WHERE run_id = ? AND step = ? "
                       "ORDER BY tree_id, local_index", q)
    allocs = _rows(con, "SELECT level, node_id, allocator, item_id, predicted_v, true_v, k, gain "
                        "FROM allocations WHERE run_id = ? AND step = ? ORDER BY level, node_id", q)
    ledger = _rows(con, "SELECT level, method, trajectories, prompt_tokens, generated_tokens, "
                        "tool_calls, wall_seconds FROM ledger WHERE run_id = ? AND step = ? "
                        "ORDER BY level, method", q)
    status = con.execute("SELECT status FROM steps WHERE run_id = ? AND step = ?", q).fetchone()

    roots_alloc, prefix_alloc = _allocations(allocs)
    trees: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for n in nodes:
        trees[n["tree_id"]].append(n)
    below = {r["node_id"]: r for rows in trees.values() for r in _leaf_stats(rows)}
    mixed = {k for k, b in below.items() if not b["leaf"] and b["min"] < b["max"]}
    pairs = _contrast_pairs(nodes, below)
    paired = defaultdict(set)
    for better, worse in pairs:
        paired[better].add(worse)
        paired[worse].add(better)
    out_trees = []
    for tree_id, rows in trees.items():
        out_trees.append(_tree(tree_id, rows, prefix_alloc, roots_alloc, mixed, paired, below))

    prompts = _prompts(roots_alloc, out_trees)
    per_level: dict[int, int] = defaultdict(int)
    for n in nodes:
        if n["is_leaf"]:
            per_level[n["level"]] += 1
    root_mixed = sum(1 for t in out_trees if t["mixed"])
    return {
        "step": step, "status": status[0] if status else "unmarked", "trees": out_trees,
        "prompts": prompts, "leaves_per_level": [{"level": lv, "leaves": c}
                                                 for lv, c in sorted(per_level.items())],
        "ledger": ledger,
        "counts": {"nodes": len(nodes), "leaves": sum(1 for n in nodes if n["is_leaf"]),
                   "trees": len(out_trees), "mixed_roots": root_mixed,
                   "effective_ratio": root_mixed / len(out_trees) if out_trees else None,
                   "mixed_anchors": len(mixed), "contrast_pairs": len(pairs),
                   "branch_points": sum(1 for a in prefix_alloc.values() if a["k"] > 0),
                   "root_budget": sum(a["k"] for a in roots_alloc.values())},
    }


def _allocations(allocs: list[dict[str, Any]]) -> tuple[dict[str, dict], dict[str, dict]]:
    """The step's allocation rows summed per node (a prompt refilled in a later wave has several):
    (roots, prefixes), each node id -> k, p, gain, true_v, item_id."""
    roots_alloc: dict[str, dict[str, Any]] = {}
    prefix_alloc: dict[str, dict[str, Any]] = {}
    for a in allocs:
        table = roots_alloc if a["level"] == 0 else prefix_alloc
        seen = table.setdefault(a["node_id"], {"k": 0, "p": a["predicted_v"], "gain": None,
                                               "true_v": a["true_v"], "item_id": a["item_id"]})
        seen["k"] += int(a["k"] or 0)
        if a["gain"] is not None:
            seen["gain"] = a["gain"]
    return roots_alloc, prefix_alloc


def _prompts(roots_alloc: dict[str, dict], out_trees: list[dict[str, Any]]) -> list[dict]:
    """One row per candidate prompt of Stage 1 (m = 0 included) with its tree's outcome."""
    prompts = []
    tree_of_root = {t["root_id"]: t for t in out_trees}
    for node_id, a in roots_alloc.items():
        t = tree_of_root.get(node_id)
        prompts.append({"node_id": node_id, "item_id": a["item_id"], "v": _num(a["p"]),
                        "m": a["k"], "tree_id": None if t is None else t["tree_id"],
                        "success": None if t is None else t["success"],
                        "leaves": 0 if t is None else t["leaves"],
                        "mixed": bool(t and t["mixed"])})
    for t in out_trees:  # trees without a stored root allocation (older runs)
        if t["root_id"] not in roots_alloc:
            prompts.append({"node_id": t["root_id"], "item_id": t["item_id"], "v": t["v"],
                            "m": t["m"], "tree_id": t["tree_id"], "success": t["success"],
                            "leaves": t["leaves"], "mixed": t["mixed"]})
    return prompts


def _tree(tree_id: int, rows: list[dict[str, Any]], prefix_alloc: dict, roots_alloc: dict,
          mixed: set[str], paired: dict[str, set[str]], below: dict[str, dict]) -> dict[str, Any]:
    """One tree: nodes in slot order with what the page draws at each."""
    by_slot = {r["local_index"]: r for r in rows}
    children: dict[int, list[int]] = defaultdict(list)
    for r in rows:
        if r["parent_index"] >= 0:
            children[r["parent_index"]].append(r["local_index"])
    root = by_slot.get(0, rows[0])

    def observed(slot: int) -> float | None:
        """Outcome of the rollout through a prefix, as Stage 2 saw it."""
        node = by_slot[slot]
        if node["depth"] == 0:  # the root: the shared outcome of its bare rollouts, if shared
            bare = {r["reward"] for r in rows if r["is_leaf"] and r["level"] == node["level"]}
            return bare.pop() if len(bare) == 1 else None
        while not node["is_leaf"]:
            same = [c for c in children.get(node["local_index"], [])
                    if by_slot[c]["level"] == by_slot[slot]["level"]]
            if not same:
                return None
            node = by_slot[same[0]]
        return node["reward"]

    out_nodes = []
    for r in rows:
        a = prefix_alloc.get(r["node_id"])
        obs = observed(r["local_index"]) if a is not None else None
        out_nodes.append(_node(r, a, obs, below.get(r["node_id"], {}), mixed, paired))
    leaves = [r for r in rows if r["is_leaf"]]
    rewards = [r["reward"] for r in leaves if r["reward"] is not None]
    ra = roots_alloc.get(root["node_id"], {})
    return {"tree_id": tree_id, "root_id": root["node_id"], "item_id": root["item_id"],
            "family": root["family"], "allocator": root["allocator"],
            "v": _num(root["predicted_v"]),
            "m": ra.get("k", root["allocated_k"]),
            "leaves": len(leaves), "success": sum(rewards) / len(rewards) if rewards else None,
            "mixed": root["node_id"] in mixed, "nodes": out_nodes,
            "branch_points": sum(1 for n in out_nodes if n["k"]),
            "mixed_branch_points": sum(1 for n in out_nodes if n["k"] and n["mixed"])}


def _node(r: dict[str, Any], a: dict | None, obs: float | None, b: dict, mixed: set[str],
          paired: dict[str, set[str]]) -> dict[str, Any]:
    """What the page draws at one node: its row, Stage 2's K, p, observed outcome, q and
    1 - q^K where it was a branch point, and its marks."""
    nid = r["node_id"]
    k = p = q = score = None
    if a is not None:
        k, p = a["k"], _num(a["p"])
        if p is not None and obs is not None:
            q = obs * p + (1 - obs) * (1 - p)
            score = 1 - q ** k if k else 0.0
    value = _num(r["value"]) if r["value"] is not None else _num(b.get("mean"))
    action = None
    if r["action_json"]:
        try:
            action = json.loads(r["action_json"])
        except json.JSONDecodeError:
            action = r["action_json"]
    return {
        "id": nid, "slot": r["local_index"], "parent": r["parent_index"], "depth": r["depth"],
        "level": r["level"], "leaf": bool(r["is_leaf"]), "reward": _num(r["reward"]),
        "value": value, "n": r["n_leaves"] if r["n_leaves"] is not None else b.get("leaves"),
        "v": _num(r["predicted_v"]), "adv": _num(r["advantage"]),
        "text": _clip(r["text"]), "action": action, "obs": _clip(r["observation"]),
        "tool": bool(r["tool_called"]), "error": bool(r["error"]),
        "gen_tokens": r["gen_tokens"], "obs_tokens": r["obs_tokens"],
        "k": k, "p": p, "observed": _num(obs), "q": q, "score": score,
        "gain": _num(a["gain"]) if a else None, "true_v": _num(a["true_v"]) if a else None,
        "mixed": nid in mixed, "contrast": sorted(paired.get(nid, ())),
    }


def _leaf_stats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per node of one tree, from the leaves below it (the ``subtree_stats`` view, restricted to
    the tree): leaves, mean, min and max reward; nodes with no leaf below yet are left out."""
    parent = {r["local_index"]: r["parent_index"] for r in rows}
    ids = {r["local_index"]: r["node_id"] for r in rows}
    got: dict[int, list[float]] = defaultdict(list)
    for r in rows:
        if r["is_leaf"] and r["reward"] is not None:
            slot = r["local_index"]
            while slot in ids:
                got[slot].append(float(r["reward"]))
                slot = parent[slot]
    leafy = {r["local_index"]: bool(r["is_leaf"]) for r in rows}
    return [{"node_id": ids[k], "leaf": leafy[k], "leaves": len(v), "mean": sum(v) / len(v),
             "min": min(v), "max": max(v)} for k, v in got.items()]


def _contrast_pairs(nodes: list[dict[str, Any]], below: dict[str, dict]) -> list[tuple[str, str]]:
    """(better, worse) sibling pairs whose leaf success rates differ (the ``contrast_pairs``
    view): every unordered pair with different rates once, better first."""
    kids: dict[tuple[int, int], list[str]] = defaultdict(list)
    for n in nodes:
        if n["parent_index"] >= 0 and n["node_id"] in below:
            kids[n["tree_id"], n["parent_index"]].append(n["node_id"])
    out = []
    for sibs in kids.values():
        for a in sibs:
            for b in sibs:
                if below[a]["mean"] > below[b]["mean"]:
                    out.append((a, b))
    return out


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            parts.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(parts)
