"""Warm-start a real language model for a real task family: SFT on ReAct traces of the training
data, then a measurement of sampled success on the family's held-out split.

The RL stage needs a policy that succeeds *sometimes* (docs/algorithm.md). SmolLM2-135M-Instruct as
converted writes prose and never uses the turn format (accuracy 0.000 on every family), so RL has
nothing to learn from. The recipe, for ``hotpotqa``:

1. **Traces from training items only, never an evaluation item.** By default the 100 HotpotQA
   ``train`` questions and ``dev_rest``, the 400 dev items after the fixed held-out block
   ``dev_heldout`` (the first 100 dev items in file order, ``trace_rl.envs.hotpotqa.env.BLOCKS``),
   which is what the policy is measured on; ``load_split_items`` refuses any split whose items
   (by id or question) meet the measured ones. Per item, a *gold* trace. Recipe 4 (the
   default, ``question_first``): ``search`` the question itself, then, when the observation the
   project's BM25 tool really returns holds the answer, a thought quoting the span that ends with
   it and ``<answer>`` with the gold answer; otherwise first a search for each supporting entity
   those results did not show. Recipe 3 (``question_first=false``): a search for each gold
   supporting entity (the one the question names first, so the first hop comes first), then the
   answer. For a share ``recovery`` of the items also a *recovery* trace: first a search for
   one of the item's distractor paragraphs, then the gold trace. With ``bridge_thoughts``
   (recipe 3; recipe 4's entity searches too) the queries are entity names (titles without their
   disambiguation) and the thoughts teach the bridge step: before searching an entity the
   question does not name, the thought quotes the span of an earlier observation that names it
   (``The result says "... starring then 17-year-old Shirley Temple".``); before the answer,
   the span that holds the answer. Traces are written in the turn format by ``expert_episode``
   (tools really run, the answer is really graded) with the base model's own chat template.
2. **SFT** of any Hugging Face causal-LM directory (``base``: a directory or a named policy,
   default ``smollm2``): cross-entropy on the policy's tokens only
   (``trace_rl.policy.sft.sft_loss``), AdamW with linear warm-up and cosine decay, traces longer
   than ``max_tokens`` left out and counted. ``trainable_layers`` > 0 trains only the top layers
   (and the final norm), which saves most of the backward pass on a CPU.
3. **Measurement**: ``eval_items`` items of ``eval_split`` (``dev_heldout``), ``eval_samples``
   sampled rollouts each at ``eval_temperature`` (and at 1.0 beside it when that differs)
   through the real ReAct loop and engine, before SFT (the base model) and after; success
   overall and per question type (bridge, comparison).
4. **Cache**: the result is keyed by the hash of everything that determines it (recipe version,
   config, the base model's files, system prompt, training items with their supporting titles
   and paragraphs, the measured items' ids) and built once per machine
   under ``cache_dir()/policies``; each work dir gets a copy with ``warmstart.json`` (config,
   input hash, trace counts, loss history, success rates, wall times). An MLflow run
   (experiment ``warmstart``) in the work dir holds the same figures.

The environment settings used (``env_args``: BM25 ``top_k`` and ``max_chars``) are part of the
recipe; train and evaluate the warm-started policy with the same ones (``extra=``; the CLI prints
the command).

The traces of a family are written by the builder it registered (``trace_rl.envs.registry.
Warmstart``: ``trace_rl.envs.hotpotqa.warmstart``, ``trace_rl.envs.bfcl.warmstart``), with the
settings it registered over ``WarmstartConfig``'s defaults (HotpotQA's recipe). The package, by
concern: ``config`` (``WarmstartConfig``, which ``trace_rl.config.warmstart_config`` reads from
``key=value`` arguments), ``traces`` (the traces of a
config's items and the train/measured split), ``training`` (SFT and the record), ``measure``
(success on held-out items), ``cache`` (input hash and record; the shared machinery is
``trace_rl.policy.cache``), ``entry`` (``warmstart_policy``). Importing it loads neither torch nor
transformers (the command line checks a config first); ``training`` does, when a build starts.
"""

from __future__ import annotations

from trace_rl.policy.warmstart.cache import input_hash, read_record
from trace_rl.policy.warmstart.config import (RECIPE_VERSION, RECORD, WarmstartConfig,
                                              family_settings, warmstart_families)
from trace_rl.policy.warmstart.entry import warmstart_policy
from trace_rl.policy.warmstart.measure import measure
from trace_rl.policy.warmstart.traces import build_traces, load_split_items

__all__ = ["RECIPE_VERSION", "RECORD", "WarmstartConfig", "build_traces",
           "family_settings", "input_hash", "load_split_items", "measure", "read_record",
           "warmstart_families", "warmstart_policy"]
