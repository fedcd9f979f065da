"""DuckDB store for rollout trees: one file per work dir, one transaction per tree level.

The nodes table is trace_core's struct-of-arrays tree (docs/schema.md) flattened into rows; the
columns hold what §1 needs per node H: predicted V~(H), allocated K, reward r at leaves, the
backed-up V^(H) = sum_c n_c V^(c) / n_H, the leaf count n_H and the advantage.

Idempotence. Node ids are deterministic (``make_node_id``) and a level is written per tree in one
transaction: if a tree already has rows at a level, the new rows for that tree and level are
skipped as a whole, so a retried task leaves exactly one copy and never mixes two samplings of
the same branch. Allocations and ledger rows are keyed too (first write wins).

Readers never block the writer: the writer works on a private file and publishes a copy for
readers after its transactions, and reads are locked down to one SELECT on a read-only connection
(the protocol, and why a published copy rather than per-level Parquet files:
``trace_rl.storage.published``). Input is checked and staged column-wise before a transaction
opens (``trace_rl.storage.staging``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from trace_rl.storage.published import (DB_FILENAME, PUBLISH_SHARE, READ_CONFIG,  # noqa: F401
                                        PublishedDatabase, StoreBusyError, StoreError, _exec)
from trace_rl.storage.schema import SCHEMA_VERSION, TABLES_DDL, VIEWS_DDL
from trace_rl.storage.staging import (ALLOCATION_COLUMNS, NODE_COLUMNS, ledger_row,
                                      stage_allocations, stage_nodes, stage_updates)
from trace_rl.storage.staging import utc_now as _now

STEP_STATUSES = ("running", "complete", "failed")
RUN_STATUSES = ("running", "complete", "failed", "killed")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def make_node_id(run_id: str, step: int, tree_id: int, local_index: int) -> str:
    """Deterministic, readable node id: ``<run_id>/s<step>/t<tree_id>/n<local_index>``.

    ``tree_id`` is the tree's index in the step's candidate pool and ``local_index`` its slot in
    the tree arrays (root = 0), so a retried task that rebuilds the same tree gets the same ids.
    """
    _check_run_id(run_id)
    for name, v in (("step", step), ("tree_id", tree_id), ("local_index", local_index)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise StoreError(f"make_node_id: {name} must be a non-negative int, got {v!r}")
    return f"{run_id}/s{step}/t{tree_id}/n{local_index}"


def _check_run_id(run_id: str) -> None:
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise StoreError(f"run_id {run_id!r} must match {_RUN_ID.pattern} (letters, digits, _ . -)")


@dataclass(frozen=True)
class WriteResult:
    """What one write_level call did."""

    inserted_nodes: int
    """Node rows added by this call."""
    skipped_trees: tuple[int, ...]
    """Tree ids whose rows at this level were already stored (a retry); their new rows were dropped."""
    inserted_allocations: int
    """Allocation rows added (rows already stored are kept as they were)."""
    ledger_written: bool
    """False when a ledger row for (run, step, level, method) already existed."""


class TreeStore(PublishedDatabase):
    """The tree store of one work dir. Every method opens and closes its own connection.

    ``path`` is the work dir (the file is ``<path>/trace.duckdb``) or a ``.duckdb`` / ``.db`` file:
    the published file that readers open. ``create=True`` (the default) makes a writer: it works
    on the private file next to it (``.trace.writer.duckdb``), creating the schema if needed, and
    publishes ``path`` after its writes (at once, or shortly after: ``_publish_due``; ``flush``
    publishes now). A work dir written before the private file existed is
    adopted: its ``trace.duckdb`` becomes the private file's starting point.

    ``create=False`` makes a reader (e.g. ``trace sql``): it reads the published file, as of the
    writer's last publish (a writer of the same process flushes first); nothing is written and a
    missing file is an error.
    """

    def __init__(self, path: str | Path, *, create: bool = True, read_timeout_s: float = 30.0,
                 write_timeout_s: float = 120.0):
        super().__init__(path, create=create, read_timeout_s=read_timeout_s,
                         write_timeout_s=write_timeout_s)
        if create:
            with self._connect(read_only=False) as con:
                _exec(con, TABLES_DDL)
                _exec(con, VIEWS_DDL)
                _exec(con, "INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                      [str(SCHEMA_VERSION)])

    # ---------------------------------------------------------------- runs and steps

    def init_run(self, run_id: str, config: Mapping[str, Any], *, mlflow_run_id: str | None = None,
                 prefect_flow_run_id: str | None = None) -> bool:
        """Register a run; True if it was new. A known run keeps its config and is set running."""
        _check_run_id(run_id)
        config_json = json.dumps(dict(config), sort_keys=True, default=str)
        with self._transaction() as con:
            known = con.execute("SELECT 1 FROM runs WHERE run_id = ?", [run_id]).fetchone()
            if known is None:
                _exec(con, "INSERT INTO runs VALUES (?, ?, ?, 'running', ?, ?)",
                            [run_id, _now(), config_json, mlflow_run_id, prefect_flow_run_id])
            else:
                _exec(con, "UPDATE runs SET status = 'running', "
                            "mlflow_run_id = coalesce(?, mlflow_run_id), "
                            "prefect_flow_run_id = coalesce(?, prefect_flow_run_id) "
                            "WHERE run_id = ?", [mlflow_run_id, prefect_flow_run_id, run_id])
        return known is None

    def set_run(self, run_id: str, *, status: str | None = None, mlflow_run_id: str | None = None,
                prefect_flow_run_id: str | None = None) -> None:
        """Update a run's status or its MLflow / Prefect ids (None leaves a field as it is)."""
        if status is not None and status not in RUN_STATUSES:
            raise StoreError(f"run status {status!r} is not one of {RUN_STATUSES}")
        with self._transaction() as con:
            if con.execute("SELECT 1 FROM runs WHERE run_id = ?", [run_id]).fetchone() is None:
                raise StoreError(f"unknown run_id {run_id!r}: call init_run first")
            _exec(con, "UPDATE runs SET status = coalesce(?, status), "
                        "mlflow_run_id = coalesce(?, mlflow_run_id), "
                        "prefect_flow_run_id = coalesce(?, prefect_flow_run_id) WHERE run_id = ?",
                        [status, mlflow_run_id, prefect_flow_run_id, run_id])

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The run's row as a dict (config parsed), or None."""
        rows = self.query("SELECT * FROM runs WHERE run_id = $run_id", {"run_id": run_id}).to_pylist()
        if not rows:
            return None
        row = rows[0]
        row["config"] = json.loads(row.pop("config_json"))
        return row

    def mark_step(self, run_id: str, step: int, status: str,
                  metrics: Mapping[str, float] | None = None, then_running: int | None = None
                  ) -> None:
        """Record a step as running, complete or failed (re-marking a step is allowed); with
        ``then_running``, also mark that step running in the same transaction (a step's end and
        the next one's start: one write, one publish)."""
        _check_run_id(run_id)
        if status not in STEP_STATUSES:
            raise StoreError(f"step status {status!r} is not one of {STEP_STATUSES}")
        metrics_json = None if metrics is None else json.dumps(dict(metrics), sort_keys=True)
        now = _now()
        rows = [[run_id, step, status, now, None if status == "running" else now, metrics_json]]
        if then_running is not None:
            rows.append([run_id, then_running, "running", now, None, None])
        with self._transaction() as con:
            for row in rows:  # an update, else an insert: ~2-3 ms a row here, ON CONFLICT's ~7
                run, at, state, _, finished, metrics_of = row
                changed = _exec(con, "UPDATE steps SET status = ?, finished_at = ?, metrics_json = "
                                "coalesce(?, metrics_json) WHERE run_id = ? AND step = ?",
                                [state, finished, metrics_of, run, at])
                if not changed[0][0]:
                    _exec(con, "INSERT INTO steps VALUES (?, ?, ?, ?, ?, ?)", row)

    def mark_failed(self, run_id: str, step: int) -> None:
        """After a failure at ``step``: that step, unless it is complete, and every step of the
        run still marked running, marked failed (a failed write of a step's end may have left
        the next step marked running)."""
        _check_run_id(run_id)
        now = _now()
        with self._transaction() as con:
            _exec(con, "INSERT INTO steps VALUES (?, ?, 'failed', ?, ?, NULL) ON CONFLICT (run_id, "
                  "step) DO UPDATE SET status = 'failed', finished_at = excluded.finished_at "
                  "WHERE steps.status <> 'complete'", [run_id, step, now, now])
            _exec(con, "UPDATE steps SET status = 'failed', finished_at = ? WHERE run_id = ? AND "
                  "status = 'running'", [now, run_id])

    def last_complete_step(self, run_id: str) -> int | None:
        """The highest step marked complete, or None if none is."""
        t = self.query("SELECT max(step) AS s FROM steps WHERE run_id = $r AND status = 'complete'",
                       {"r": run_id})
        return t.column("s")[0].as_py()

    # ---------------------------------------------------------------- held-out evaluations

    EVAL_COLUMNS = ("run_id", "step", "policy_dir", "split", "skip", "items", "samples",
                    "temperature", "accuracy", "ci_low", "ci_high", "per_item",
                    "generated_tokens", "tool_calls")

    def record_eval(self, row: Mapping[str, Any]) -> None:
        """Store one held-out evaluation (``EVAL_COLUMNS``); a repeat of (run, step) replaces it."""
        missing = [c for c in self.EVAL_COLUMNS if c not in row]
        if missing:
            raise StoreError(f"record_eval: missing {missing}")
        _check_run_id(row["run_id"])
        values = [row[c] for c in self.EVAL_COLUMNS] + [_now()]
        marks = ", ".join("?" * len(values))
        with self._transaction() as con:
            _exec(con, f"INSERT OR REPLACE INTO evals ({', '.join(self.EVAL_COLUMNS)}, created_at) "
                       f"VALUES ({marks})", values)

    def get_eval(self, run_id: str, step: int) -> dict[str, Any] | None:
        """The stored evaluation of (run, step) as a dict, or None."""
        rows = self.query("SELECT * FROM evals WHERE run_id = $r AND step = $s",
                          {"r": run_id, "s": step}).to_pylist()
        return rows[0] if rows else None

    def has_level(self, run_id: str, step: int, level: int) -> bool:
        """Whether any tree of this step has rows at this level."""
        t = self.query("SELECT count(*) AS n FROM nodes WHERE run_id = $r AND step = $s "
                       "AND level = $l", {"r": run_id, "s": step, "l": level})
        return t.column("n")[0].as_py() > 0

    # ---------------------------------------------------------------- writing a level

    def write_level(self, run_id: str, step: int, level: int, nodes: pa.Table,
                    allocations: pa.Table | None = None,
                    ledger: Mapping[str, Any] | None = None) -> WriteResult:
        """Persist one tree level (its new nodes, the allocation that made it, its cost) atomically.

        ``nodes`` follows ``schema.NODE_INPUT``; ``allocations`` follows ``schema.ALLOCATION_INPUT``;
        ``ledger`` holds ``method`` plus ``schema.LEDGER_FIELDS``. On any error nothing is written.
        """
        _check_run_id(run_id)
        for name, v in (("step", step), ("level", level)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise StoreError(f"write_level: {name} must be a non-negative int, got {v!r}")
        staged = stage_nodes(run_id, step, level, nodes)
        alloc = None if allocations is None else stage_allocations(run_id, step, level, allocations)
        ledger_values = None if ledger is None else ledger_row(run_id, step, level, ledger)
        with self._transaction(publish=False) as con:
            con.register("staged_nodes", staged)
            done = con.execute(
                "SELECT DISTINCT tree_id FROM nodes WHERE run_id = ? AND step = ? AND level = ? "
                "AND tree_id IN (SELECT tree_id FROM staged_nodes) ORDER BY tree_id",
                [run_id, step, level]).fetchall()
            skipped = tuple(int(r[0]) for r in done)
            bad = con.execute(
                "SELECT s.node_id, s.parent_id, p.depth, p.is_leaf FROM staged_nodes s LEFT JOIN ("
                "  SELECT node_id, depth, is_leaf FROM nodes WHERE run_id = ? AND step = ?"
                "  UNION ALL SELECT node_id, depth, is_leaf FROM staged_nodes) p "
                "ON p.node_id = s.parent_id WHERE s.parent_id IS NOT NULL "
                "AND (p.node_id IS NULL OR p.depth <> s.depth - 1 OR p.is_leaf) "
                "ORDER BY s.tree_id, s.local_index LIMIT 5", [run_id, step]).fetchall()
            if bad:
                detail = "; ".join(f"{n}: parent {p} " + ("is not stored" if d is None else
                                   "is a leaf" if leaf else f"has depth {d}")
                                   for n, p, d, leaf in bad)
                raise StoreError(f"write_level(run={run_id}, step={step}, level={level}) nodes: "
                                 f"column 'parent_index': each parent must be a stored non-leaf "
                                 f"node one turn shallower ({detail})")
            # A tree stored at this level already (a retry) is skipped whole; every other row
            # is new (ids are deterministic), so a plain INSERT: the key is still checked, without
            # OR IGNORE's cost (~4.5 ms of a level's ~8 here), and a clash is an error, not a drop.
            cols = ", ".join(NODE_COLUMNS)
            keep = f"WHERE tree_id NOT IN ({', '.join(map(str, skipped))})" if skipped else ""
            try:
                inserted = _exec(con, f"INSERT INTO nodes ({cols}) SELECT {cols} FROM staged_nodes "
                                      f"{keep}")[0][0]
            except duckdb.ConstraintException as exc:
                raise StoreError(f"write_level(run={run_id}, step={step}, level={level}) nodes: "
                                 f"columns 'tree_id', 'local_index' name a node already stored "
                                 f"at another level ({exc})") from exc
            n_alloc = 0
            if alloc is not None:
                con.register("staged_alloc", alloc)
                acols = ", ".join(ALLOCATION_COLUMNS)
                n_alloc = _exec(con, f"INSERT OR IGNORE INTO allocations ({acols}) "
                                     f"SELECT {acols} FROM staged_alloc")[0][0]
            ledger_written = False
            if ledger_values is not None:
                ledger_written = _exec(con, "INSERT OR IGNORE INTO ledger VALUES "
                                            "(?, ?, ?, ?, ?, ?, ?, ?, ?)", ledger_values)[0][0] > 0
        return WriteResult(int(inserted), skipped, int(n_alloc), ledger_written)

    def update_values(self, run_id: str, step: int, updates: pa.Table) -> int:
        """Set backup results (value, n_leaves, advantage) or later scores (predicted_v,
        allocated_k) on stored nodes of one step, in one transaction. Returns rows updated."""
        _check_run_id(run_id)
        staged = stage_updates(updates)
        cols = [c for c in staged.column_names if c != "node_id"]
        with self._transaction(publish=False) as con:
            con.register("staged_updates", staged)
            missing = con.execute(
                "SELECT node_id FROM staged_updates WHERE node_id NOT IN "
                "(SELECT node_id FROM nodes WHERE run_id = ? AND step = ?) LIMIT 5",
                [run_id, step]).fetchall()
            if missing:
                raise StoreError(f"update_values: column 'node_id' names nodes not stored for run "
                                 f"{run_id!r} step {step}: {[m[0] for m in missing]}")
            sets = ", ".join(f"{c} = u.{c}" for c in cols)
            _exec(con, f"UPDATE nodes SET {sets} FROM staged_updates u "
                        f"WHERE nodes.node_id = u.node_id")
        return staged.num_rows

    # ---------------------------------------------------------------- reading

    def read_step(self, run_id: str, step: int) -> pa.Table:
        """All nodes of one step, ordered by tree and slot."""
        return self.query("SELECT * FROM nodes WHERE run_id = $r AND step = $s "
                          "ORDER BY tree_id, local_index", {"r": run_id, "s": step})

    def read_tree(self, run_id: str, step: int, tree_id: int) -> pa.Table:
        """One tree's nodes in slot order, i.e. trace_core's arrays (parent_index < local_index)."""
        return self.query("SELECT * FROM nodes WHERE run_id = $r AND step = $s AND tree_id = $t "
                          "ORDER BY local_index", {"r": run_id, "s": step, "t": tree_id})

    def read_prefixes(self, node_ids: Sequence[str]) -> pa.Table:
        """Exact token history of each node (root to node), to re-feed for a continuation.

        Returns node_id, token_ids (concat of obs_token_ids of the root = prompt, then per turn
        gen_token_ids + obs_token_ids) and gen_mask (1 on policy tokens, 0 on prompt/tool tokens).
        """
        ids = pa.table({"want": pa.array(list(node_ids), pa.string())})
        with self._connect(read_only=True) as con:
            con.register("want_ids", ids)
            rows = con.execute(
                "WITH RECURSIVE up(want, node_id, hops) AS ("
                "  SELECT want, want, 0 FROM want_ids"
                "  UNION ALL SELECT up.want, n.parent_id, up.hops + 1 FROM up"
                "  JOIN nodes n ON n.node_id = up.node_id WHERE n.parent_id IS NOT NULL) "
                "SELECT up.want, up.hops, n.gen_token_ids, n.obs_token_ids FROM up "
                "JOIN nodes n ON n.node_id = up.node_id ORDER BY up.want, up.hops DESC").fetchall()
        found: dict[str, tuple[list[int], list[int]]] = {}
        for want, _, gen, obs in rows:
            toks, mask = found.setdefault(want, ([], []))
            toks.extend(gen or [])
            mask.extend([1] * len(gen or []))
            toks.extend(obs or [])
            mask.extend([0] * len(obs or []))
        missing = [n for n in node_ids if n not in found]
        if missing:
            raise StoreError(f"read_prefixes: node ids not stored: {missing[:5]}")
        return pa.table({"node_id": list(node_ids),
                         "token_ids": [found[n][0] for n in node_ids],
                         "gen_mask": [found[n][1] for n in node_ids]})

    def export_parquet(self, run_id: str, out_dir: str | Path) -> dict[str, Path]:
        """Write one Parquet file per table (rows of this run) under out_dir; return the paths."""
        _check_run_id(run_id)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = {}
        order = {"runs": "", "steps": "ORDER BY step", "nodes": "ORDER BY step, tree_id, local_index",
                 "allocations": "ORDER BY step, level, node_id, allocator",
                 "ledger": "ORDER BY step, level, method", "evals": "ORDER BY step"}
        with self._connect(read_only=True) as con:
            for table, order_by in order.items():
                t = con.sql(f"SELECT * FROM {table} WHERE run_id = ? {order_by}",
                            params=[run_id]).to_arrow_table()
                written[table] = out / f"{table}.parquet"
                pq.write_table(t, written[table])
        return written


# -------------------------------------------------------------------- input validation
