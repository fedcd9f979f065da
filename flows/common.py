"""What every flow does first: resolve the work dir and point task results and cache records at
it, so a re-run in the same work dir finds its finished phases."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import os
import threading
from concurrent.futures import Future
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from prefect import Task
from prefect.filesystems import LocalFileSystem

from tasks.runtime import PHASE_KEY, Paths, PhaseKey
from trace_rl.environ import resolve_workdir
from trace_rl.session import Session
from trace_rl.storage.published import released


def _release_engines(flow: Any, flow_run: Any, state: Any) -> None:
    """A flow run's last act when nothing outside it keeps the engines (a Prefect worker's
    flow-run process, a test): shut its rollout engines down, whatever state it ended in."""
    from trace_rl.engines.lifecycle import close_all, in_scope

    if not in_scope():
        close_all()


RELEASES_ENGINES: Mapping[str, Any] = MappingProxyType({hook: (_release_engines,) for hook in (
    "on_completion", "on_failure", "on_crashed", "on_cancellation")})
"""``@flow(..., **RELEASES_ENGINES)``: the flow run shuts its engines down when it ends, unless
it runs inside ``trace`` or a benchmark (an ``engine_scope``), which keeps them for its next flow
and closes them itself (``trace_rl.engines.lifecycle``)."""


def _name_subflow_task_run(flow: Any, flow_run: Any, state: Any) -> None:
    """A subflow's run, once named: its tracking task run in the parent flow run (which Prefect
    names ``<flow>-<n>``, e.g. ``bootstrap-policy-0``) gets the same name."""
    if flow_run.parent_task_run_id is None:
        return
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.set_task_run_name(flow_run.parent_task_run_id, flow_run.name)


NAMES_ITS_TASK_RUN: Mapping[str, Any] = MappingProxyType({"on_running": (_name_subflow_task_run,)})
"""``@flow(..., **NAMES_ITS_TASK_RUN)`` on a flow that runs as a subflow: the task run standing
for it in the parent's Task Runs list carries the subflow run's readable name."""


def prepare_workdir(workdir: str | None) -> str:
    """The work dir (``trace_rl.environ.resolve_workdir``), created, its result records pointed
    at it (``relocate_results``): what a flow does before it writes there."""
    path = Path(resolve_workdir(workdir))
    path.mkdir(parents=True, exist_ok=True)
    relocate_results(path)
    return str(path)


def relocate_results(workdir: str | Path) -> int:
    """Point the work dir's Prefect result records at this work dir if it was copied or moved.

    A record (``prefect-results/keys/<cache key>``, JSON) names its result file by absolute path,
    so in a copied work dir it would name the original's file (outside the copy's result
    storage: Prefect refuses to read it, a cache miss) or a file that is gone. The file
    ``prefect-results/.root`` remembers where the records were written; when it differs from
    where they are now, each record's path is rewritten to the same place under this work dir.
    Returns the number of records rewritten."""
    results = Paths(Path(workdir)).results
    keys, marker = results / "keys", results / ".root"
    here = str(results.resolve())
    if not keys.is_dir() or marker.exists() and marker.read_text() == here:
        return 0
    moved = 0
    for record in keys.iterdir():
        if record.name.endswith(".relocating"):  # left by a rewrite that was killed
            record.unlink(missing_ok=True)
            continue
        try:
            data = json.loads(record.read_bytes())
        except (OSError, ValueError):
            continue  # not a result record (a lock file, a partial write): Prefect's business
        old = data.get("storage_key") if isinstance(data, dict) else None
        if not isinstance(old, str) or not Path(old).is_absolute():
            continue
        parts = Path(old).parts
        if results.name not in parts[:-1] or Path(old).parent == Path(here):
            continue
        at = len(parts) - 1 - parts[::-1].index(results.name)
        data["storage_key"] = str(Path(here).joinpath(*parts[at + 1:]))
        tmp = record.with_name(record.name + ".relocating")
        tmp.write_text(json.dumps(data))
        tmp.replace(record)
        moved += 1
    marker.write_text(here)
    return moved


class ResultFolder(LocalFileSystem):
    """Prefect's local file system for a work dir's cache records, its paths joined without
    asking the file system: Prefect's own resolves the folder and the file (``Path.resolve``, a
    system call per component) at each look-up and write of a record, ~0.13 s of a default
    step here. ``basepath`` is already resolved (``bind``); a path outside it is refused, as
    Prefect's does. (Prefect takes only saved blocks as result storage, so the results
    themselves stay on its own.) Its own block type name, so that it does not take over the
    dispatch key of Prefect's ``LocalFileSystem`` (a warning at each import, and any saved local
    file system block loaded as this class)."""

    _block_type_name = "TRACE result folder"

    def _resolve_path(self, path: str | None) -> Path:
        base = Path(self.basepath)
        if path is None:
            return base
        resolved = Path(os.path.normpath(base / Path(path).expanduser()))
        if base != resolved and base not in resolved.parents:
            raise ValueError(f"Provided path {resolved} is outside of the base path {base}.")
        return resolved


def bind(task: Task, workdir: str) -> Task:
    """The task with its results and cache records stored under the work dir (keys of paths
    in it relative to it, so that a copied or moved work dir finds them)."""
    if not isinstance(task.cache_policy, PhaseKey):
        return task
    resolved = Path(workdir).resolve()
    results = Paths(resolved).results
    policy = dataclasses.replace(PHASE_KEY, workdir=str(resolved))
    return task.with_options(result_storage=results,  # a Path: Prefect's local file system
                             persist_result=True, cache_policy=policy.configure(
                                 key_storage=ResultFolder(basepath=str(results / "keys"))))


KEEP_CONNECTION = frozenset({
    "allocate-roots", "expand-roots", "allocate-prefixes", "expand-prefixes", "tree-advantages",
    "fit-predictor", "log-step"})
"""Phases that use the store briefly, not at all, or generate for about a second (the
expansions): inside a ``held`` block of the store (the train flow's steps), they keep its one
connection open for the next, and the step's marks share it (the logging thread's reads and the
publish timer run between their uses, on it). Every other phase (the update, the sync,
evaluation, the run's summary) runs in a ``released`` stretch: the connection stays open through
it unless another process (a retrain or evaluate flow of the work dir) asks for the file, and is
then closed within 50 ms, so that the file is not held from others while a phase runs long."""


class Phases:
    """A flow's tasks, looked up by name in the task modules (``phases.allocate_roots``), each bound
    to the work dir once per session (``bind``: results and cache records kept there, so a re-run
    finds its finished phases) and its runs named by step, level and wave (``tasks.track.named``).
    Each call runs in the flow's ``session`` (``trace_rl.session.Session``: the engines, stores,
    environments and items the tasks share; default the current one), made current for the
    task, which finds it with ``Session.current()``: a session is no task input, so it never
    enters a cache key. With a watch, each call first names its phase there (after ``where``),
    so a phase that runs long (an update on a busy machine) is reported while it runs."""

    def __init__(self, workdir: str, watch: Any = None, where: str = "",
                 session: Session | None = None):
        self._workdir, self._watch, self._where = workdir, watch, where
        self.session = session or Session.current()

    def __getattr__(self, name: str) -> Any:
        from tasks import evaluate, expand, learn, prefixes, roots, track

        found = [getattr(m, name) for m in (roots, prefixes, expand, learn, track, evaluate)
                 if isinstance(getattr(m, name, None), Task)]
        if not found:  # an AttributeError, so hasattr() and copy() see a missing attribute
            raise AttributeError(f"Phases: no task named {name!r} in tasks.roots, prefixes, "
                                 "expand, learn, track or evaluate")
        task = found[0]
        # bound once per session and work dir (``with_options`` costs ~20-40 ms a task here)
        run = self.session.memo("bound-task", (task, self._workdir),
                                lambda: bind(track.named(task), self._workdir), maxsize=64)
        watch, phase = self._watch, f"{self._where}{task.name}"
        keeps = task.name in KEEP_CONNECTION

        def bound(*args: Any, **kwargs: Any) -> Any:
            if watch is not None:
                watch.note(phase)
            with self.session.use():
                if keeps:
                    return run(*args, **kwargs)
                with released():
                    return run(*args, **kwargs)
        setattr(self, name, bound)  # looked up once
        return bound

    def beside(self, name: str, *args: Any, **kwargs: Any) -> "Future[Any]":
        """Start phase ``name`` in a thread of its own and return its future: for a phase whose
        inputs are ready and whose result is needed only later, run beside the next phase (the
        predictor fit beside the policy update, on the core the one-threaded update leaves idle).
        The thread runs in a copy of this thread's context, so the phase is a task run of the
        flow run like the others, and outside this thread's ``held`` block. Wait for the future
        before the step goes on, whatever the phase beside it did."""
        bound = getattr(self, name)
        future: Future[Any] = Future()
        context = contextvars.copy_context()

        def work() -> None:
            future.set_running_or_notify_cancel()
            try:
                future.set_result(context.run(bound, *args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 -- the caller's .result() raises it
                future.set_exception(exc)

        threading.Thread(target=work, name=f"trace-phase-{name}", daemon=True).start()
        return future


def announced(name_of: Callable[[], str]) -> Callable[[], str]:
    """A flow's ``flow_run_name`` function that says in the flow run's log what it renames, so
    that a name typed in the UI's Run Name field is not replaced silently."""
    @functools.wraps(name_of)
    def name() -> str:
        from prefect import get_run_logger
        from prefect.runtime import flow_run

        new = name_of()
        if flow_run.name and flow_run.name != new:
            get_run_logger().info("flow run %r is named %r: a %s run is named after what it "
                                  "does, not by the form's Run Name", flow_run.name, new,
                                  flow_run.flow_name)
        return new
    return name


