"""Work-dir locks: one train per work dir, re-entrant in a process, and the holder named."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from trace_rl.storage.locks import TRAIN_LOCK, WorkdirBusyError, file_lock, train_lock

REPO = Path(__file__).resolve().parents[1]


def _hold(workdir: Path, run_id: str) -> subprocess.Popen:
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from trace_rl.storage.locks import train_lock
        with train_lock({str(workdir)!r}, {run_id!r}):
            print("held", flush=True)
            sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


class Sleeps:
    """``trace_rl.storage.locks``'s ``time`` with its sleeps recorded (and still slept), and an
    event set at the first one: a test sees whether and when a lock waited, not for how long."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.first = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.calls.append(seconds)
        self.first.set()
        time.sleep(seconds)

    def monotonic(self) -> float:
        return time.monotonic()


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> Sleeps:
    from trace_rl.storage import locks

    s = Sleeps()
    monkeypatch.setattr(locks, "time", s)
    return s


def test_a_busy_work_dir_is_refused_at_once_naming_the_holder(tmp_path, sleeps):
    proc = _hold(tmp_path, "demo-abc123")
    try:
        with pytest.raises(WorkdirBusyError, match=f"pid {proc.pid}.*run demo-abc123") as info:
            with train_lock(tmp_path, "other"):
                pass
        assert sleeps.calls == []  # at once: refused on the first try, without a wait or a retry
        assert info.value.holder["pid"] == proc.pid and "--wait" in str(info.value)
        with pytest.raises(WorkdirBusyError):  # a bounded wait gives up too
            with train_lock(tmp_path, "other", wait=0.3, poll_s=0.1):
                pass
    finally:
        proc.stdin.write("\n")
        proc.stdin.flush()
        proc.wait(timeout=30)
    with train_lock(tmp_path, "other") as mine:  # free again once the holder has ended
        assert mine["run_id"] == "other"
    assert (tmp_path / TRAIN_LOCK).read_text() == ""  # no stale holder left behind


def test_wait_starts_when_the_holder_ends(tmp_path, sleeps):
    proc = _hold(tmp_path, "first")
    order: list[str] = []

    def release() -> None:  # once the waiter has found the work dir busy and begun to wait
        sleeps.first.wait()
        order.append("holder released")
        proc.stdin.write("\n")
        proc.stdin.flush()

    try:
        threading.Thread(target=release, daemon=True).start()
        with train_lock(tmp_path, "second", wait=True, poll_s=0.1) as mine:
            order.append("second holds")
            assert mine["run_id"] == "second"
        assert order == ["holder released", "second holds"] and sleeps.calls
    finally:
        proc.kill()
        proc.wait()


def test_the_lock_is_reentrant_within_a_process(tmp_path):
    with train_lock(tmp_path, "r1") as outer:
        with train_lock(tmp_path, "r1") as inner:  # the CLI holds it, then the flow takes it
            assert inner == outer
        assert "r1" in (tmp_path / TRAIN_LOCK).read_text()  # still held by the outer one


def test_file_lock_times_out_naming_the_holder(tmp_path):
    lock = tmp_path / "x.lock"
    code = (f"import fcntl, os, sys\nfd = os.open({str(lock)!r}, os.O_RDWR | os.O_CREAT)\n"
            f"fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\nsys.stdin.readline()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(TimeoutError, match=f"pid {proc.pid}"):
            with file_lock(lock, 0.2, "test"):
                pass
    finally:
        proc.kill()
        proc.wait()
    with file_lock(lock, 0.2, "test"):
        pass
