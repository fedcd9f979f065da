"""A step's MLflow logging off its critical path: the background thread and the journal that
keeps a job until it has run (``trace_rl.storage.background``, ``tasks.track.log_step``)."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tasks import track
from tasks.runtime import StepRef
from trace_rl.storage import background


def test_jobs_run_in_order_off_the_callers_thread_and_drain_waits(tmp_path):
    release = threading.Event()
    seen = []

    def job(i):
        def run():
            if i == 0:
                release.wait(10)
            seen.append((i, threading.current_thread() is not threading.main_thread()))
        return run

    for i in range(3):
        background.submit(tmp_path, job(i))
    assert seen == [] and background.pending(tmp_path) == 3  # the caller did not wait
    release.set()
    background.drain(tmp_path)
    assert seen == [(0, True), (1, True), (2, True)] and background.pending(tmp_path) == 0
    background.drain(tmp_path / "never-used")  # nothing submitted: returns


def test_jobs_submitted_in_a_deferred_block_start_when_it_ends(tmp_path):
    """The train flow's step: its logging job waits for the step's end mark; a job submitted
    before the block runs meanwhile; a nested block changes nothing; drain inside ends the wait."""
    ran = []
    earlier = threading.Event()
    background.submit(tmp_path, lambda: (earlier.wait(10), ran.append("before")))
    with background.deferred(tmp_path):
        background.submit(tmp_path, lambda: ran.append("inside"))
        with background.deferred(tmp_path):
            background.submit(tmp_path, lambda: ran.append("nested"))
        earlier.set()
        deadline = time.monotonic() + 10
        while ran != ["before"] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # time enough for a job that would not wait
        assert ran == ["before"] and background.pending(tmp_path) == 2
    background.drain(tmp_path)
    assert ran == ["before", "inside", "nested"]
    with background.deferred(tmp_path):
        background.submit(tmp_path, lambda: ran.append("drained"))
        background.drain(tmp_path)  # would otherwise wait for the block's end: forever
        assert ran[-1] == "drained"


def test_a_failed_job_fails_the_next_drain_or_submit_once(tmp_path):
    ran = []
    gate = threading.Event()

    def boom():
        gate.wait(10)
        raise RuntimeError("disk full")

    background.submit(tmp_path, boom)
    background.submit(tmp_path, lambda: ran.append(1))  # queued behind boom, skipped once it fails
    gate.set()
    with pytest.raises(RuntimeError, match="disk full"):
        background.drain(tmp_path)
    assert ran == []
    background.drain(tmp_path)  # seen once
    background.submit(tmp_path, boom)
    while background.pending(tmp_path):  # it has failed, and nobody has drained
        threading.Event().wait(0.01)
    with pytest.raises(RuntimeError, match="disk full"):
        background.submit(tmp_path, lambda: ran.append(2))
    background.submit(tmp_path, lambda: ran.append(3))
    background.drain(tmp_path)
    assert ran == [3]


ARGS = dict(mlflow_run_id="m1", metrics={"rollout/reward_mean": 0.5}, plot=False,
            register_policy=True)


def test_log_step_journals_each_job_until_it_has_run(tmp_path, monkeypatch):
    """The task returns before the job runs; the job's journal file goes once it has run; a
    job that failed stays in the journal and runs again before the next step's (a resumed run
    after a crash does the same with what the killed process left)."""
    gate = threading.Event()
    calls = []

    def fake(**job):
        gate.wait(10)
        if job["step"] == 1 and not any(c["step"] == 1 for c in calls):
            calls.append({"step": 1, "failed": True})
            raise OSError("MLflow store unreachable")
        calls.append(job)

    monkeypatch.setattr(track, "log_step_now", fake)
    monkeypatch.setattr(track, "tree_metrics", lambda at, trees: {"tree/trees": 2.0})
    workdir = str(tmp_path)
    assert track.log_step.fn(StepRef(workdir, "run-a", 0), **ARGS) == \
        {"tree/trees": 2.0, "rollout/reward_mean": 0.5}  # the step's figures join its metrics
    journal = tmp_path / track.PENDING
    assert [p.name for p in journal.iterdir()] == ["run-a-step-000000.json"]
    assert calls == []  # handed over, not run
    gate.set()
    background.drain(workdir)
    assert [c["step"] for c in calls] == [0] and not list(journal.iterdir())
    assert calls[0]["metrics"] == {"tree/trees": 2.0, "rollout/reward_mean": 0.5}
    assert calls[0]["workdir"] == workdir

    track.log_step.fn(StepRef(workdir, "run-a", 1), **ARGS)
    with pytest.raises(OSError, match="unreachable"):
        background.drain(workdir)
    assert [p.name for p in journal.iterdir()] == ["run-a-step-000001.json"]
    track.log_step.fn(StepRef(workdir, "run-a", 2), **ARGS)  # step 1's job is replayed first, in this thread
    background.drain(workdir)
    assert [c["step"] for c in calls] == [0, 1, 1, 2] and not list(journal.iterdir())


def test_a_journal_entry_a_killed_process_left_is_run_once(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(track, "log_step_now", lambda **job: calls.append(job["step"]))
    journal = tmp_path / track.PENDING
    journal.mkdir()
    for step in (4, 3):
        (journal / f"run-a-step-{step:06d}.json").write_text(
            json.dumps({"workdir": str(tmp_path), "run_id": "run-a", "step": step,
                        "policy_dir": "p", "predictor_file": "q", **ARGS}))
    (journal / "run-b-step-000001.json").write_text("{}")  # another run's: not this one's
    assert track.replay_pending(str(tmp_path), "run-a") == [3, 4]
    assert calls == [3, 4] and [p.name for p in journal.iterdir()] == ["run-b-step-000001.json"]
    assert track.replay_pending(str(tmp_path), "run-a") == []


def test_a_failing_run_is_closed_even_when_its_logging_failed(tmp_path):
    """``Tracker.end``: FINISHED raises the logging's error (the run is not closed), FAILED
    closes the run with a warning."""
    from trace_rl.storage.tracking import Tracker

    tracker = Tracker(tmp_path)
    run = tracker.start_or_resume("run-x")

    def boom():
        raise OSError("No space left on device")

    background.submit(tmp_path, boom)
    with pytest.raises(OSError, match="No space"):
        tracker.end("FINISHED")
    assert tracker.client.get_run(run).info.status == "RUNNING"
    background.submit(tmp_path, boom)
    with pytest.warns(UserWarning, match="logging of the failed run also failed"):
        tracker.end("FAILED")
    assert tracker.client.get_run(run).info.status == "FAILED"
