"""Process-wide defaults that TRACE sets before Prefect, MLflow or tokenizers are imported, and
the machine-wide cache folder.

``apply()`` runs first in every package that imports Prefect (``flows``, ``tasks``,
``deployments``, ``bench``) and in the ``trace`` CLI. It only fills what the user left unset: a
variable already in the environment always wins.

Why a longer start-up limit for Prefect's temporary server, and not a server the CLI starts and
waits for: the temporary (ephemeral) server is the embedded default that needs nothing from the
user, no port to choose, no process left behind after a kill; its one failure on a fresh machine
is Prefect's own 20 s start-up limit. A first start on a new ``PREFECT_HOME`` creates and migrates
its SQLite database, measured on this project's 2-core machine at 12 s idle and 33 s with three
CPU-bound processes beside it (docs/results.md, "First run on a fresh machine"), so the default
limit turned a first ``trace train`` into a coin flip. A server managed by the CLI would need its
own life cycle (orphaned by a SIGKILL, port races between concurrent runs) for no gain over
waiting longer. The limit only bounds how long a start-up that is really broken takes to report;
set ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` (or ``PREFECT_API_URL`` for a real
server) to choose otherwise. Prefect reads its settings when it is imported, so this must run
before ``import prefect``.
"""

from __future__ import annotations

import os
from pathlib import Path

PREFECT_STARTUP_TIMEOUT_S = 300
"""Seconds Prefect may take to start its temporary server (Prefect's own default is 20)."""

DEFAULT_WORKDIR = "trace_runs"
"""Where ``trace`` keeps the DuckDB file, the MLflow store and checkpoints unless told otherwise."""

VLLM_STEP_TIMEOUT_S = 3600
"""Seconds one vLLM model step may take before the engine is declared dead (vLLM's default 300)."""

DEFAULTS = {
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(PREFECT_STARTUP_TIMEOUT_S),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",  # offline and quiet
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "TOKENIZERS_PARALLELISM": "false",  # tokenizers warns and deadlocks after fork otherwise
    # transformers draws a "Loading weights" / "Writing model shards" bar at every save and load,
    # dozens per run (each checkpoint, each weight sync); the run reports its own progress.
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    # vLLM's engine core gives its worker process 300 s per model step and then declares the
    # engine dead (EngineDeadError). On a 2-core machine at load 35-40 the tiny policy's first
    # step of a fresh-clone `trace train` took longer than that (2026-12-01): a slow step on a
    # busy shared CPU is not a hung worker, so the run waits for it.
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": str(VLLM_STEP_TIMEOUT_S),
    # vLLM's first LLM() in a process applies its own logging.config.dictConfig, which flushes
    # every existing handler while holding the logging lock. Inside a Prefect task one of them is
    # Prefect's API log handler, whose flush waits for a thread that needs that lock: the first
    # vLLM engine of a `trace train` deadlocked there on a fresh clone (2026-12-01). vLLM's
    # warnings and errors still reach stderr through Python's default handling.
    "VLLM_CONFIGURE_LOGGING": "0",
}


def resolve_workdir(workdir: str | None) -> str:
    """The work dir every command and flow uses: ``workdir``, else $TRACE_WORKDIR, else
    ./trace_runs, as an absolute path (nothing is created: ``flows.common.prepare_workdir``)."""
    return str(Path(workdir or os.environ.get("TRACE_WORKDIR", DEFAULT_WORKDIR)).resolve())


def cache_dir() -> Path:
    """Where TRACE keeps what every work dir on this machine may share (bootstrapped policies):
    ``$TRACE_CACHE_DIR``, else ``$XDG_CACHE_HOME/trace-rl``, else ``~/.cache/trace-rl``."""
    if os.environ.get("TRACE_CACHE_DIR"):
        return Path(os.environ["TRACE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trace-rl"


def torch_threads() -> int:
    """Torch threads for a trainer or engine process: ``$TRACE_TORCH_THREADS``, default 1 (a
    positive integer; anything else is a ``ValueError`` naming the variable)."""
    raw = os.environ.get("TRACE_TORCH_THREADS", "1")
    if not raw.strip().isdecimal() or int(raw) < 1:
        raise ValueError(f"TRACE_TORCH_THREADS={raw!r}: expected a positive integer (torch threads)")
    return int(raw)


def apply() -> None:
    """Set each of ``DEFAULTS`` that the environment does not already hold."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