def run_config() -> Any:
    """The running flow's ``config`` parameter as a ``TrainConfig`` (missing: the default), or
    None when it does not validate (the flow run then fails on it, with Prefect's message)."""
    from prefect.runtime import flow_run

    from trace_rl.config import TrainConfig

    cfg = flow_run.parameters.get("config")
    try:
        return cfg if isinstance(cfg, TrainConfig) else TrainConfig.model_validate(cfg or {})
    except ValueError:
        return None


def train_run_name() -> str:
    """The train flow run's name: its run id and the steps it will run, e.g.
    ``trace-default-3f2a9c01de steps 2-4`` or ``... step 0`` (a resumed run starts after its last
    complete step, read from the work dir's store), instead of Prefect's random two words. It
    replaces a name typed in the UI's Run Name field (``announced`` logs it): a run is named by
    ``config.run_name``."""
    from prefect.runtime import flow_run

    from trace_rl.storage.store import DB_FILENAME, TreeStore

    params = flow_run.parameters
    cfg = run_config()
    if cfg is None:
        return "train (invalid config)"
    run_id, start = cfg.resolved_run_id, 0
    workdir = Path(resolve_workdir(params.get("workdir")))
    if (workdir / DB_FILENAME).exists():
        try:
            done = TreeStore(workdir, create=False).last_complete_step(run_id)
        except Exception:  # noqa: BLE001 -- a name is no reason to fail the run
            done = None
        start = 0 if done is None else done + 1
    if start >= cfg.steps:
        return f"{run_id} (all {cfg.steps} steps done)"
    last = cfg.steps - 1
    return f"{run_id} step {start}" if start == last else f"{run_id} steps {start}-{last}"
