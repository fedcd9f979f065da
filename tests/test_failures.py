"""Failures recorded truthfully, and crash consistency.

A failed run (in the bootstrap, in a phase, on a full disk) marks its running step and the run
failed in DuckDB and MLflow, re-raises the original error (a secondary error while recording it
is logged, never raised in its place), and a re-run resumes after the last complete step. The
full disk is real: a small tmpfs mounted as the work dir and filled while the run trains.
The kill harness SIGKILLs a short run at 10 seeded random points, resumes it each time, and
compares the finished run with an uninterrupted one node by node.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trace_rl.storage.store import TreeStore

REPO = Path(__file__).resolve().parents[1]
TINY = {"engine": "hf", "steps": 2, "root_budget": 4, "pool_size": 4, "max_turns": 2,
        "max_new_tokens": 16, "multiplier": 1, "family": "synth_arith", "difficulty": 1,
        "plot_every": 1, "eval_items": 4, "eval_samples": 2}
# Train flows with failures injected: 10-70 s each here at load 4, the first with the harness.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_harness"), pytest.mark.timeout(900)]


def _env(api_url: str | None = None) -> dict[str, str]:
    env = dict(os.environ, MLFLOW_DISABLE_TELEMETRY="true", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    env.pop("PREFECT_API_URL", None)
    if api_url:  # the session's test server: children skip starting their own (~8 s each)
        env["PREFECT_API_URL"] = api_url
    return env


def _spawn_train(config: dict, workdir: Path, log: Path, api_url: str | None = None) -> subprocess.Popen:
    code = ("import json, sys\nfrom flows.train import train\n"
            "if __name__ == '__main__':\n"
            "    train(config=json.loads(sys.argv[1]), workdir=sys.argv[2])\n")
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(config), str(workdir)],
                            cwd=REPO, env=_env(api_url), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _api_url() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def _mlflow_status(workdir: Path, mlflow_run_id: str) -> str:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}").get_run(mlflow_run_id).info.status


def _statuses(store: TreeStore, run_id: str) -> tuple[str, dict[int, str]]:
    run = store.get_run(run_id)
    steps = store.query("SELECT step, status FROM steps WHERE run_id = $r ORDER BY step",
                        {"r": run_id}).to_pylist()
    return run["status"], {r["step"]: r["status"] for r in steps}


# ---------------------------------------------------------------- failures, in-process


def test_bootstrap_failure_marks_run_failed_then_resume_completes(tiny_model_dir, tmp_path,
                                                                  monkeypatch):
    """The bootstrap sits inside the failure handling: its error is the flow's error, the run
    is failed in DuckDB and MLflow, and a later run with a working policy finishes it."""
    import flows.bootstrap
    from flows.train import train

    def broken(*args, **kwargs):
        raise RuntimeError("bootstrap broke: no such family data")

    monkeypatch.setattr(flows.bootstrap, "bootstrap", broken)
    cfg = {**TINY, "policy": "tiny", "steps": 1, "run_id": "boot"}
    with pytest.raises(RuntimeError, match="bootstrap broke"):
        train(config=cfg, workdir=str(tmp_path))
    store = TreeStore(tmp_path, create=False)
    run = store.get_run("boot")
    assert _statuses(store, "boot") == ("failed", {})
    assert _mlflow_status(tmp_path, run["mlflow_run_id"]) == "FAILED"
    monkeypatch.setattr(flows.bootstrap, "bootstrap", lambda *a, **k: str(tiny_model_dir))
    summary = train(config=cfg, workdir=str(tmp_path))
    assert summary["steps_run"] == 1 and summary["mlflow_run_id"] == run["mlflow_run_id"]
    assert _statuses(store, "boot") == ("complete", {0: "complete"})
    assert _mlflow_status(tmp_path, run["mlflow_run_id"]) == "FINISHED"


def test_original_error_wins_over_a_failing_handler(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """ENOSPC raised in step 1, and the store refusing the run's status too (as DuckDB did on
    the full disk): the flow raises the ENOSPC, the step is still recorded failed, MLflow says
    FAILED, the secondary error is logged after the original one. The resume runs step 1 only."""
    import flows.train as train_mod
    from flows.train import train

    real_step, real_set_run = train_mod.run_step, TreeStore.set_run

    def step_fails(cfg, at, *args):
        if at.step == 1:
            raise OSError(errno.ENOSPC, "No space left on device", "checkpoints/policy-step0001")
        return real_step(cfg, at, *args)

    def set_run_fails(self, run_id, **kwargs):
        if kwargs.get("status") == "failed":
            raise OSError(errno.ENOSPC, "No space left on device (DuckDB WAL)")
        return real_set_run(self, run_id, **kwargs)

    monkeypatch.setattr(train_mod, "run_step", step_fails)
    monkeypatch.setattr(TreeStore, "set_run", set_run_fails)
    cfg = {**TINY, "policy": str(tiny_model_dir), "run_id": "enospc"}
    with pytest.raises(OSError) as err:
        train(config=cfg, workdir=str(tmp_path))
    assert err.value.errno == errno.ENOSPC and "policy-step0001" in str(err.value)
    store = TreeStore(tmp_path, create=False)
    assert _statuses(store, "enospc") == ("running", {0: "complete", 1: "failed"})
    mlflow_run_id = store.get_run("enospc")["mlflow_run_id"]
    assert _mlflow_status(tmp_path, mlflow_run_id) == "FAILED"
    text = caplog.text
    first, secondary = text.find("failed at step 1: OSError"), text.find("DuckDB WAL")
    assert 0 <= first < secondary, text[-3000:]

    monkeypatch.setattr(train_mod, "run_step", real_step)
    monkeypatch.setattr(TreeStore, "set_run", real_set_run)
    summary = train(config=cfg, workdir=str(tmp_path))
    assert summary["steps_run"] == 1
    assert _statuses(store, "enospc") == ("complete", {0: "complete", 1: "complete"})
    assert _mlflow_status(tmp_path, mlflow_run_id) == "FINISHED"


def test_a_step_mark_written_but_not_published_is_still_marked_failed(tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    """The disk fills between writing step 1's "running" mark and publishing it (the copy for
    readers fails half-written, as on the real full disk below when it fills between steps):
    the step ends "failed", not "running", in what readers see, the original ENOSPC is raised,
    and no half-written copy is left holding the space."""
    import trace_rl.storage.published as published
    from flows.train import train

    real_copy, real_mark = published.shutil.copyfile, TreeStore.mark_step
    armed = []

    def mark(self, run_id, step, status, metrics=None, then_running=None):
        if (step, status) == (1, "running") or then_running == 1:  # with step 0's end
            armed.append(threading.get_ident())  # this mark's publish, in this thread, fails
        return real_mark(self, run_id, step, status, metrics, then_running)

    def copy_fails_once(src, dst, *args, **kwargs):
        # Only the marking thread's copy: the publish timer or the logging thread may publish
        # deferred writes in between (CI once saw one take the failure, and the mark publish).
        if armed and armed[-1] == threading.get_ident():
            armed.pop()
            Path(dst).write_bytes(b"\0" * 4096)  # what the copy wrote before the disk filled
            raise OSError(errno.ENOSPC, "No space left on device", str(dst))
        return real_copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(TreeStore, "mark_step", mark)
    monkeypatch.setattr(published.shutil, "copyfile", copy_fails_once)
    cfg = {**TINY, "policy": str(tiny_model_dir), "eval_items": 0, "run_id": "unpublished"}
    with pytest.raises(OSError) as err:
        train(config=cfg, workdir=str(tmp_path))
    assert err.value.errno == errno.ENOSPC
    assert _statuses(TreeStore(tmp_path, create=False), "unpublished") == \
        ("failed", {0: "complete", 1: "failed"})
    assert not list(tmp_path.glob(".*.publish-*"))


# ---------------------------------------------------------------- a real full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs (the tiny run needs ~20 MB for two steps); unmounted afterwards."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64M", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(disk: Path) -> Path:
    """Write zeros until the file system refuses: a real ENOSPC for everything after."""
    ballast = disk / "ballast"
    chunk = bytes(1 << 16)
    # Unbuffered: a buffered file still holds the refused bytes and fails again on close.
    with ballast.open("wb", buffering=0) as fh:
        try:
            while True:
                fh.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return ballast


def test_full_disk_marks_failed_and_resumes_after_space_is_freed(tiny_model_dir, small_disk,
                                                                 tmp_path):
    cfg = {**TINY, "policy": str(tiny_model_dir), "steps": 3, "run_id": "disk"}
    wd = small_disk / "wd"
    first = _spawn_train(cfg, wd, tmp_path / "first.log", _api_url())
    ballast = None
    try:
        deadline = time.time() + 300
        while time.time() < deadline and first.poll() is None:
            if (wd / "trace.duckdb").exists():
                store = TreeStore(wd, create=False, read_timeout_s=60)
                if store.last_complete_step("disk") == 0:
                    ballast = _fill(small_disk)
                    break
            time.sleep(0.1)
        assert ballast is not None, (tmp_path / "first.log").read_text()[-3000:]
        rc = first.wait(timeout=300)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    log = (tmp_path / "first.log").read_text()
    assert rc != 0, log[-3000:]
    assert "No space left on device" in log or "disk is full" in log, log[-3000:]
    status, steps = _statuses(store, "disk")
    assert status == "failed" and steps[0] == "complete", (status, steps, log[-3000:])
    assert set(steps.values()) <= {"complete", "failed"}  # nothing left "running"
    failed_at = [s for s, v in steps.items() if v == "failed"]
    mlflow_run_id = store.get_run("disk")["mlflow_run_id"]
    assert _mlflow_status(wd, mlflow_run_id) == "FAILED"

    ballast.unlink()
    second = _spawn_train(cfg, wd, tmp_path / "second.log", _api_url())
    assert second.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert _statuses(store, "disk") == ("complete", {0: "complete", 1: "complete", 2: "complete"})
    assert _mlflow_status(wd, mlflow_run_id) == "FINISHED"
    leaves = store.query("SELECT step, count(*) AS n FROM nodes WHERE is_leaf GROUP BY step "
                         "ORDER BY step").to_pylist()
    per_step = TINY["root_budget"] * (1 + TINY["multiplier"])
    assert leaves == [{"step": s, "n": per_step} for s in range(3)]
    print(f"full disk: failed at step(s) {failed_at}; resumed and completed")


# ---------------------------------------------------------------- the kill harness

NODE_COLUMNS = ("node_id", "parent_id", "tree_id", "step", "level", "depth", "is_leaf", "reward",
                "text", "action_json", "observation", "allocated_k", "n_leaves", "value")
"""What must match node by node: the trees (ids, parents, shape), what was generated and what
it earned, the allocation and the backed-up values."""
FLOAT_COLUMNS = ("predicted_v", "advantage")
"""Computed by the predictor and the estimators; compared to 1e-6."""
PROGRESS = "Finished in state Completed()"  # a phase run for real (a cache hit says Cached)


def _nodes(workdir: Path) -> dict[str, dict]:
    store = TreeStore(workdir, create=False)
    cols = ", ".join(NODE_COLUMNS + FLOAT_COLUMNS)
    return {r["node_id"]: r for r in store.query(f"SELECT {cols} FROM nodes ORDER BY node_id").to_pylist()}


def _kill_after(proc: subprocess.Popen, log: Path, phases: int, delay_s: float,
                timeout_s: float = 300) -> str:
    """SIGKILL ``proc``'s process group ``delay_s`` after its ``phases``-th newly finished phase
    (0: after the flow run began); return what the log last said, or 'finished' if it ended."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            return "finished"
        text = log.read_text()
        if "Beginning flow run" in text and text.count(PROGRESS) >= phases:
            break
        time.sleep(0.02)
    time.sleep(delay_s)
    if proc.poll() is not None:
        return "finished"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = [ln for ln in log.read_text().splitlines() if "Task run '" in ln]
    return done[-1].split("Task run '")[1].split("'")[0] if done else "start-up"


