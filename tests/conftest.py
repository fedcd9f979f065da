"""Shared fixtures: a tiny policy directory built locally (no downloads), one per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved HF directory: the "test" preset (~0.15M params, head_dim 32, vocab 1024), seed 0,
    pre-trained 150 steps (~4 s) on ``react_corpus()`` so it writes ReAct-shaped text
    (``<think>..</think>``, ``<tool_call>{json}</tool_call>``, EOS = ``<|im_end|>``).
    Loadable by transformers and vLLM."""
    from trace_rl.policy.tiny import make_tiny_policy

    return make_tiny_policy(tmp_path_factory.mktemp("tiny_model"), preset="test",
                            pretrain_steps=150)
