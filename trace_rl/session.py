"""What the pipeline's tasks share in one process, in one explicit object: ``Session``.

A phase hands the next ids and Arrow tables; the long-lived objects behind them (the work dir's
tree store, environments and their loaded items, the rollout engine with the weights it holds, the
policy trainer kept between steps, the logging jobs not yet run, values computed once such as the
code version) are looked up in the session by reference (a path, a config), never passed, so a
cache key never depends on a live object.

``Session.current()`` is the session of the running flow: the one a caller made current with
``Session.use`` (a test, a flow that wants its own), else the process's session, ``PROCESS``. The
process's session is deliberate: a benchmark or ``trace`` runs many flows in one process and each
must find the engine the previous one started (starting vLLM takes minutes) and know which
weights it holds. Nothing in ``tasks`` or ``flows`` keeps state of its own
(``tests/test_no_globals.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, TypeVar

T = TypeVar("T")


class Session:
    """Engines by (kind, run id) with the weights each holds, trainers by the checkpoint they
    last saved, each run's last fitted predictor, journal entries of logging jobs in flight, and bounded memos (stores,
    environments, items, code version, correlation estimates), each by its key."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._memos: dict[str, OrderedDict[Hashable, Any]] = {}
        self._engine_home: dict[tuple[str, str], str] = {}
        self._loaded: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._trainers: dict[str, Any] = {}
        self._predictors: dict[tuple[str, str], tuple[int, Any]] = {}
        self._queued: set[Path] = set()

    @staticmethod
    def current() -> "Session":
        """The session made current by ``use``, else the process's (``PROCESS``)."""
        return _CURRENT.get() or PROCESS

    @contextlib.contextmanager
    def use(self) -> Iterator["Session"]:
        """Make this session current for the code (and the tasks) run inside the block."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    def memo(self, kind: str, key: Hashable, make: Callable[[], T], maxsize: int = 16) -> T:
        """The value of ``make()`` kept under (``kind``, ``key``); at most ``maxsize`` of a kind,
        the least recently used dropped first."""
        with self._lock:
            table = self._memos.setdefault(kind, OrderedDict())
            if key in table:
                table.move_to_end(key)
                return table[key]
        value = make()
        with self._lock:
            table.setdefault(key, value)
            table.move_to_end(key)
            while len(table) > maxsize:
                table.popitem(last=False)
            return table[key]

    def engine_home(self, kind: str, run_id: str, policy_dir: str) -> str:
        """The policy a run's engine of ``kind`` was started from: its first ``policy_dir``."""
        with self._lock:
            return self._engine_home.setdefault((kind, run_id), policy_dir)

    def serve(self, engine: Any, home: str, policy_dir: str) -> Any:
        """``engine`` holding ``policy_dir``'s weights: it serves those it was started from
        (``home``) until it loads others; one closed and started again starts from home."""
        with self._lock:
            if self._loaded.get(engine, home) != policy_dir:
                engine.load_weights(policy_dir)
            self._loaded[engine] = policy_dir
        return engine

    def take_trainer(self, policy_dir: str) -> Any:
        """The trainer that last saved ``policy_dir``, removed from the session (None if none)."""
        with self._lock:
            return self._trainers.pop(policy_dir, None)

    def keep_trainer(self, policy_dir: str, trainer: Any) -> None:
        """Keep ``trainer`` (its optimiser state in memory) for the step after ``policy_dir``."""
        with self._lock:
            self._trainers[policy_dir] = trainer

    def keep_predictor(self, workdir: str, run_id: str, step: int, predictor: Any) -> None:
        """Keep the predictor a run fitted (and saved) at ``step``: the next step scores with it
        and fits it further instead of reading it back. One per run: the last step's."""
        with self._lock:
            self._predictors[(workdir, run_id)] = (step, predictor)

    def kept_predictor(self, workdir: str, run_id: str, step: int, take: bool = False) -> Any:
        """The predictor kept for (``workdir``, ``run_id``) at ``step`` (None if another step's or
        none); ``take``: removed from the session (a fit changes it in place)."""
        with self._lock:
            kept = self._predictors.get((workdir, run_id))
            if kept is None or kept[0] != step:
                return None
            if take:
                del self._predictors[(workdir, run_id)]
            return kept[1]

    def queue(self, entry: Path) -> None:
        """A logging job's journal entry, submitted and not yet run."""
        with self._lock:
            self._queued.add(entry)

    def finish(self, entry: Path) -> None:
        with self._lock:
            self._queued.discard(entry)

    def queued(self, entry: Path) -> bool:
        with self._lock:
            return entry in self._queued


PROCESS = Session()
"""The process's session: what flows run in one process (a benchmark, ``trace``) share."""

_CURRENT: contextvars.ContextVar[Session | None] = contextvars.ContextVar("trace_session",
                                                                         default=None)
