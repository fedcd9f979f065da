"""trace_rl.progress: plain lines with a heartbeat off a terminal, a rich bar on one."""

from __future__ import annotations

import io
import time

import pytest

from trace_rl.progress import Progress, Silent


def test_plain_lines_report_phases_fields_and_a_heartbeat():
    out = io.StringIO()
    with Progress("job", 10, stream=out, every_s=0.2, terminal=False) as p:
        p.note("warming up")
        p.advance(3, epoch="1/2", loss=0.123456)
        time.sleep(0.7)  # no report from the caller: the heartbeat must speak
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("job: 0/10 steps") and lines[0].endswith("warming up")
    beats = [ln for ln in lines[1:-1] if "3/10 steps" in ln]
    assert len(beats) >= 2, lines  # at least one line per 0.2 s while the caller was silent
    assert "| done |" in lines[-1] and "epoch 1/2, loss 0.123" in lines[-1]


def test_advance_is_throttled_between_heartbeats():
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


def test_quiet_speaks_only_when_a_phase_runs_long():
    out = io.StringIO()
    with Progress("train", 0, stream=out, every_s=0.3, quiet=True) as p:
        for name in ("a", "b", "c", "d"):  # quick phases: nothing to say
            p.note(name)
            time.sleep(0.1)
        assert out.getvalue() == ""
        p.note("slow phase")
        time.sleep(0.8)
        p.note(None)  # a phase that reports for itself: the watchdog pauses
        said = out.getvalue()
        time.sleep(0.7)
    lines = out.getvalue().splitlines()
    assert said == out.getvalue()  # nothing while paused, nothing at close
    assert 1 <= len(lines) <= 3 and all("slow phase (still running)" in ln for ln in lines)
    assert lines[0].startswith("train: ") and "steps" not in lines[0]
