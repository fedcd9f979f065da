"""Servers the integration tests start as their users do: each in its own process group (so that
stopping it reaches its children: uvicorn, flow runs, engines), on 127.0.0.1 only, stopped by
the test that started it (tests/test_deployments.py, tests/test_ui.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    out = log.open("wb")
    # own session = own process group, so stopping it reaches its children (uvicorn, flow runs)
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)
        except ProcessLookupError:
            pass
    try:  # children left behind in the group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(log: Path, n: int = 4000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def wait_until_up(url: str, proc: subprocess.Popen, log: Path, within: float = 120,
                  healthy=lambda r: True) -> None:
    """Poll ``url`` until it answers 200 (and ``healthy(response)``) while ``proc`` runs."""
    deadline = time.monotonic() + within
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200 and healthy(r):
                    return
        except OSError:
            pass
        assert proc.poll() is None, f"{proc.args[:4]} exited:\n{tail(log)}"
        assert time.monotonic() < deadline, f"{url} not up in {within:.0f} s:\n{tail(log)}"
        time.sleep(0.5)


def server_env(home: Path, api: str, **extra: str) -> dict[str, str]:
    """The environment of a test's Prefect server, worker and CLI calls: its own PREFECT_HOME,
    no analytics or telemetry, one OpenMP thread, this checkout on the path."""
    return {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "2", "MLFLOW_DISABLE_TELEMETRY": "true",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **extra}


@contextlib.contextmanager
def prefect_server(home: Path, **env: str) -> Iterator[tuple[str, dict[str, str]]]:
    """``prefect server start`` on a free port of 127.0.0.1 with its own PREFECT_HOME (so its own
    SQLite database); yields (api url, env). ``env``: more settings (``PREFECT_UI_ENABLED=true``
    serves the UI at the api url without ``/api``)."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    full = server_env(home, api, **env)
    log = home / "server.log"
    proc = start([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                  "--port", str(port)], full, log)
    try:
        wait_until_up(f"{api}/health", proc, log, healthy=lambda r: json.load(r) is True)
        yield api, full
    finally:
        stop(proc, signal.SIGTERM)
