"""trace_rl.progress: plain lines with a heartbeat off a terminal, a rich bar on one."""

from __future__ import annotations

import io
import threading
import types

import pytest

from trace_rl import progress
from trace_rl.progress import Progress, Silent


class Clock:
    """``trace_rl.progress``'s clock, moved by the test alone, and a count of the heartbeat's
    wake-ups: a test waits for the heartbeat to have looked (``looks``), never for seconds to
    pass, so what it sees does not depend on how busy the machine is."""

    def __init__(self) -> None:
        self.now = 0.0
        self.wakes = 0
        self.changed = threading.Condition()
        clock = self

        class Event(threading.Event):
            def wait(self, timeout: float | None = None) -> bool:
                stopped = super().wait(timeout)
                with clock.changed:
                    clock.wakes += 1
                    clock.changed.notify_all()
                return stopped

        self.threading = types.SimpleNamespace(Event=Event, Lock=threading.Lock,
                                               Thread=threading.Thread)

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def looks(self, n: int = 2) -> None:
        """Return once the heartbeat has woken ``n`` more times: after two wake-ups it has checked
        the clock at least once since the caller's last move."""
        with self.changed:
            target = self.wakes + n
            assert self.changed.wait_for(lambda: self.wakes >= target, timeout=120), \
                "the heartbeat thread never woke"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(progress, "time", c)
    monkeypatch.setattr(progress, "threading", c.threading)
    return c


def test_plain_lines_report_phases_fields_and_a_heartbeat(clock):
    out = io.StringIO()
    # every_s is on the test's clock; the heartbeat also wakes every 0.05 s of real time to look.
    with Progress("job", 10, stream=out, every_s=0.05, terminal=False) as p:
        p.note("warming up")
        p.advance(3, epoch="1/2", loss=0.123456)
        clock.looks()
        assert len(out.getvalue().splitlines()) == 1  # no time has passed: nothing more to say
        for _ in range(2):
            clock.advance(1.0)  # no report from the caller: the heartbeat must speak
            clock.looks()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("job: 0/10 steps") and lines[0].endswith("warming up")
    beats = [ln for ln in lines[1:-1] if "3/10 steps" in ln]
    assert [b.split(" | ")[1] for b in beats] == ["1 s", "2 s"], lines  # one line per silence
    assert "| done |" in lines[-1] and "epoch 1/2, loss 0.123" in lines[-1]


def test_advance_is_throttled_between_heartbeats(clock):
    out = io.StringIO()
    with Progress("job", 1000, stream=out, every_s=60, terminal=False) as p:
        for _ in range(1000):
            p.advance()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("job: 1000/1000 steps")  # only close()


def test_terminal_bar_renders_status():
    out = io.StringIO()
    with Progress("job", 4, stream=out, terminal=True) as p:
        p.note("phase one")
        p.advance(4, success=0.5)
    text = out.getvalue()
    assert "job: phase one" in text and "4/4" in text and "success 0.500" in text


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="total=-1"):
        Progress("job", -1, terminal=False)
    with pytest.raises(ValueError, match="every_s=0"):
        Progress("job", 1, every_s=0, terminal=False)


def test_silent_does_nothing(capsys):
    with Silent() as s:
        s.note("x")
        s.advance(3, a=1)
    assert capsys.readouterr() == ("", "")


def test_quiet_speaks_only_when_a_phase_runs_long(clock):
    out = io.StringIO()
    with Progress("train", 0, stream=out, every_s=0.05, quiet=True) as p:
        for name in ("a", "b", "c", "d"):  # quick phases (0.12 s in all): nothing to say
            p.note(name)
            clock.advance(0.03)
            clock.looks()
        assert out.getvalue() == ""
        p.note("slow phase")
        clock.advance(1.0)
        clock.looks()
        p.note(None)  # a phase that reports for itself: the watchdog pauses
        said = out.getvalue()
        clock.advance(1.0)
        clock.looks()
    lines = out.getvalue().splitlines()
    assert said == out.getvalue()  # nothing while paused, nothing at close
    assert len(lines) == 1 and "slow phase (still running)" in lines[0]
    assert lines[0].startswith("train: ") and "steps" not in lines[0]
