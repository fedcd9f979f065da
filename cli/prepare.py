"""What the ``trace`` commands do before their work: the work dir, the config checked before
anything slow is imported (a bad value exits with status 2 and one line), and Prefect started
with progress notes."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

import typer

from cli.output import console

from trace_rl.environ import resolve_workdir  # noqa: F401 (re-exported for the commands)

WORKDIR_HELP = (
    "Work dir holding trace.duckdb, the MLflow store and checkpoints (default: $TRACE_WORKDIR, else "
    "./trace_runs).")


@contextmanager
def prefect_ready() -> Iterator[None]:
    """Import the flow modules (the body) and start Prefect's temporary server, saying so at least
    every 10 s: on a loaded machine the imports (torch, Prefect, MLflow) and the first start of
    the server on a new PREFECT_HOME (it creates its database) each take up to a minute, which
    reads as a hang when nothing is printed. The flow then finds the server running (Prefect
    keeps one per process). With PREFECT_API_URL set, a real server is used and nothing starts."""
    from trace_rl.progress import Progress

    with Progress("trace", 0, every_s=10) as progress:
        progress.note("loading torch, Prefect and the flows")
        yield
        from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

        if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value():
            return
        from prefect.server.api.server import SubprocessASGIServer

        progress.note("starting Prefect's temporary server (the first start on a new "
                      "PREFECT_HOME creates its database)")
        SubprocessASGIServer().start()


def load_config_or_exit(config: Optional[Path], overrides: Optional[List[str]],
                        train_split: bool = True):
    """The validated config with its inputs checked (``train_split=False``: all but the
    training split); a bad value or file exits with status 2 and one line naming it, before
    anything slow is imported."""
    from trace_rl.config import load_config

    try:
        return load_config(config, overrides or [], train_split=train_split)
    except ValueError as exc:  # DatasetError included: it names the file and line
        console.print(f"trace: {exc}", style="red", markup=False)
        raise typer.Exit(2)


def with_data(overrides: Optional[List[str]], data: Optional[Path], field: str) -> List[str]:
    """``--data FILE`` as the override ``field=FILE`` (the file must exist)."""
    if data is None:
        return list(overrides or [])
    if not data.is_file():
        console.print(f"trace: --data {data}: no such file", style="red", markup=False)
        raise typer.Exit(2)
    return [*(overrides or []), f"{field}={data.resolve()}"]


def with_policy(overrides: Optional[List[str]], policy: str) -> List[str]:
    """The evaluated policy as the config's ``policy``, so it is checked like train's."""
    return [*(overrides or []), f"policy={policy}"]


def checked_eval_split(cfg, split: Optional[str]) -> str:
    """The split (or data file) ``trace eval`` reads, checked before anything slow starts: a
    split the family lacks or a bad file gives one line and exit status 2."""
    from trace_rl.config import check_split

    split = split or cfg.eval_split
    try:
        check_split(cfg, split, "--data" if Path(split).suffix else "eval split")
    except (ValueError, FileNotFoundError) as exc:  # DatasetError included: file and line
        console.print(f"trace: {exc}", style="red", markup=False)
        raise typer.Exit(2)
    return split
