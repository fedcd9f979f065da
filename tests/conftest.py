"""Shared fixtures: a tiny policy directory built locally (no downloads), one per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved HF directory with the "test" preset (~0.15M params, head_dim 32, vocab 1024),
    random-initialised with seed 0; loadable by transformers and vLLM."""
    from trace_rl.policy.tiny import make_tiny_policy

    return make_tiny_policy(tmp_path_factory.mktemp("tiny_model"), preset="test")
