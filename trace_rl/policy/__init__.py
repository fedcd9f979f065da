"""Policies: the project's own tiny model (built locally) and SmolLM2-135M-Instruct (from a package).

The names below load on first use (PEP 562), so that importing a light submodule
(``trace_rl.policy.named``, ``trace_rl.policy.smollm``) does not import torch and transformers:
the command line checks a config, policy names included, before anything heavy loads.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {"smollm2_dir": "trace_rl.policy.smollm",
         **{name: "trace_rl.policy.tiny" for name in (
             "PRESETS", "build_model", "build_tokenizer", "fit_language_model",
             "make_tiny_policy", "react_corpus", "save_policy")}}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
