"""DuckDB store for rollout trees: one file per work dir, one transaction per tree level.

The nodes table is trace_core's struct-of-arrays tree (DESIGN.md §4) flattened into rows; the
columns hold what §1 needs per node H: predicted V~(H), allocated K, reward r at leaves, the
backed-up V^(H) = sum_c n_c V^(c) / n_H, the leaf count n_H and the advantage.

Idempotence. Node ids are deterministic (``make_node_id``) and a level is written per tree in one
transaction: if a tree already has rows at a level, the new rows for that tree and level are
skipped as a whole, so a retried task leaves exactly one copy and never mixes two samplings of
the same branch. Allocations and ledger rows are keyed too (first write wins).

Readers never block the writer (issue 24). DuckDB lets one process hold a file read-write, and
while any other process holds it, even read-only, nobody can open it read-write. So the writer
keeps a private file, ``.trace.writer.duckdb``, that only TRACE's own store opens, and after its
transactions publishes ``trace.duckdb`` for readers: a copy of the private file written under a
temporary name and moved into place with ``os.replace`` (run and step changes always publish;
level writes and value updates publish at once unless that would spend more than
``PUBLISH_SHARE`` of the wall time on copies, and are then published shortly after, see
``_publish_due``). A reader (``trace sql``, ``duckdb
-readonly trace.duckdb``, a notebook) holding the published file keeps the inode it opened, a
consistent snapshot as of one transaction, for as long as it likes; the next publish swaps a new
inode in under it and the writer never waits. Each snapshot is whole because the private file is
checkpointed on close (no WAL) and the copy happens under the writer's lock file.

Why a published copy rather than immutable per-level Parquet files behind views: the private
file keeps one ACID database with in-place ``update_values`` (backup, advantages, late scores)
and transactional idempotence; per-level files would need an overlay for every update and rename
tricks for idempotence. The price is one file copy per publish, linear in the file size
(measured in docs/schema.md: 10 ms at 6 MB, 0.16 s at 118 MB on the 2-core machine).

Between TRACE processes (a train flow, a retrain or evaluate flow of the same work dir) an flock
on ``.trace.writer.duckdb.lock`` serialises every open of the private file, so they queue for
each other's short transactions instead of failing; one ``train`` per work dir is enforced
separately (``locks.train_lock``). Within one process a lock per file serialises connections,
since DuckDB refuses two connections of different modes to one file side by side in one process.

Reads are locked down: ``query`` runs one SELECT (or EXPLAIN) on a read-only connection with
DuckDB's external access disabled and its configuration locked, so SQL given to ``trace sql``
can neither write nor read anything outside the store (no COPY, ATTACH, EXPORT, read_csv/
read_text, PRAGMA, SET, CHECKPOINT, INSTALL/LOAD).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trace_rl.storage.locks import LockTimeout, file_lock, holders
from trace_rl.storage.schema import (
    ALLOCATION_INPUT,
    DERIVED_NODE_COLUMNS,
    LEDGER_FIELDS,
    NODE_INPUT,
    SCHEMA_VERSION,
    TABLES_DDL,
    UPDATABLE,
    VIEWS_DDL,
)

DB_FILENAME = "trace.duckdb"
STEP_STATUSES = ("running", "complete", "failed")
RUN_STATUSES = ("running", "complete", "failed", "killed")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_log = logging.getLogger(__name__)
READ_CONFIG = {
    "enable_external_access": False,  # no COPY/EXPORT/ATTACH, read_csv/read_text, extensions
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "python_enable_replacements": False,  # a query cannot scan Python variables by name
    "lock_configuration": True,  # last: no SET/PRAGMA can undo the above on this connection
}
"""DuckDB config of every read-only connection (``query``, ``trace sql``)."""
_READ_STATEMENTS = (duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN)
PUBLISH_SHARE = 0.1
"""Most of a writer's wall time that publishing level writes may take (see ``_publish_due``)."""

# Column order of the nodes table, as created by TABLES_DDL.
NODE_COLUMNS = (
    "node_id", "parent_id", "tree_id", "root_id", "run_id", "step", "level", "depth",
    "local_index", "parent_index", "item_id", "family", "text", "action_json", "observation",
    "gen_token_ids", "obs_token_ids", "gen_logprobs", "gen_tokens", "obs_tokens", "tool_called",
    "error", "predicted_v", "allocated_k", "reward", "value", "n_leaves", "advantage", "allocator",
    "is_leaf", "created_at",
)
ALLOCATION_COLUMNS = ("run_id", "step", "level", "node_id", "allocator", "item_id", "predicted_v",
                      "true_v", "k", "gain")
