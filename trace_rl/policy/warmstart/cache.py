"""Which warm-started policy a directory holds: the input hash of everything that determines it,
and the record (``warmstart.json``) written next to its weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from trace_rl.envs.base import Environment, TaskItem
from trace_rl.policy import cache
from trace_rl.policy.warmstart.config import RECIPE_VERSION, RECORD, WarmstartConfig


def input_hash(config: WarmstartConfig, base_dir: Path, env: Environment,
               items: Sequence[TaskItem], eval_items: Sequence[TaskItem] = ()) -> str:
    """sha256 over the recipe version, the config, the base model's files (names and sizes; its
    config.json in full), the family's prompt, the training items (with the metadata the traces
    are built from: supporting titles, paragraphs) and the ids of the measured items."""
    h = hashlib.sha256()
    h.update(json.dumps({"recipe": RECIPE_VERSION, "config": config.to_json(),
                         "system": env.system_prompt()}, sort_keys=True).encode())
    h.update((base_dir / "config.json").read_bytes())
    for f in sorted(base_dir.iterdir()):
        if f.is_file():
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    for item in items:
        h.update(json.dumps([item.id, item.question, item.gold,
                             item.meta.get("supporting_titles"), item.meta.get("paragraphs")],
                            default=str).encode())
    h.update(json.dumps([it.id for it in eval_items]).encode())
    return h.hexdigest()


def read_record(out_dir: str | Path) -> dict[str, Any] | None:
    """The ``warmstart.json`` of ``out_dir``, or None when there is none."""
    return cache.read_record(out_dir, RECORD)


def holds(directory: Path, digest: str) -> bool:
    """Whether ``directory`` holds a finished policy built from inputs with hash ``digest``."""
    return cache.holds(directory, RECORD, digest)
