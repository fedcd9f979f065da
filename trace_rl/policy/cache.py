"""The machine-wide cache of built policies, shared by the two warm starts
(``trace_rl.policy.bootstrap``, ``trace_rl.policy.warmstart``).

A policy directory holds a JSON record (``bootstrap.json``, ``warmstart.json``) with the hash of
everything that built it; a directory whose record carries the wanted hash is reused as it is.
Writes are atomic: a policy is built into a temporary directory beside its target and renamed
onto it, so a kill never leaves a half-written policy. With a cache directory, a policy is built
once per machine under a file lock and each work dir gets its own copy.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable


def read_record(out_dir: str | Path, name: str) -> dict[str, Any] | None:
    """The record ``name`` of ``out_dir``, or None when there is none."""
    path = Path(out_dir) / name
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def holds(directory: Path, name: str, digest: str) -> bool:
    """Whether ``directory`` holds a finished policy whose record ``name`` has hash ``digest``."""
    record = read_record(directory, name) if directory.is_dir() else None
    return record is not None and record.get("input_hash") == digest


def build_staged(out: Path, name: str, make: Callable[[Path, Path], dict[str, Any]]) -> None:
    """``make(staged, work)`` writes a policy into ``staged`` (with ``work``, a scratch directory
    beside it) and returns its record, which is written as ``name`` next to the weights; then
    ``staged`` is moved onto ``out`` atomically (``replace_dir``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as work:
        staged = Path(work) / "policy"
        record = make(staged, Path(work))
        (staged / name).write_text(json.dumps(record, indent=2) + "\n")
        replace_dir(staged, out, Path(work))


def build_once(cached: Path, out: Path, holds: Callable[[Path], bool],
               build: Callable[[Path], None], announce: str | None = None) -> Path:
    """Build a policy into the machine-wide cache directory ``cached`` unless it ``holds`` it
    already (under a file lock, so a second process waits for the first), then copy it onto
    ``out`` atomically (``replace_dir``); ``announce``: a label to print a cache hit with."""
    from filelock import FileLock

    cached.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cached) + ".lock"):
        if holds(cached):
            if announce:
                print(f"{announce}: reusing the policy cached at {cached}", file=sys.stderr,
                      flush=True)
        else:
            build(cached)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as work:
        staged = Path(work) / "policy"
        shutil.copytree(cached, staged)
        replace_dir(staged, out, Path(work))
    return out


def replace_dir(staged: Path, out: Path, work: Path) -> None:
    """Move ``staged`` onto ``out``; an old ``out`` is moved aside first (rename is atomic on one
    file system, so ``out`` is at all times either the old policy, absent, or the new one)."""
    if out.exists():
        out.rename(work / "old")
    staged.rename(out)
