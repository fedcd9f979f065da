"""``python -m trace_rl.engines.reaper PID``: end PID's descendants once PID is gone.

Started by ``trace_rl.engines.lifecycle.watch_children`` in its own session (a Ctrl-C to the
terminal's process group does not reach it) as a child of PID. Twice a second it notes PID's
descendants (itself excepted); after the first look it says "watching" on its standard output,
which ``watch_children`` waits for. When its parent is no longer PID (PID exited or was killed, even
with ``SIGKILL``, and the reaper was handed to init), it sends ``SIGTERM`` to each noted process
that still runs (psutil checks that a process id was not reused), ``SIGKILL`` to those still
running after ``GRACE_S``, and exits. After a clean exit the engines are already closed and
there is nothing to end.
"""

from __future__ import annotations

import os
import sys
import time

POLL_S = 0.5
GRACE_S = 10.0


def descendants(parent: int) -> list:
    """PID's descendants (psutil processes), the reaper excepted; [] once PID is gone."""
    import psutil

    try:
        found = psutil.Process(parent).children(recursive=True)
    except psutil.Error:
        return []
    return [p for p in found if p.pid != os.getpid()]


def end(processes: list, grace_s: float = GRACE_S) -> list:
    """SIGTERM each of ``processes`` still running, SIGKILL those alive after ``grace_s``;
    returns those that could not be ended."""
    import psutil

    alive = []
    for p in processes:
        try:
            p.terminate()
            alive.append(p)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    return alive


def watch(parent: int, poll_s: float = POLL_S) -> int:
    """Note ``parent``'s descendants until it is gone, then end them; returns how many were
    left running after both signals (0 normally)."""
    noted: dict[int, object] = {}
    ready = False
    while os.getppid() == parent:
        current = descendants(parent)
        if current or os.getppid() == parent:  # a snapshot taken while the parent still lived
            noted = {p.pid: p for p in current}
        if not ready:  # the parent waits for this line: from now on its tree is watched
            print("watching", flush=True)
            sys.stdout.close()
            ready = True
        time.sleep(poll_s)
    return len(end(list(noted.values())))


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m trace_rl.engines.reaper PARENT_PID", file=sys.stderr)
        return 2
    return 1 if watch(int(argv[0])) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
