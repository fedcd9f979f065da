"""Policies: the project's own tiny model (built locally) and SmolLM2-135M-Instruct (from a package)."""

from trace_rl.policy.smollm import smollm2_dir
from trace_rl.policy.tiny import (PRESETS, build_model, build_tokenizer, fit_language_model,
                                  make_tiny_policy, react_corpus, save_policy)

__all__ = ["PRESETS", "build_model", "build_tokenizer", "fit_language_model", "make_tiny_policy",
           "react_corpus", "save_policy", "smollm2_dir"]
