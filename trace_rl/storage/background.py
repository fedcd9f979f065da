"""Logging off a step's critical path: one worker thread per work dir runs jobs in order.

A training step hands its MLflow logging (metrics, checkpoint registration, the step's page and
pictures) to ``submit`` and goes on; ``drain`` waits until every job handed over so far has run
and raises the first error one of them raised (once). ``Tracker.end`` drains, so a run's logging
is complete when the run is closed, finished or failed. A job runs in a copy of the submitter's
``contextvars`` (Prefect's run context among them: artifacts a job creates belong to the task
run that submitted it). What survives a crash of the process is the caller's business: the
training flow writes each step's job to a journal first (``tasks.track``).
"""

from __future__ import annotations

import contextvars
import queue
import threading
from pathlib import Path
from typing import Any, Callable

class _Worker:
    def __init__(self, name: str):
        self.jobs: queue.Queue[Any] = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                context, fn = job
                if self.error is None:  # after a failure the rest wait for the caller to see it
                    context.run(fn)
            except BaseException as exc:  # noqa: BLE001 -- handed to whoever drains
                self.error = exc
            finally:
                self.jobs.task_done()


_WORKERS: dict[Path, _Worker] = {}
_GUARD = threading.Lock()


def _key(workdir: str | Path) -> Path:
    return Path(workdir).resolve()


def submit(workdir: str | Path, fn: Callable[[], Any]) -> None:
    """Run ``fn()`` on the work dir's logging thread, after the jobs submitted before it. A job
    submitted before that failed raises its error here (then forgotten), as ``drain`` would."""
    with _GUARD:
        worker = _WORKERS.get(_key(workdir))
        if worker is None or not worker.thread.is_alive():
            worker = _WORKERS[_key(workdir)] = _Worker(f"trace-log-{_key(workdir).name}")
    error, worker.error = worker.error, None
    if error is not None:
        raise error
    worker.jobs.put((contextvars.copy_context(), fn))


def drain(workdir: str | Path) -> None:
    """Wait for the work dir's submitted jobs; raise the first error one raised (then forget
    it, and skip no more jobs). Nothing submitted: returns at once."""
    with _GUARD:
        worker = _WORKERS.get(_key(workdir))
    if worker is None:
        return
    worker.jobs.join()
    error, worker.error = worker.error, None
    if error is not None:
        raise error


def pending(workdir: str | Path) -> int:
    """Jobs submitted for the work dir and not yet run."""
    with _GUARD:
        worker = _WORKERS.get(_key(workdir))
    return 0 if worker is None else worker.jobs.unfinished_tasks
