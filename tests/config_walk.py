"""How often following ``config`` through one training step jumps between the project's files.

``walk(run)`` runs ``run()`` under ``sys.settrace`` and follows every call that receives a
``TrainConfig`` (an argument or ``self``) in a file of this repository (``flows``, ``tasks``,
``trace_core``, ``trace_rl``; library frames are skipped). Reading along, the reader is in the
file of the innermost such call: a call moves the reader into the callee's file, a return back
into the caller's. Counted:

* ``files``: distinct files entered;
* ``climbs``: returns that move the reader into another file (back up the call stack);
* ``reentries``: moves into a file the reader had been in before and left (a return or a call).

Counted twice: following every call (``all``), and reading each function once (``read``: a
later call of a function already read is not followed, nor anything below it). A thread's calls
are read as a sequence of their own, after those of the threads that started before it (the
predictor's fit runs in a thread beside the policy update): interleaved, the count would depend on
how the two threads happened to be scheduled.

``python tests/config_walk.py`` measures the second step (step 1, after the predictor's first
fit) of a two-step scripted TRACE run (the step-reference test's config and agent, its rollouts
written by ``tests/scripted_engine.py``) and prints the three counts; ``--moves`` lists each move
of the read walk (into which file, by a call of or a return from which function, and whether it
re-enters a file), ``--model DIR`` reuses a tiny policy made before. ``tests/test_config_walk.py``
keeps the read walk's re-entries under its bound.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

@lru_cache(maxsize=1)
def _root() -> Path:
    """The checkout whose packages are imported (``PYTHONPATH``), not necessarily this file's."""
    import importlib

    return Path(importlib.import_module("flows").__file__).resolve().parents[1]
PACKAGES = ("flows", "tasks", "trace_core", "trace_rl")


@lru_cache(maxsize=None)
def _ours(filename: str) -> str | None:
    """The repository-relative path of a file of the project's packages, else None."""
    try:
        rel = Path(filename).resolve().relative_to(_root())
    except ValueError:
        return None
    return rel.as_posix() if rel.parts and rel.parts[0] in PACKAGES else None


def walk(run: Callable[[], Any]) -> dict[str, Any]:
    """The counts of the module docstring over ``run()``, each call followed (``all``) and each
    function read once, as a reader would (``read``: a later call of a function already read
    is not followed again); the return value under ``result``."""
    from trace_rl.config import TrainConfig


    by_thread: dict[int, list[tuple[str, str, Any]]] = {}  # in the order the threads first call

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "return":
            by_thread[threading.get_ident()].append(("return", "", None))
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event != "call":
            return None
        where = _ours(frame.f_code.co_filename)
        if where is None or not any(isinstance(v, TrainConfig)
                                    for v in frame.f_locals.values()):
            return None
        by_thread.setdefault(threading.get_ident(), []).append(("call", where, frame.f_code))
        return local

    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
        result = run()
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    events = [e for thread in by_thread.values() for e in thread]
    return {"all": _count(events, once=False), "read": _count(events, once=True),
            "result": result}


def _count(events: list[tuple[str, str, Any]], once: bool) -> dict[str, int]:
    """files, climbs and reentries of a list of call and return events; with ``once``, the
    call of a function already followed is skipped with everything below it."""
    moves: list[tuple[str, str, str]] = []  # (call | return, file, function entered or left)
    stack: list[tuple[str, str]] = []  # (file, function) of the followed open frames
    read: set[Any] = set()
    skipping = 0  # depth inside a skipped call
    for kind, where, code in events:
        if skipping:
            skipping += 1 if kind == "call" else -1
            continue
        if kind == "call":
            if once and code in read:
                skipping = 1
                continue
            read.add(code)
            stack.append((where, code.co_qualname))
            moves.append(("call", where, code.co_qualname))
        else:
            _, left = stack.pop()
            if stack:
                moves.append(("return", stack[-1][0], left))
    seen: set[str] = set()
    current, climbs, reentries, path, steps = None, 0, 0, [], []
    for kind, where, function in moves:
        if where != current:
            climbs += kind == "return"
            again = where in seen
            reentries += again
            if current is not None:
                seen.add(current)
            current = where
            path.append(where)
            steps.append((kind, where, function, again))
    return {"files": len({w for _, w, _ in moves}), "climbs": climbs, "reentries": reentries,
            "calls": sum(kind == "call" for kind, _, _ in moves), "path": path, "steps": steps}


def walk_one_step(workdir: str, model_dir: str, step: int = 1) -> dict[str, Any]:
    """``walk`` over ``flows.train.run_step`` of ``step`` in a two-step scripted TRACE run of the
    step-reference test's config (a Prefect server must be up: ``prefect_test_harness``)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from scripted_engine import scripted_rollouts
    from test_step_reference import AGENT, BASE

    import flows.train as train_mod

    real = train_mod.run_step
    counts: dict[str, Any] = {}

    def traced(*args: Any, **kwargs: Any) -> Any:
        # run_step(cfg, at, ...) with a step handle, or run_step(cfg, workdir, run_id, step, ...)
        at = getattr(args[1], "step", None) if hasattr(args[1], "step") else args[3]
        if at != step:
            return real(*args, **kwargs)
        out = walk(lambda: real(*args, **kwargs))
        counts.update(out)
        return out["result"]

    train_mod.run_step = traced
    try:
        with scripted_rollouts(AGENT):
            train_mod.train(config={**BASE, "policy": model_dir}, workdir=workdir)
    finally:
        train_mod.run_step = real
    counts.pop("result", None)
    return counts


def describe(steps: list[tuple[str, str, str, bool]]) -> str:
    """One line per move of a walk's ``steps``: into which file, by a call of (or a return
    from) which function, ``again`` where it re-enters a file."""
    return "\n".join(f"{'again ' if again else '      '}{'call  ' if kind == 'call' else 'return'} "
                     f"{where:28} {function}" for kind, where, function, again in steps)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moves", action="store_true",
                        help="list the read walk's moves (file, function, re-entries)")
    parser.add_argument("--model", help="a tiny policy made before (default: made here)")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="config-walk-prefect-"))
    from prefect.testing.utilities import prefect_test_harness

    from trace_rl.policy.tiny import make_tiny_policy

    with tempfile.TemporaryDirectory() as tmp, prefect_test_harness(server_startup_timeout=180):
        model = args.model or make_tiny_policy(Path(tmp) / "model", preset="test",
                                               pretrain_steps=150)
        counts = walk_one_step(str(Path(tmp) / "run"), str(model))
        for mode in ("all", "read"):
            path, steps = counts[mode].pop("path"), counts[mode].pop("steps")
            print(mode, counts[mode])
        print("read, file by file:", " > ".join(p.rsplit("/", 1)[-1] for p in path))
        if args.moves:
            print(describe(steps))
