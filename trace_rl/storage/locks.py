"""File locks of a work dir: who may write it, and naming the process that holds a file.

Two kinds of lock, both ``fcntl.flock`` on a small lock file (released by the kernel when the
holding process dies, so a crash never leaves a stale lock behind):

* ``file_lock``: short, around one store transaction and its publish (``store.py``), or around
  MLflow's first set-up of its sqlite database (``tracking.py``), whose schema migration races
  when two processes create it at once (``no such column:
  spans.dimension_attributes``).
* ``train_lock``: held by a ``train`` flow for its whole run, taken before MLflow or DuckDB are
  touched: one writer per work dir. A second ``trace train`` on a busy work dir fails at once with
  ``WorkdirBusyError`` naming the running one (pid, run id), or waits if asked. The lock is
  re-entrant within a process (the CLI takes it before Prefect starts, so a refusal costs no
  server start-up, and the flow takes it again).

``holders`` names the processes that have a file open (psutil), for messages that say who blocks.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

TRAIN_LOCK = ".trace-train.lock"
_log = logging.getLogger(__name__)
_DUCKDB_PID = re.compile(r"\(PID (\d+)\)")


class LockTimeout(TimeoutError):
    """A lock file stayed held past the timeout; the message names the holder."""


class WorkdirBusyError(RuntimeError):
    """Another ``train`` holds the work dir; ``holder`` is what it wrote into the lock file."""

    def __init__(self, message: str, holder: dict[str, Any]):
        super().__init__(message)
        self.holder = holder


def holders(path: str | Path, hint: str = "") -> str:
    """The processes other than this one that have ``path`` open, as ``pid 12 (python -m ...)``.

    ``hint`` is an error text that may name a PID (DuckDB's lock error does); it is used first
    since scanning every process's open files is slower (~0.1 s) and only sees our own user's."""
    import psutil

    target = str(Path(path).resolve())
    pids = [int(p) for p in _DUCKDB_PID.findall(hint)]
    if not pids:
        for proc in psutil.process_iter(["pid"]):
            if proc.info["pid"] == os.getpid():
                continue
            try:
                if any(f.path == target for f in proc.open_files()):
                    pids.append(proc.info["pid"])
            except (psutil.Error, OSError):
                continue
    named = []
    for pid in pids:
        try:
            cmd = " ".join(psutil.Process(pid).cmdline())[:120]
        except psutil.Error:
            cmd = "?"
        named.append(f"pid {pid} ({cmd})")
    return ", ".join(named) or "no process found (it may have just let go)"


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
        raise


@contextmanager
def file_lock(path: str | Path, timeout_s: float, what: str) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (created if missing), polling up to ``timeout_s``.

    While it waits it holds a shared flock on ``<path>.waiting``, so that a holder that keeps the
    lock between its uses sees someone waits (``waited_on``) and lets go. Past 5 s of waiting a
    warning names the holder once; past ``timeout_s``, ``LockTimeout``."""
    path = Path(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    waiting: int | None = None
    try:
        start = time.monotonic()
        delay, warned = 0.002, False
        while not _try_flock(fd):
            if waiting is None:  # say so, for as long as it waits
                waiting = os.open(_waiting(path), os.O_RDWR | os.O_CREAT, 0o644)
                fcntl.flock(waiting, fcntl.LOCK_SH)
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise LockTimeout(f"{what}: {path} stayed locked for {timeout_s:.0f} s by "
                                  f"{holders(path)}")
            if waited > 5 and not warned:
                _log.warning("%s: waiting for %s, held by %s", what, path, holders(path))
                warned = True
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        if waiting is not None:
            os.close(waiting)
            waiting = None
        yield
    finally:
        if waiting is not None:
            os.close(waiting)
        os.close(fd)  # closing the descriptor releases the flock


def _waiting(path: Path) -> Path:
    """Where a process waiting in ``file_lock`` for ``path`` says so (a shared flock)."""
    return path.with_name(path.name + ".waiting")


def waited_on(path: str | Path) -> bool:
    """Whether any process (or another thread of this one) waits in ``file_lock`` for ``path``."""
    try:
        fd = os.open(_waiting(Path(path)), os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        return not _try_flock(fd)  # a waiter's shared flock refuses this exclusive one
    finally:
        os.close(fd)


# ------------------------------------------------------------------ one train per work dir

_held: dict[Path, list[Any]] = {}  # lock file -> [fd, depth], for re-entry within this process
_held_guard = threading.Lock()


def read_holder(lock: Path, attempts: int = 20) -> dict[str, Any]:
    """What the holder wrote into the lock file (it writes right after locking; retry briefly)."""
    for _ in range(attempts):
        try:
            text = lock.read_text()
            if text.strip():
                return json.loads(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return {}


def describe_holder(holder: dict[str, Any]) -> str:
    if not holder:
        return "another process (it has not written its pid and run id yet)"
    return (f"`trace train` pid {holder.get('pid')} on {holder.get('host')}, run "
            f"{holder.get('run_id')}, started {holder.get('started_at')}")


@contextmanager
def train_lock(workdir: str | Path, run_id: str, *, wait: bool | float = False,
               poll_s: float = 1.0) -> Iterator[dict[str, Any]]:
    """Hold ``<workdir>/.trace-train.lock`` while a run trains; yield what was written into it.

    ``wait=False``: a busy work dir raises ``WorkdirBusyError`` at once. ``wait=True`` waits for
    as long as it takes; a number waits that many seconds, then raises. Re-entrant in a process.
    """
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    lock = workdir / TRAIN_LOCK
    with _held_guard:
        entry = _held.get(lock)
        if entry is not None:
            entry[1] += 1
    if entry is not None:
        try:
            yield read_holder(lock)
        finally:
            with _held_guard:
                entry[1] -= 1
        return
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = None if wait is True else time.monotonic() + float(wait or 0)
        announced = False
        while not _try_flock(fd):
            holder = read_holder(lock)
            if deadline is not None and time.monotonic() >= deadline:
                raise WorkdirBusyError(
                    f"work dir {workdir} is in use by {describe_holder(holder)}. One run writes "
                    f"a work dir at a time: wait for it to finish (or pass --wait to start when "
                    f"it does), stop it, or use another --workdir.", holder)
            if not announced:
                _log.warning("work dir %s is in use by %s; waiting for it to finish", workdir,
                             describe_holder(holder))
                announced = True
            time.sleep(poll_s)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id,
                "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        with _held_guard:
            _held[lock] = [fd, 1]
        try:
            yield info
        finally:
            with _held_guard:
                del _held[lock]
            os.ftruncate(fd, 0)  # while still locked: a stale pid is never read as the holder
    finally:
        os.close(fd)
