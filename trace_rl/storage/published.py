"""The file protocol under the tree store: one private DuckDB file per writer, published for readers.

Readers never block the writer. DuckDB lets one process hold a file read-write, and
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
checkpointed before each copy (no WAL: on close, or by the publish itself while a ``held`` block
keeps the connection open) and the copy happens under the writer's lock file.

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

import logging
import os
import random
import shutil
import threading
import time
from collections import deque
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import duckdb
import pyarrow as pa

from trace_rl.storage.locks import LockTimeout, file_lock, holders, waited_on

DB_FILENAME = "trace.duckdb"
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


class StoreError(ValueError):
    """Input that the store refuses; the message names the column and what to fix."""


class StoreBusyError(TimeoutError):
    """Another process held the database file for longer than the retry budget."""


def _exec(con: duckdb.DuckDBPyConnection, sql: str, params: Any = None) -> list[tuple]:
    """Execute and drain the result (DuckDB 2 refuses new work while a result is pending)."""
    return con.execute(sql, params).fetchall() if params is not None else con.execute(sql).fetchall()


def _is_lock_error(exc: BaseException) -> bool:
    return isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower()


class _Hold:
    """A ``held`` block's database, its connection (None until its first use) and the file lock
    it holds while the connection is open."""

    def __init__(self, db: "PublishedDatabase") -> None:
        self.db = db
        self.con: duckdb.DuckDBPyConnection | None = None
        self.stack: ExitStack | None = None
        self.unsaved = False
        """Whether writes on ``con`` since its last checkpoint are only in the WAL: a write that
        is not published at once is not checkpointed either; ``_publish`` checkpoints first."""


YIELD_POLL_S = 0.05
"""How often a writer's ``held`` connection kept through a ``released`` stretch checks whether
another process waits for the file."""


@contextmanager
def released() -> Iterator[None]:
    """Suspend this thread's ``held`` blocks for a stretch that runs long without the store
    (the update, the weight sync): inside it each use runs as outside any block. A writer's
    connection stays open through the stretch (opening one costs ~16 ms here, a DuckDB database's
    start, even in memory), so the next use after it finds it, unless another process asks for
    the file: it waits in ``locks.file_lock``, which says so, and a watcher thread closes the
    connection and lets go of the file lock within ``YIELD_POLL_S``; the next use then opens
    another. A reader's connection is closed at once. Outside any block: nothing."""
    files = getattr(PublishedDatabase._holds, "files", None)
    if not files:
        yield
        return
    for hold in list(files.values()):
        if not hold.db.writer:
            hold.db._let_go(hold)
    suspended = dict(files)
    files.clear()
    kept = [hold for hold in suspended.values() if hold.con is not None]  # writers' open ones
    stop, watcher = threading.Event(), None
    if kept:
        watcher = threading.Thread(target=_let_go_when_asked, args=(kept, stop),
                                   name="trace-store-yield", daemon=True)
        watcher.start()
    try:
        yield
    finally:
        stop.set()
        if watcher is not None:
            watcher.join()
        files.update(suspended)


def _let_go_when_asked(holds: list["_Hold"], stop: threading.Event) -> None:
    """Until ``stop``: close each writer's ``held`` connection, letting go of its file lock, once
    another process waits for that lock (``locks.waited_on``)."""
    while not stop.wait(YIELD_POLL_S):
        for hold in holds:
            if hold.con is not None and waited_on(hold.db._lock_file):
                hold.db._let_go(hold)


