"""Bootstrap a tiny CPU policy for a synthetic family: tokenizer, model, SFT warm start, cache.

The RL stage (docs/algorithm.md) learns only from groups whose outcomes are mixed, so the starting
policy must succeed *sometimes*: a random model (success ~0) and a perfect imitator (~1) both give
groups with no contrast. The recipe, per family:

1. a byte-level BPE trained on the family's own text (system prompt, questions, expert turns,
   tool observations), deterministic for the same settings;
2. a seeded model from ``build_model(tokenizer, preset)``;
3. supervised fine-tuning on expert traces written in the turn format
   (``expert_episode``: prompt_ids | gen_ids | obs_ids | ...), with cross-entropy on the policy's
   tokens only (prompt and observation tokens carry label -100). A fraction ``noise`` of the traces
   is deliberately imperfect, built by one of ``CORRUPTIONS`` (a wrong final answer, an answer
   given too early, a wrong intermediate tool call), so the imitated behaviour fails part of the
   time in the ways RL can fix. A family's expert thoughts are those it registered
   (``trace_rl.envs.registry.Bootstrap``: arith restates the step's sentence, chain the fact it
   follows; the others think nothing);
4. after every epoch the policy is measured by real rollouts (HF engine, ``run_episodes``,
   temperature 1) on held-out test items; SFT stops at the first epoch whose success lies in
   ``target_success``, else the epoch closest to that range is kept;
5. the result is written with ``save_policy`` into a temporary directory that is renamed onto
   ``out_dir`` (a kill never leaves a half-written policy), with ``bootstrap.json`` holding the
   settings, the input hash and the measured success rates (sampled and greedy, on a separate
   held-out report set). A later call with the same inputs returns at once.

This is project scaffolding, not part of the paper (which starts RL from Qwen3 checkpoints).
synth_arith at difficulty 1 meets the target in 2-5 epochs (seed 0: 32 % sampled, 55 % greedy);
at difficulty 2 it ended at 19 % after 8 epochs and synth_chain at 0 % after 12, so callers should
read ``bootstrap.json``'s ``target_met`` rather than assume a middle-range start (figures:
docs/results.md, "Tiny policy bootstrap").

The package, by concern: ``config`` (``BootstrapConfig``, read with a family's own settings),
``data`` (expert and imperfect traces, thoughts, tokenizer text), ``training`` (the SFT epochs and
their measurement), ``cache`` (input hash and record; the shared machinery is
``trace_rl.policy.cache``), ``entry`` (``bootstrap_policy``, ``run_bootstrap``, the command line).
The SFT pieces shared with the real-model warm start are in ``trace_rl.policy.sft``.
"""

from __future__ import annotations

from trace_rl.policy.bootstrap.cache import input_hash, read_record
from trace_rl.policy.bootstrap.config import RECIPE_VERSION, RECORD, BootstrapConfig, family_config
from trace_rl.policy.bootstrap.data import (CORRUPTIONS, Corruption, family_thoughts, no_thoughts,
                                            stop_early, tokenizer_texts, trace_actions, wrong_final,
                                            wrong_step)
from trace_rl.policy.bootstrap.entry import bootstrap_policy, main, run_bootstrap
from trace_rl.policy.bootstrap.training import measure_success, train_policy
from trace_rl.policy.cache import build_once
from trace_rl.policy.sft import (IGNORE_INDEX, SFTExample, ScriptedEnv, auto_threads,
                                 episode_example, sft_batch, sft_loss, shared_prefix_len)

_Scripted = ScriptedEnv  # the names these had when this package was one module
_tokenizer_texts = tokenizer_texts

__all__ = ["BootstrapConfig", "CORRUPTIONS", "Corruption", "IGNORE_INDEX", "RECIPE_VERSION",
           "RECORD", "SFTExample", "ScriptedEnv", "auto_threads", "bootstrap_policy", "build_once",
           "episode_example", "family_config", "family_thoughts", "input_hash", "main",
           "measure_success", "no_thoughts", "read_record", "run_bootstrap", "sft_batch",
           "sft_loss", "shared_prefix_len", "stop_early",
           "tokenizer_texts", "trace_actions", "train_policy", "wrong_final", "wrong_step"]
