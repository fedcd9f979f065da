"""When engines stop: every entry point shuts its rollout engines down itself, and an engine's
processes never outlive the process that started them.

Why this module exists. vLLM runs its engine core in a child process (``VLLM::EngineCore``, which
starts ``VLLM::Worker``) that is *not* a daemon and waits for requests until told to stop.
Python's ``multiprocessing`` joins every non-daemon child at interpreter exit
(``multiprocessing.util._exit_function``, an ``atexit`` hook), so a process that reaches its exit
handlers with a live engine waits for it forever. ``close_engines`` used to be registered with
``atexit`` when ``trace_rl.engines`` was imported, which is *before* ``multiprocessing.util`` is
first imported (vLLM imports it); ``atexit`` runs hooks last-registered first, so the join ran
before ``close_engines``. Whether a run exited then depended on luck: vLLM's own
``weakref.finalize`` shutdown hook runs before the join only when the process creates its first
``weakref.finalize`` after importing ``multiprocessing.util``. The HotpotQA environment imports
its retriever, bm25s, which imports numba, which creates one earlier; so ``trace eval`` on
SmolLM2/HotpotQA printed its result and hung, while on ``synth_arith`` (no such import) it exited.

The mechanism now, in three layers:

1. **Explicit scopes.** ``engine_scope()`` closes every engine the process built when the
   outermost scope ends, on success, on an exception and on ``SystemExit``, before any exit
   handler runs. The ``trace`` command and every benchmark run inside ``entry_point``; each flow
   closes them when its run ends unless it runs inside a scope (``flows.common.RELEASES_ENGINES``,
   Prefect's state hooks): a Prefect worker's flow-run process has none, while ``trace`` or a
   benchmark that runs many flows keeps one engine for all of them.
2. **Exit-handler order.** ``close_engines`` is (re-)registered with ``atexit`` after
   ``multiprocessing.util`` is imported and again after every engine start, so it runs before
   the join even where no scope was opened (a notebook, a user's script).
3. **Parent death.** ``SIGTERM`` (and ``SIGHUP``) in an entry point raise ``SystemExit``, so the
   scope closes the engines; ``SIGINT`` raises ``KeyboardInterrupt`` as usual. Nothing runs in a
   process killed with ``SIGKILL``, so the first engine that starts child processes also starts a
   reaper (``python -m trace_rl.engines.reaper``) in its own session: it notes the parent's
   descendants twice a second and, once the parent is gone, terminates those still running
   (``SIGKILL`` after a grace period), then exits.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util  # noqa: F401  (imported before close_engines is registered: see above)
import os
import signal
import subprocess
import sys
from typing import Any, Callable, Iterator

READY_S = 60.0
"""How long ``watch_children`` waits for the reaper to start watching (a Python start-up)."""

_depth = 0
_reaper: subprocess.Popen | None = None


def close_all() -> None:
    """Close every engine of this process (``trace_rl.engines.close_engines``; safe to call
    again). Imported here, not at the top: ``trace_rl.engines`` imports this module."""
    from trace_rl.engines import close_engines

    close_engines()


def keep_exit_hook_first() -> None:
    """Make ``close_all`` the most recently registered exit handler, so it runs before
    ``multiprocessing``'s join of the engine processes (and before any hook registered by a
    library imported while an engine started)."""
    atexit.unregister(close_all)
    atexit.register(close_all)


@contextlib.contextmanager
def engine_scope() -> Iterator[None]:
    """Close the process's engines when the outermost scope ends (however it ends); an inner
    scope (a flow run inside ``trace`` or a benchmark) leaves them running for the next flow."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            close_all()


def in_scope() -> bool:
    """Whether an ``engine_scope`` is open in this process (then it closes the engines)."""
    return _depth > 0


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def entry_point(main: Callable[[], Any]) -> Any:
    """Run a program's ``main`` so that its engines stop with it: ``SIGTERM``/``SIGHUP`` become
    ``SystemExit`` (exit status 128 + the signal), and the engines are closed before the
    interpreter's exit handlers run, whatever ``main`` ends with."""
    import threading

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _exit_on_signal)
    with engine_scope():
        return main()


def watch_children() -> None:
    """Start this process's reaper once (see the module docstring) and return when it watches
    (it has noted the children this process has now): called by an engine that starts child
    processes, before it starts them. No-op where psutil is missing."""
    global _reaper
    if _reaper is not None and _reaper.poll() is None:
        return
    import importlib.util

    if importlib.util.find_spec("psutil") is None:
        return
    _reaper = subprocess.Popen(
        [sys.executable, "-m", "trace_rl.engines.reaper", str(os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True, close_fds=True)
    # Returns once the reaper has noted this process's children (it says so): no engine runs
    # unwatched. A reaper that died at start says nothing (EOF); then the engine runs without one.
    import select

    if select.select([_reaper.stdout], [], [], READY_S)[0]:
        _reaper.stdout.readline()
    _reaper.stdout.close()


def reaper_pid() -> int | None:
    """The running reaper's process id, if any (for tests and diagnostics)."""
    return _reaper.pid if _reaper is not None and _reaper.poll() is None else None


keep_exit_hook_first()

__all__ = ["close_all", "engine_scope", "entry_point", "in_scope", "keep_exit_hook_first",
           "reaper_pid", "watch_children"]
