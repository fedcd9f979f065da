"""Logging off a step's critical path: one worker thread per work dir runs jobs in order.

A training step hands its MLflow logging (metrics, checkpoint registration, the step's page and
pictures) to ``submit`` and goes on (inside ``deferred``: the job starts after the block);
``drain`` waits until every job handed over so far has run and raises the first error one of
them raised (once). ``Tracker.end`` drains, so a run's logging is complete when the run is
closed, finished or failed. A job runs in a copy of the submitter's ``contextvars`` (Prefect's
run context among them: artifacts a job creates belong to the task run that submitted it).
What survives a crash of the process is the caller's business: the training flow writes each
step's job to a journal first (``tasks.track``).
"""

from __future__ import annotations

import contextvars
import queue
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator


class _Worker:
    def __init__(self, name: str):
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.error: BaseException | None = None
        self.submitted = 0
        """Jobs submitted so far (a job's number is the count before it)."""
        self.held_from: int | None = None
        """While a ``deferred`` block runs: the number of its first job (it and later ones wait)."""
        self.gate = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                number, context, fn = job
                with self.gate:
                    self.gate.wait_for(lambda: self.held_from is None or number < self.held_from)
                if self.error is None:  # after a failure the rest wait for the caller to see it
                    context.run(fn)
            except BaseException as exc:  # noqa: BLE001 -- handed to whoever drains
                self.error = exc
            finally:
                self.jobs.task_done()

    def release(self) -> None:
        with self.gate:
            self.held_from = None
            self.gate.notify_all()


_WORKERS: dict[Path, _Worker] = {}
_GUARD = threading.Lock()


def _key(workdir: str | Path) -> Path:
    return Path(workdir).resolve()


def _worker(workdir: str | Path) -> _Worker:
    with _GUARD:
        worker = _WORKERS.get(_key(workdir))
        if worker is None or not worker.thread.is_alive():
            worker = _WORKERS[_key(workdir)] = _Worker(f"trace-log-{_key(workdir).name}")
        return worker


def submit(workdir: str | Path, fn: Callable[[], Any]) -> None:
    """Run ``fn()`` on the work dir's logging thread, after the jobs submitted before it (inside
    a ``deferred`` block: once the block ends). A job submitted before that failed raises its
    error here (then forgotten), as ``drain`` would."""
    worker = _worker(workdir)
    error, worker.error = worker.error, None
    if error is not None:
        raise error
    with worker.gate:
        number, worker.submitted = worker.submitted, worker.submitted + 1
    worker.jobs.put((number, contextvars.copy_context(), fn))


@contextmanager
def deferred(workdir: str | Path) -> Iterator[None]:
    """Jobs submitted for the work dir inside the block start once it ends (earlier ones run
    as usual). The train flow wraps each step in one: the step's logging (MLflow's Python,
    holding the GIL) starts after the step's end is marked, rather than slowing that write
    (``docs/results.md``, "The overhead of a step"). ``drain`` inside the block ends the wait."""
    worker = _worker(workdir)
    with worker.gate:
        outer = worker.held_from is None  # nested: the outer block decides
        if outer:
            worker.held_from = worker.submitted
    try:
        yield
    finally:
        if outer:
            worker.release()


def drain(workdir: str | Path) -> None:
    """Wait for the work dir's submitted jobs; raise the first error one raised (then forget
    it, and skip no more jobs). Nothing submitted: returns at once."""
    with _GUARD:
        worker = _WORKERS.get(_key(workdir))
    if worker is None:
        return
    worker.release()  # inside a ``deferred`` block: its jobs would wait for its end
    worker.jobs.join()
    error, worker.error = worker.error, None
    if error is not None:
        raise error


def pending(workdir: str | Path) -> int:
    """Jobs submitted for the work dir and not yet run."""
    with _GUARD:
        worker = _WORKERS.get(_key(workdir))
    return 0 if worker is None else worker.jobs.unfinished_tasks