@pytest.mark.timeout(1800)  # eleven `trace train` processes: 338 s idle, 834 s at load 14-45
def test_sigkill_at_ten_random_points_then_resume_matches_uninterrupted_run(tiny_model_dir,
                                                                            tmp_path):
    """Crash consistency as a test: a 3-step run SIGKILLed at 10 seeded random points (after
    0-4 newly finished phases, plus 0-0.8 s), resumed after each, ends with the same nodes (ids,
    parents, rewards, text, allocations, values) and steps as an uninterrupted run."""
    cfg = {**TINY, "policy": str(tiny_model_dir), "steps": 3, "run_id": "crash"}
    api = _api_url()
    t0 = time.perf_counter()
    ref = _spawn_train(cfg, tmp_path / "ref", tmp_path / "ref.log", api)
    assert ref.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    t_ref = time.perf_counter() - t0

    rng = random.Random(24)
    wd, points = tmp_path / "killed", []
    for k in range(10):
        phases, delay = rng.randint(0, 4), round(rng.uniform(0.0, 0.8), 2)
        log = tmp_path / f"kill{k}.log"
        proc = _spawn_train(cfg, wd, log, api)
        last = _kill_after(proc, log, phases, delay)
        complete = (TreeStore(wd, create=False).last_complete_step("crash")
                    if (wd / "trace.duckdb").exists() else None)
        points.append({"kill": k, "after_phases": phases, "delay_s": delay,
                       "last_finished": last, "last_complete_step": complete})
    assert all(p["last_finished"] != "finished" for p in points), points
    final = _spawn_train(cfg, wd, tmp_path / "final.log", api)
    assert final.wait(timeout=300) == 0, (tmp_path / "final.log").read_text()[-3000:]
    wall = time.perf_counter() - t0

    want, got = _nodes(tmp_path / "ref"), _nodes(wd)
    assert sorted(got) == sorted(want)  # same node ids: nothing lost, nothing duplicated
    for node_id, row in want.items():
        for col in NODE_COLUMNS:
            assert got[node_id][col] == row[col], (node_id, col, got[node_id][col], row[col])
        for col in FLOAT_COLUMNS:
            a, b = got[node_id][col], row[col]
            assert (a is None) == (b is None) and (a is None or abs(a - b) <= 1e-6), (node_id, col, a, b)
    steps_sql = "SELECT step, status FROM steps WHERE run_id = 'crash' ORDER BY step"
    assert (TreeStore(wd, create=False).query(steps_sql).to_pylist()
            == TreeStore(tmp_path / "ref", create=False).query(steps_sql).to_pylist()
            == [{"step": s, "status": "complete"} for s in range(3)])
    assert _statuses(TreeStore(wd, create=False), "crash")[0] == "complete"
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{wd / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "rollout/leaves")
    assert sorted(m.step for m in history) == [0, 1, 2]  # each step logged once
    report = {"reference_s": round(t_ref, 1), "harness_s": round(wall, 1),
              "nodes": len(want), "points": points}
    (tmp_path / "kill_harness.json").write_text(json.dumps(report, indent=1))
    print("kill harness:", json.dumps(report))


def test_interrupt_marks_step_failed_and_run_killed(tiny_model_dir, tmp_path, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) in a step: the step is failed, the run and its MLflow run
    killed, the interrupt propagates."""
    import flows.train as train_mod
    from flows.train import train

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "run_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(config={**TINY, "policy": str(tiny_model_dir), "run_id": "ctrlc"}, workdir=str(tmp_path))
    store = TreeStore(tmp_path, create=False)
    assert _statuses(store, "ctrlc") == ("killed", {0: "failed"})
    assert _mlflow_status(tmp_path, store.get_run("ctrlc")["mlflow_run_id"]) == "KILLED"
