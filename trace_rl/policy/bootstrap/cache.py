"""Which bootstrapped policy a directory holds: the input hash of everything that determines a
policy, and the record (``bootstrap.json``) written next to its weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Sequence

from trace_rl.envs.base import Environment, TaskItem
from trace_rl.policy import cache
from trace_rl.policy.bootstrap.config import RECIPE_VERSION, RECORD, BootstrapConfig
from trace_rl.policy.bootstrap.data import family_thoughts


def input_hash(config: BootstrapConfig, env: Environment, items: Sequence[TaskItem]) -> str:
    """sha256 over the recipe version, the config, the family's prompt, the version of its expert
    thoughts where they carry one (``expert_thoughts.version``) and the items used."""
    h = hashlib.sha256()
    head = {"recipe": RECIPE_VERSION, "config": config.to_json(), "system": env.system_prompt()}
    thoughts_version = getattr(family_thoughts(config.family), "version", None)
    if thoughts_version is not None:  # a family whose expert thoughts changed since recipe 4
        head["thoughts"] = thoughts_version
    h.update(json.dumps(head, sort_keys=True).encode())
    for item in items:
        h.update(json.dumps([item.id, item.question, item.gold], sort_keys=True,
                            default=str).encode())
    return h.hexdigest()


def read_record(out_dir: str | Path) -> dict[str, Any] | None:
    """The ``bootstrap.json`` of ``out_dir``, or None when there is none."""
    return cache.read_record(out_dir, RECORD)


def holds(directory: Path, digest: str) -> bool:
    """Whether ``directory`` holds a finished policy built from inputs with hash ``digest``."""
    return cache.holds(directory, RECORD, digest)