class PublishedDatabase:
    """A DuckDB file that one writer changes and any number of readers read (the protocol in
    this module's docstring); ``TreeStore`` adds the tables and what is done with them.

    ``path`` is the work dir (the file is ``<path>/trace.duckdb``) or a ``.duckdb`` / ``.db`` file:
    the published file that readers open. ``create=True`` makes a writer: it works on the private
    file next to it (``.trace.writer.duckdb``), adopting a work dir written before the private
    file existed (its ``trace.duckdb`` becomes the private file's starting point). ``create=False``
    makes a reader of the published file; a missing file is an error.
    """

    _locks: dict[Path, threading.RLock] = {}
    _locks_guard = threading.Lock()
    _pending: dict[Path, "PublishedDatabase"] = {}
    """Published path -> the writer of this process whose last writes are not published yet."""
    _holds = threading.local()
    """Per thread: file -> its ``_Hold`` while a ``held`` block of that file runs."""
    _open_holds: dict[Path, _Hold] = {}
    """File -> the ``held`` block of this process whose connection to it is open (changed under
    the file's thread lock): every thread's use of the file between the block's uses, and the
    publish timer, run on it and under its file lock."""

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
        self._lock_file = self.private.with_name(self.private.name + ".lock")
        """Held (``locks.file_lock``) by whichever TRACE process has the private file open."""
        with PublishedDatabase._locks_guard:
            self._lock = PublishedDatabase._locks.setdefault(self._file, threading.RLock())
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._writer_lock():
                self._adopt_old_layout()
        elif not self.path.exists():
            hint = (" (only the writer's private file is there: open a writing TreeStore once to "
                    "publish it)") if self.private.exists() else " (has a run written to this work dir yet?)"
            raise FileNotFoundError(f"no TRACE database at {self.path}{hint}")

    # ---------------------------------------------------------------- connections

    @contextmanager
    def _writer_lock(self) -> Iterator[None]:
        """This thread's turn, then (writers) this process's turn, on the file it opens (already
        this process's while a ``held`` block has its connection open)."""
        with self._lock:
            if not self.writer or self._open_hold() is not None:
                yield
                return
            with self._file_lock():
                yield

    @contextmanager
    def _file_lock(self) -> Iterator[None]:
        """This process's turn on a writer's file, among TRACE's processes."""
        try:
            with file_lock(self._lock_file, self.write_timeout_s, "TreeStore writer"):
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

    def _hold(self) -> "_Hold | None":
        return getattr(PublishedDatabase._holds, "files", {}).get(self._file)

    def _open_hold(self) -> "_Hold | None":
        return PublishedDatabase._open_holds.get(self._file)

    @contextmanager
    def held(self) -> Iterator[None]:
        """Within the block, this thread's reads and writes of the file share one connection
        (a writer's is read-write; each use gets a cursor of it), opened at the first of them and
        closed at the block's end, or in a ``released`` stretch once another process asks for the
        file (a reader's: at the stretch's start). Opening a connection costs 10-40 ms here, so a
        run of short phases that read and write the store saves one per use. While the connection
        is open the block keeps the file lock (other processes wait for the block's next
        ``released`` stretch), but this process's thread lock is taken per use: between uses,
        other threads' uses of the file run on the block's connection and the publish timer
        publishes deferred writes, so readers see a write within the deferral however long the
        block lasts. Each write is published (checkpointed first) or deferred, as if its connection
        had closed, except that a deferred write stays in the WAL until its publish; a failed use
        closes the connection. Nested blocks are one block."""
        files = PublishedDatabase._holds.__dict__.setdefault("files", {})
        if self._file in files:
            yield
            return
        files[self._file] = _Hold(self)
        try:
            yield
        finally:
            try:
                self._let_go()
            finally:
                del files[self._file]

    def _let_go(self, hold: "_Hold | None" = None) -> None:
        """Close the connection of this thread's ``held`` block (or of ``hold``), then let go of
        its file lock."""
        with self._lock:  # not in the middle of another thread's use or publish
            hold = hold or self._hold()
            if hold is None or hold.con is None:
                return
            con, stack = hold.con, hold.stack
            hold.con = hold.stack = None
            hold.unsaved = False  # DuckDB checkpoints on close
            if PublishedDatabase._open_holds.get(self._file) is hold:
                del PublishedDatabase._open_holds[self._file]
            with stack:  # the lock is let go after the close
                con.close()

    def _held_connection(self) -> "_Hold | None":
        """Under the thread lock: the open ``held`` connection of this process to the file, opened
        now if this thread's block has none yet; None outside any block (a use of its own)."""
        hold = self._open_hold()
        if hold is not None:
            return hold
        hold = self._hold()
        if hold is None:
            return None
        stack = ExitStack()
        if self.writer:
            stack.enter_context(self._file_lock())
        try:
            hold.con = self._open(self._file, read_only=not self.writer)
        except BaseException:
            stack.close()
            raise
        hold.stack = stack
        PublishedDatabase._open_holds[self._file] = hold
        return hold

    @contextmanager
    def _connect(self, read_only: bool,
                 publish: bool = True) -> Iterator[duckdb.DuckDBPyConnection]:
        """A connection to this store's file (while a ``held`` block of this process has one
        open: a cursor of the block's). A writer's read-write one publishes on success: always
        with ``publish``, else when due (``_publish_due``)."""
        if not read_only and not self.writer:
            raise StoreError(f"this TreeStore of {self.path} was opened with create=False "
                             f"(a reader); open TreeStore(path) to write")
        pending = None if self.writer else PublishedDatabase._pending.get(self.path)
        if pending is not None:  # a reader in the writer's own process reads its writes
            pending.flush()
        with self._lock:
            hold = self._held_connection()
            if hold is not None:
                opened = time.perf_counter()
                cursor = hold.con.cursor()  # a use of its own: its results and registrations
                try:
                    yield cursor
                    if not read_only:  # in the WAL until the publish that copies it checkpoints
                        hold.unsaved = True  # it (``_publish``: now or when due) or a close does
                except BaseException:
                    cursor.close()
                    self._let_go(hold)
                    raise
                cursor.close()
                if not read_only:
                    self._published(opened, publish)
                return
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
                    self._published(opened, publish)

    def _published(self, opened: float, publish: bool) -> None:
        """After a write (connection ``opened`` then): publish it, always with ``publish``, else
        when due, else soon."""
        self.lock_seconds.append(time.perf_counter() - opened)
        if publish or self._publish_due():
            self._publish()
        else:
            self._defer_publish()

    def _publish(self) -> None:
        """Copy the private file to a temporary name and rename it onto the published file
        (atomic: a reader sees the old snapshot or the new one, never a torn file)."""
        t0 = time.perf_counter()
        hold = self._open_hold()
        if hold is not None and hold.unsaved:  # as a close leaves it: the file holds all, no WAL
            with hold.con.cursor() as cursor:
                _exec(cursor, "CHECKPOINT")
            hold.unsaved = False
        tmp = self.path.with_name(f".{self.path.name}.publish-{os.getpid()}")
        try:
            shutil.copyfile(self.private, tmp)
            os.replace(tmp, self.path)
        except BaseException:  # a full disk: no partial copy left to hold the space
            tmp.unlink(missing_ok=True)
            raise
        self._published_at = time.perf_counter()
        self.publish_seconds.append(self._published_at - t0)
        with PublishedDatabase._locks_guard:
            if PublishedDatabase._pending.get(self.path) is self:
                del PublishedDatabase._pending[self.path]
        if self._timer is not None:
            if self._timer is not threading.current_thread():
                self._timer.cancel()
            self._timer = None

    def _defer_publish(self) -> None:
        """Leave this write unpublished for now, and make sure it is published soon: by a timer
        at the time the next publish is due (a non-daemon thread, so a process that exits in
        between still publishes), by the next write, or by a reader of this process first."""
        with PublishedDatabase._locks_guard:
            PublishedDatabase._pending[self.path] = self
        if self._timer is None:
            wait = self.publish_seconds[-1] * (1 - PUBLISH_SHARE) / PUBLISH_SHARE
            self._timer = threading.Timer(wait, self._timed_flush)
            self._timer.start()

    def _timed_flush(self) -> None:
        """The publish timer's job: ``flush``. A failure there (a full disk) would otherwise die
        with the timer's thread: it is logged, the writes stay pending, and the next write, reader
        or timer publishes them (a failure then raises in the thread that wrote)."""
        try:
            self.flush()
        except Exception as exc:  # noqa: BLE001 -- logged; the writes stay pending for a retry
            _log.warning("publishing the deferred writes of %s failed; the next write or read "
                         "retries: %s", self.path, exc)
        finally:
            with self._lock:
                if self._timer is threading.current_thread():
                    self._timer = None  # the next deferred write starts another

    def flush(self) -> None:
        """Publish now if this writer's last writes are not published yet."""
        with self._writer_lock():
            if PublishedDatabase._pending.get(self.path) is self:
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

    # ---------------------------------------------------------------- reading

    def query(self, sql: str, params: Mapping[str, Any] | Sequence[Any] | None = None) -> pa.Table:
        """Run one SELECT (or EXPLAIN) and return Arrow.

        The connection is read-only with external access disabled and its configuration locked
        (``READ_CONFIG``), and any other kind of statement is refused before it runs: the SQL can
        read the store's tables and views, nothing else, and change nothing. (Inside a writer's
        ``held`` block, the writer's own reads, it runs on the block's read-write connection,
        still refusing any other statement.)"""
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
        view`` opens one per page). Run only SELECTs on it; the connection refuses writes
        (inside a writer's ``held`` block it is the block's read-write one)."""
        with self._connect(read_only=True) as con:
            yield con