_UNIT_INTERVAL = ("predicted_v", "value", "reward")
_NON_NEGATIVE = ("allocated_k", "n_leaves", "depth", "local_index", "tree_id")


class StoreError(ValueError):
    """Input that the store refuses; the message names the column and what to fix."""


class StoreBusyError(TimeoutError):
    """Another process held the database file for longer than the retry budget."""


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


def _exec(con: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> list[tuple]:
    """Execute and drain the result (DuckDB 2 refuses new work while a result is pending)."""
    return con.execute(sql, params).fetchall() if params is not None else con.execute(sql).fetchall()


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _is_lock_error(exc: BaseException) -> bool:
    return isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower()


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


class TreeStore:
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

    _locks: dict[Path, threading.RLock] = {}
    _locks_guard = threading.Lock()
    _pending: dict[Path, "TreeStore"] = {}
    """Published path -> the writer of this process whose last writes are not published yet."""

    def __init__(self, path: str | Path, *, create: bool = True, read_timeout_s: float = 30.0,
                 write_timeout_s: float = 120.0):
        path = Path(path)
        if path.suffix not in (".duckdb", ".db"):  # a work dir
            path = path / DB_FILENAME
        self.path = path.resolve()
        """The published file: what readers open."""
        self.writer = create
        self.private = self.path.with_name(f".{self.path.stem}.writer{self.path.suffix}")
        """The writer's own file; nothing but a writing TreeStore opens it."""
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self.lock_seconds: deque[float] = deque(maxlen=10_000)
        """How long each read-write connection of this object held the file (the lock window)."""
        self.publish_seconds: deque[float] = deque(maxlen=10_000)
        """How long each publish (copy + rename of the private file) took."""
        self._published_at = 0.0
        self._timer: threading.Timer | None = None
        self._file = self.private if create else self.path
        with TreeStore._locks_guard:
            self._lock = TreeStore._locks.setdefault(self._file, threading.RLock())
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._writer_lock():
                self._adopt_old_layout()
            with self._connect(read_only=False) as con:
                _exec(con, TABLES_DDL)
                _exec(con, VIEWS_DDL)
                _exec(con, "INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                      [str(SCHEMA_VERSION)])
        elif not self.path.exists():
            hint = (" (only the writer's private file is there: open a writing TreeStore once to "
                    "publish it)") if self.private.exists() else " (has a run written to this work dir yet?)"
            raise FileNotFoundError(f"no TRACE database at {self.path}{hint}")

    # ---------------------------------------------------------------- connections

    @contextmanager
    def _writer_lock(self) -> Iterator[None]:
        """This thread's turn, then (writers) this process's turn, on the file it opens."""
        with self._lock:
            if not self.writer:
                yield
                return
            try:
                with file_lock(self.private.with_name(self.private.name + ".lock"),
                               self.write_timeout_s, "TreeStore writer"):
                    yield
            except LockTimeout as exc:
                raise StoreBusyError(str(exc)) from exc

    def _adopt_old_layout(self) -> None:
        """Remove half-written publishes; adopt a work dir from before the private file: start the
        private file from ``trace.duckdb``.

        A WAL left next to it (a writer killed mid-transaction) is replayed first by opening the
        file read-write once, so the copy holds every committed transaction."""
        for stale in self.path.parent.glob(f".{self.path.name}.publish-*"):
            stale.unlink(missing_ok=True)  # a publish killed mid-copy (publishes hold our lock)
        if self.private.exists() or not self.path.exists():
            return
        wal = self.path.with_name(self.path.name + ".wal")
        if wal.exists():
            con = self._open(self.path, read_only=False)
            con.close()
        tmp = self.private.with_name(f"{self.private.name}.adopt-{os.getpid()}")
        shutil.copyfile(self.path, tmp)
        os.replace(tmp, self.private)

    def _open(self, file: Path, read_only: bool) -> duckdb.DuckDBPyConnection:
        """Connect, retrying with backoff while a process outside TRACE's locks holds the file
        (someone opened the private file by hand); a long wait names that process."""
        timeout = self.read_timeout_s if read_only else self.write_timeout_s
        config = READ_CONFIG if read_only else {}
        deadline = time.monotonic() + timeout
        delay, warned_at = 0.005, time.monotonic() + 5
        while True:
            try:
                return duckdb.connect(str(file), read_only=read_only, config=config)
            except duckdb.Error as exc:
                if not _is_lock_error(exc):
                    raise
                now = time.monotonic()
                if now >= deadline:
                    raise StoreBusyError(
                        f"{file} stayed locked for {timeout:.0f} s "
                        f"({'read' if read_only else 'write'} open) by {holders(file, str(exc))}. "
                        f"Only TRACE's store should open it; readers open {self.path.name}, "
                        f"which never blocks the writer: {exc}") from exc
                if now >= warned_at:
                    _log.warning("%s is locked by %s; retrying", file, holders(file, str(exc)))
                    warned_at = float("inf")
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 0.05)

    @contextmanager
    def _connect(self, read_only: bool,
                 publish: bool = True) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection to this store's file. A writer's read-write one publishes on success:
        always with ``publish``, else when due (``_publish_due``)."""
        if not read_only and not self.writer:
            raise StoreError(f"this TreeStore of {self.path} was opened with create=False "
                             f"(a reader); open TreeStore(path) to write")
        pending = None if self.writer else TreeStore._pending.get(self.path)
        if pending is not None:  # a reader in the writer's own process reads its writes
            pending.flush()
        with self._writer_lock():
            opened = time.perf_counter()
            con = self._open(self._file, read_only)
            try:
                yield con
            except BaseException:
                con.close()
                raise
            con.close()  # DuckDB checkpoints on close: the file holds everything, no WAL
            if not read_only:
                self.lock_seconds.append(time.perf_counter() - opened)
                if publish or self._publish_due():
                    self._publish()
                else:
                    self._defer_publish()

    def _publish(self) -> None:
        """Copy the private file to a temporary name and rename it onto the published file
        (atomic: a reader sees the old snapshot or the new one, never a torn file)."""
        t0 = time.perf_counter()
        tmp = self.path.with_name(f".{self.path.name}.publish-{os.getpid()}")
        shutil.copyfile(self.private, tmp)
        os.replace(tmp, self.path)
        self._published_at = time.perf_counter()
        self.publish_seconds.append(self._published_at - t0)
        with TreeStore._locks_guard:
            if TreeStore._pending.get(self.path) is self:
                del TreeStore._pending[self.path]
        if self._timer is not None:
            if self._timer is not threading.current_thread():
                self._timer.cancel()
            self._timer = None

    def _defer_publish(self) -> None:
        """Leave this write unpublished for now, and make sure it is published soon: by a timer
        at the time the next publish is due (a non-daemon thread, so a process that exits in
        between still publishes), by the next write, or by a reader of this process first."""
        with TreeStore._locks_guard:
            TreeStore._pending[self.path] = self
        if self._timer is None:
            wait = self.publish_seconds[-1] * (1 - PUBLISH_SHARE) / PUBLISH_SHARE
            self._timer = threading.Timer(wait, self.flush)
            self._timer.start()

    def flush(self) -> None:
        """Publish now if this writer's last writes are not published yet."""
        with self._writer_lock():
            if TreeStore._pending.get(self.path) is self:
                self._publish()

    def _publish_due(self) -> bool:
        """Whether a level write or value update publishes: yes unless the last publish was so
        recent that publishing again would spend more than ``PUBLISH_SHARE`` of the wall time on
        copies. A copy is linear in the file size (~10 ms at 6 MB, ~160 ms at 120 MB here), so a
        small store publishes every write and a large one at most every ~1.5 s; run, step and
        schema changes always publish, and a deferred publish happens by then at the latest
        (``_defer_publish``), so no write stays unpublished longer than that."""
        if not self.publish_seconds:
            return True
        since = time.perf_counter() - self._published_at
        return since * PUBLISH_SHARE >= self.publish_seconds[-1] * (1 - PUBLISH_SHARE)

    @contextmanager
    def _transaction(self, publish: bool = True) -> Iterator[duckdb.DuckDBPyConnection]:
        with self._connect(read_only=False, publish=publish) as con:
            _exec(con, "BEGIN TRANSACTION")
            try:
                yield con
            except BaseException:
                _exec(con, "ROLLBACK")
                raise
            _exec(con, "COMMIT")

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
                  metrics: Mapping[str, float] | None = None) -> None:
        """Record a step as running, complete or failed (re-marking a step is allowed)."""
        _check_run_id(run_id)
        if status not in STEP_STATUSES:
            raise StoreError(f"step status {status!r} is not one of {STEP_STATUSES}")
        metrics_json = None if metrics is None else json.dumps(dict(metrics), sort_keys=True)
        now = _now()
        finished = None if status == "running" else now
        with self._transaction() as con:
            _exec(
                con, "INSERT INTO steps VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (run_id, step) DO UPDATE "
                "SET status = excluded.status, finished_at = excluded.finished_at, "
                "metrics_json = coalesce(excluded.metrics_json, steps.metrics_json)",
                [run_id, step, status, now, finished, metrics_json])

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
        staged = _stage_nodes(run_id, step, level, nodes)
        alloc = None if allocations is None else _stage_allocations(run_id, step, level, allocations)
        ledger_row = None if ledger is None else _ledger_row(run_id, step, level, ledger)
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
            cols = ", ".join(NODE_COLUMNS)
            inserted = _exec(con,
                f"INSERT OR IGNORE INTO nodes ({cols}) SELECT {cols} FROM staged_nodes "
                f"WHERE tree_id NOT IN (SELECT tree_id FROM nodes WHERE run_id = ? AND step = ? "
                f"AND level = ?)", [run_id, step, level])[0][0]
            n_alloc = 0
            if alloc is not None:
                con.register("staged_alloc", alloc)
                acols = ", ".join(ALLOCATION_COLUMNS)
                n_alloc = _exec(con, f"INSERT OR IGNORE INTO allocations ({acols}) "
                                     f"SELECT {acols} FROM staged_alloc")[0][0]
            ledger_written = False
            if ledger_row is not None:
                ledger_written = _exec(con, "INSERT OR IGNORE INTO ledger VALUES "
                                            "(?, ?, ?, ?, ?, ?, ?, ?, ?)", ledger_row)[0][0] > 0
        return WriteResult(int(inserted), skipped, int(n_alloc), ledger_written)

    def update_values(self, run_id: str, step: int, updates: pa.Table) -> int:
        """Set backup results (value, n_leaves, advantage) or later scores (predicted_v,
        allocated_k) on stored nodes of one step, in one transaction. Returns rows updated."""
        _check_run_id(run_id)
        staged = _stage_updates(updates)
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

    def query(self, sql: str, params: Mapping[str, Any] | Sequence[Any] | None = None) -> pa.Table:
        """Run one SELECT (or EXPLAIN) and return Arrow.

        The connection is read-only with external access disabled and its configuration locked
        (``READ_CONFIG``), and any other kind of statement is refused before it runs: the SQL can
        read the store's tables and views, nothing else, and change nothing."""
        with self._connect(read_only=True) as con:
            try:
                statements = con.extract_statements(sql)
            except duckdb.Error as exc:
                raise StoreError(f"query: {exc}") from exc
            if len(statements) != 1:
                raise StoreError(f"query: give exactly one statement, got {len(statements)}")
            kind = statements[0].type
            if kind not in _READ_STATEMENTS:
                raise StoreError(f"query: only SELECT (and DESCRIBE, SHOW, SUMMARIZE, EXPLAIN) may "
                                 f"run on the store; this is a {kind.name} statement (the store "
                                 f"is read-only)")
            return con.sql(sql, params=params).to_arrow_table()

    @contextmanager
    def snapshot(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """One read-only connection (``READ_CONFIG``) for several reads that must agree: they all
        see the same snapshot. Closed on exit, so nothing stays held between uses (``trace
        view`` opens one per page). Run only SELECTs on it; the connection refuses writes."""
        with self._connect(read_only=True) as con:
            yield con

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

def _conform(t: pa.Table, spec: Mapping[str, tuple[pa.DataType, bool]], what: str,
             allowed_extra: Sequence[str] = ()) -> dict[str, pa.ChunkedArray]:
    """Check names, required columns, nulls and types of an input table; return cast columns."""
    if not isinstance(t, pa.Table):
        raise StoreError(f"{what}: expected a pyarrow.Table, got {type(t).__name__}")
    unknown = [c for c in t.column_names if c not in spec and c not in allowed_extra]
    if unknown:
        raise StoreError(f"{what}: unknown column(s) {unknown}; allowed: {sorted(spec)} "
                         f"plus derived {list(allowed_extra)}")
    if len(set(t.column_names)) != len(t.column_names):
        raise StoreError(f"{what}: duplicate column names in {t.column_names}")
    missing = [c for c, (_, req) in spec.items() if req and c not in t.column_names]
    if missing:
        raise StoreError(f"{what}: missing required column(s) {missing}")
    out = {}
    for name, (typ, required) in spec.items():
        if name not in t.column_names:
            out[name] = pa.chunked_array([pa.nulls(t.num_rows, typ)])
            continue
        col = t.column(name)
        try:
            out[name] = col.cast(typ)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise StoreError(f"{what}: column {name!r} has type {col.type}, expected {typ} "
                             f"({exc})") from exc
        if required and out[name].null_count:
            raise StoreError(f"{what}: column {name!r} has {out[name].null_count} null(s); it is "
                             f"required on every row")
    return out


def _first_bad(mask: pa.ChunkedArray, col: pa.ChunkedArray, labels: list[Any]) -> str:
    i = pc.index(pc.fill_null(mask, False), True).as_py()
    return f"row {labels[i]} has {col[i].as_py()!r}"


def _check_ranges(cols: Mapping[str, pa.ChunkedArray], what: str, labels: list[Any],
                  unit: Sequence[str] = _UNIT_INTERVAL, nonneg: Sequence[str] = _NON_NEGATIVE) -> None:
    for name in (*unit, *nonneg):
        if name not in cols:
            continue
        c = cols[name]
        bad = pc.or_(pc.less(c, 0), pc.greater(c, 1)) if name in unit else pc.less(c, 0)
        if pc.any(bad).as_py():
            rule = "lie in [0, 1]" if name in unit else "be >= 0"
            raise StoreError(f"{what}: column {name!r} must {rule}; {_first_bad(bad, c, labels)}")


def _stage_nodes(run_id: str, step: int, level: int, t: pa.Table) -> pa.Table:
    """Check a level's node input and add the derived columns, column by column (a level of a
    4,096-leaf step has ~10^4 rows: no per-row Python on this path except to name a bad row)."""
    what = f"write_level(run={run_id}, step={step}, level={level}) nodes"
    cols = _conform(t, NODE_INPUT, what, allowed_extra=DERIVED_NODE_COLUMNS)
    n = t.num_rows
    if n == 0:
        raise StoreError(f"{what}: no rows")
    tree = cols["tree_id"].to_numpy()
    local = cols["local_index"].to_numpy()
    parent = cols["parent_index"].to_numpy()
    depth = cols["depth"].to_numpy()
    labels = _SlotLabels(tree, local)
    _check_ranges(cols, what, labels)
    if len(np.unique(np.stack([tree, local]), axis=1)[0]) != n:
        raise StoreError(f"{what}: columns 'tree_id', 'local_index' repeat a (tree, slot) pair")
    root = parent == -1
    bad = np.flatnonzero((root != (local == 0)) | (root != (depth == 0))
                         | (~root & ~((0 <= parent) & (parent < local))))
    if len(bad):
        i = int(bad[0])
        raise StoreError(
            f"{what}: column 'parent_index' at {labels[i]}: the root is slot 0 with "
            f"parent_index -1 and depth 0, every other node has 0 <= parent_index < "
            f"local_index and depth >= 1 (got parent_index {parent[i]}, depth {depth[i]})")
    leaf = cols["is_leaf"].to_numpy()
    bad = np.flatnonzero(leaf & cols["reward"].is_null().to_numpy(zero_copy_only=False))
    if len(bad):
        raise StoreError(f"{what}: column 'reward' is null at leaf {labels[int(bad[0])]}; leaves "
                         f"are written after their reward")
    prefix = f"{run_id}/s{step}/t"
    tree_s = pc.cast(cols["tree_id"], pa.string())

    def node_ids(slot: pa.ChunkedArray) -> pa.ChunkedArray:
        return pc.binary_join_element_wise(prefix, tree_s, "/n", pc.cast(slot, pa.string()), "")

    derived: dict[str, Any] = {
        "node_id": node_ids(cols["local_index"]),
        "parent_id": node_ids(pc.if_else(pc.equal(cols["parent_index"], -1), None,
                                         cols["parent_index"])),
        "root_id": node_ids(pc.multiply(cols["local_index"], 0)),
        "run_id": pa.repeat(run_id, n), "step": pa.repeat(step, n), "level": pa.repeat(level, n),
        "gen_tokens": pc.fill_null(pc.list_value_length(cols["gen_token_ids"]), 0).cast(pa.int64()),
        "obs_tokens": pc.fill_null(pc.list_value_length(cols["obs_token_ids"]), 0).cast(pa.int64()),
    }
    for name in DERIVED_NODE_COLUMNS:
        if name in t.column_names:
            given, want = t.column(name), derived[name]
            same = pc.fill_null(pc.equal(given.cast(want.type), want), False) if \
                given.type != pa.null() else pa.repeat(False, n)
            same = pc.or_(same, pc.and_(pc.is_null(given), pc.is_null(want)))
            if not pc.all(same).as_py():
                i = pc.index(same, False).as_py()
                raise StoreError(f"{what}: column {name!r} at {labels[i]} is {given[i].as_py()!r} "
                                 f"but the store derives {want[i].as_py()!r}; omit the column or "
                                 f"fix it")
    lp_len = pc.list_value_length(cols["gen_logprobs"])
    gen_len = pc.fill_null(pc.list_value_length(cols["gen_token_ids"]), 0)
    bad = pc.fill_null(pc.not_equal(lp_len, gen_len), False)
    if pc.any(bad).as_py():
        i = pc.index(bad, True).as_py()
        raise StoreError(f"{what}: column 'gen_logprobs' at {labels[i]} has {lp_len[i].as_py()} "
                         f"entries for {gen_len[i].as_py()} gen_token_ids")
    data = {name: derived[name] if name in derived else cols.get(name) for name in NODE_COLUMNS}
    data["created_at"] = pa.array([_now()] * n, pa.timestamp("us"))
    return pa.table(data)


class _ColumnLabels:
    """Row labels for error messages: the row's value of a column (e.g. its node id)."""

    def __init__(self, column: pa.ChunkedArray):
        self.column = column

    def __getitem__(self, i: int) -> Any:
        return self.column[i].as_py()


class _SlotLabels:
    """Row labels ``(tree T, slot S)`` for error messages, made only for the row named."""

    def __init__(self, tree: np.ndarray, local: np.ndarray):
        self.tree, self.local = tree, local

    def __getitem__(self, i: int) -> str:
        return f"(tree {self.tree[i]}, slot {self.local[i]})"


def _stage_allocations(run_id: str, step: int, level: int, t: pa.Table) -> pa.Table:
    what = f"write_level(run={run_id}, step={step}, level={level}) allocations"
    cols = _conform(t, ALLOCATION_INPUT, what)
    labels = cols["node_id"].to_pylist()
    _check_ranges(cols, what, labels, unit=("predicted_v", "true_v"), nonneg=("k",))
    keys = list(zip(labels, cols["allocator"].to_pylist()))
    if len(set(keys)) != len(keys):
        raise StoreError(f"{what}: columns 'node_id', 'allocator' repeat a pair")
    n = t.num_rows
    data = {"run_id": [run_id] * n, "step": [step] * n, "level": [level] * n}
    return pa.table({c: data.get(c, cols.get(c)) for c in ALLOCATION_COLUMNS})


def _ledger_row(run_id: str, step: int, level: int, ledger: Mapping[str, Any]) -> list[Any]:
    what = f"write_level(run={run_id}, step={step}, level={level}) ledger"
    expected = ("method",) + LEDGER_FIELDS
    unknown = sorted(set(ledger) - set(expected))
    missing = [k for k in expected if k not in ledger]
    if unknown or missing:
        raise StoreError(f"{what}: keys must be {list(expected)}; missing {missing}, "
                         f"unknown {unknown}")
    if not isinstance(ledger["method"], str) or not ledger["method"]:
        raise StoreError(f"{what}: 'method' must be a non-empty string")
    row: list[Any] = [run_id, step, level, ledger["method"]]
    for k in LEDGER_FIELDS:
        v = ledger[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or \
                (k != "wall_seconds" and int(v) != v):
            raise StoreError(f"{what}: {k!r} must be a non-negative "
                             f"{'number' if k == 'wall_seconds' else 'integer'}, got {v!r}")
        row.append(float(v) if k == "wall_seconds" else int(v))
    return row


def _stage_updates(t: pa.Table) -> pa.Table:
    what = "update_values"
    spec = {"node_id": (pa.string(), True)} | {c: (typ, False) for c, typ in UPDATABLE.items()}
    cols = _conform(t, spec, what)
    present = [c for c in UPDATABLE if c in t.column_names]
    if not present:
        raise StoreError(f"{what}: give node_id and at least one of {list(UPDATABLE)}")
    if pc.count_distinct(cols["node_id"]).as_py() != t.num_rows:
        raise StoreError(f"{what}: column 'node_id' repeats an id")
    _check_ranges({c: cols[c] for c in present}, what, _ColumnLabels(cols["node_id"]))
    return pa.table({"node_id": cols["node_id"], **{c: cols[c] for c in present}})
