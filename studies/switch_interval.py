"""A store write beside a busy Python thread, at several switch intervals:
``python -m studies.switch_interval [--marks 20]``.

The train flow's thread releases the GIL in every DuckDB (and torch) call, and when another
thread runs Python meanwhile (the logging thread's MLflow calls, Prefect's event and log
threads, the predictor's fit beside the update) it gets the GIL back only when that thread
yields it: after Python's switch interval, 5 ms by default. This study times the step's end
mark (``TreeStore.mark_step`` with ``then_running``, on a ``held`` connection, as the train flow
writes it) alone, then beside a thread that spins in Python, at the default interval and at
shorter ones. Each row: the median over ``--marks`` marks (0.2 s apart) of the mark's wall and
of its publish (checkpoint and file copy). What came of it (a shorter interval did not shorten
the default step; starting the step's logging after its mark did, ``background.deferred``) is in
docs/results.md, "The overhead of a step, and the optimiser against the machine".
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def _busy(on: bool) -> Iterator[None]:
    """A thread that runs Python until the block ends (nothing when ``on`` is false)."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))
    thread = threading.Thread(target=spin, daemon=True) if on else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def marks(store, n: int, busy: bool) -> tuple[float, float]:
    """Median seconds of ``n`` step-end marks and of their publishes."""
    walls = []
    with store.held(), _busy(busy):
        store.mark_step("study", 0, "running")
        for i in range(n):
            t0 = time.perf_counter()
            store.mark_step("study", i, "complete", {"x": 1.0}, then_running=i + 1)
            walls.append(time.perf_counter() - t0)
            time.sleep(0.2)
    return statistics.median(walls), statistics.median(list(store.publish_seconds)[-n:])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--marks", type=int, default=20)
    args = p.parse_args(argv)
    from trace_rl.storage.store import TreeStore

    default = sys.getswitchinterval()
    with tempfile.TemporaryDirectory(prefix="trace-switch-") as workdir:
        store = TreeStore(workdir)
        print("step-end mark (median ms): alone / beside a busy Python thread; its publish")
        try:
            for interval in (default, 0.001, 0.0005, 0.0002):
                sys.setswitchinterval(interval)
                alone, _ = marks(store, args.marks, busy=False)
                busy, publish = marks(store, args.marks, busy=True)
                print(f"  switch interval {interval * 1e3:4.1f} ms: {alone * 1e3:6.1f} / "
                      f"{busy * 1e3:6.1f}; publish beside it {publish * 1e3:5.1f}")
        finally:
            sys.setswitchinterval(default)


if __name__ == "__main__":
    main()
