"""The first ``trace train`` on a machine where Prefect never ran, with CPU-heavy work beside it.

Prefect's temporary server creates and migrates its database on a new ``PREFECT_HOME``; on a busy
2-core machine that overran Prefect's 20 s start-up limit and the README's main command failed
(issue: "The README's main command works the first time on a fresh machine"). This test runs the
real CLI entry point in a subprocess with a brand-new ``PREFECT_HOME``, cache and work dir while
busy-looping processes (two per core) compete for the CPU until its flow run has begun. It failed
on 105f60b (the commit before trace_rl/environ.py) and must pass now. CI also runs the README's main command itself beside the
test suite (.ci/run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The `trace` entry point's target (pyproject: trace = "cli.app:main") run from this checkout; an
# installed `trace` script would import whichever checkout the environment was installed from.
TRACE = [sys.executable, "-m", "cli"]
SHORT = ["engine=hf", "steps=1", "root_budget=4", "pool_size=4", "max_turns=2",
         "max_new_tokens=16", "plot_every=0", "eval_items=4",
         "eval_samples=2"]


FLOW_BEGAN = "Beginning flow run"
"""Prefect's first log line of a flow run: the server is up and has created the run."""


def _fresh_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect-home"),
               TRACE_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    # Nothing that would mask the CLI's own defaults: no server, no start-up limit of ours.
    for key in ("PREFECT_API_URL", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"):
        env.pop(key, None)
    return env


@pytest.mark.slow
@pytest.mark.timeout(1500)  # its `trace train` may take 1200 s (168 s here, idle, beside its burners)
def test_first_trace_train_on_a_fresh_prefect_home_beside_cpu_load(tiny_model_dir, tmp_path):
    """The burners run from the command's start until its flow run began: through the imports,
    the temporary server's start on the new PREFECT_HOME (its database created and migrated) and
    the flow run's creation, where the start-up limit bit. The training after that runs beside
    the rest of the suite only (CI runs the full default beside the suite, .ci/run)."""
    log = tmp_path / "trace-train.log"
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(2 * (os.cpu_count() or 1))]
    proc = None
    try:
        with log.open("w") as sink:
            proc = subprocess.Popen([*TRACE, "train", f"policy={tiny_model_dir}", *SHORT,
                                     "--workdir", str(tmp_path / "work")],
                                    cwd=tmp_path, env=_fresh_env(tmp_path), stdout=sink,
                                    stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 1200
        while proc.poll() is None and FLOW_BEGAN not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.5)
        under_load = FLOW_BEGAN in log.read_text(errors="replace")
        for b in burners:
            b.kill()
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in [*burners, proc]:
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.wait()
    out = log.read_text(errors="replace")
    assert under_load, out[-4000:]  # its flow run began while the burners ran
    assert proc.returncode == 0, out[-4000:]
    assert "Timed out while attempting to connect" not in out
    assert "Where to look" in out and (tmp_path / "work" / "trace.duckdb").is_file()
    # It said what it was doing: the start-up, then what the run achieved.
    assert "trace: " in out and "starting Prefect's temporary server" in out
    assert "held-out accuracy" in out and "generated tokens" in out


@pytest.mark.slow  # two subprocesses importing vLLM (20 s here)
@pytest.mark.timeout(700)  # room for both subprocesses' own 300 s limits
def test_vllm_step_limit_is_the_one_vllm_reads():
    """At load 35-40 a fresh-clone `trace train` died with EngineDeadError: vLLM's worker took
    longer than vLLM's 300 s per model step. ``environ.apply`` raises that limit unless the user
    set it; this checks that vLLM itself reads the raised value (a renamed variable would not)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"}
    code = ("from trace_rl import environ; environ.apply(); import vllm.envs as e; "
            "print(e.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)")
    out = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=300, check=True).stdout
    from trace_rl.environ import VLLM_STEP_TIMEOUT_S
    assert int(out.strip().splitlines()[-1]) == VLLM_STEP_TIMEOUT_S > 300
    mine = subprocess.run([sys.executable, "-c", code],
                          env={**env, "PYTHONPATH": str(REPO),
                               "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "42"},
                          capture_output=True, text=True, timeout=300, check=True).stdout
    assert mine.strip().splitlines()[-1] == "42"  # the user's value wins
