"""The warm start's training run: ReAct traces as SFT examples, the base model measured, SFT of
its top layers, the warm-started policy measured (sampled, at temperature 1, greedy), and the
record of it all, each figure also logged to the MLflow run when there is one."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trace_rl.envs.base import Environment, TaskItem
from trace_rl.policy.freeze import freeze_lower_layers
from trace_rl.policy.sft import (SFTExample, ScriptedEnv, auto_threads, episode_example, sft_epoch,
                                 warmup_cosine)
from trace_rl.policy.warmstart.config import RECIPE_VERSION, WarmstartConfig
from trace_rl.policy.warmstart.measure import measure
from trace_rl.policy.warmstart.traces import build_traces
from trace_rl.rollout.react import expert_episode


@dataclass
class _Traces:
    """The SFT examples of the training items and their counts."""

    examples: list[SFTExample] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    """Examples per trace kind (gold, recovery)."""
    reward: dict[str, float] = field(default_factory=dict)
    """Summed reward per trace kind."""
    too_long: int = 0
    """Traces left out for exceeding ``max_tokens``."""
    thoughts: dict[str, int] = field(default_factory=dict)
    """Traces per ``<question type>_with``/``_without`` a thought."""


def train_policy(config: WarmstartConfig, base_dir: Path, env: Environment, train: list[TaskItem],
                 eval_items: list[TaskItem], staged: Path, progress: Any, tracker: Any,
                 engine: str) -> dict[str, Any]:
    """Warm-start ``base_dir`` on traces of ``train``, measure it on ``eval_items`` before and
    after, save it into ``staged``; return its record (``warmstart.json``)."""
    t_start = time.perf_counter()
    torch.manual_seed(config.seed)
    threads = config.threads or auto_threads()
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rng = random.Random(f"warmstart:{config.family}:{config.seed}")
    progress.note(f"writing ReAct traces of {len(train)} {config.family}/{config.train_split} "
                  "items (the environment's real tools and grader)")
    traces = _write_examples(config, env, train, tokenizer, rng)
    lengths = sorted(len(e.token_ids) for e in traces.examples)
    record: dict[str, Any] = {
        "config": config.to_json(), "recipe_version": RECIPE_VERSION, "base_dir": str(base_dir),
        "traces": traces.kinds, "traces_too_long": traces.too_long,
        "trace_success": {k: traces.reward[k] / traces.kinds[k] for k in traces.kinds},
        "trace_tokens": {"median": lengths[len(lengths) // 2], "max": lengths[-1]},
        "threads": threads, "train_items": len(train),
        "train_ids": sorted({it.id for it in train}),
        "bridge_thoughts": traces.thoughts,
        "eval_split": config.eval_split, "eval_items": len(eval_items),
        "eval_ids": [it.id for it in eval_items],
        "eval_samples": config.eval_samples,
    }
    if eval_items and config.measure_base:
        progress.note(f"measuring the base model on {len(eval_items)} {config.eval_split} items")
        t0 = time.perf_counter()
        record["before"] = measure(config, env, base_dir, eval_items, engine,
                                   config.eval_temperature)
        record["before"]["seconds"] = time.perf_counter() - t0
        _log(tracker, 0, "eval/before_", record["before"])
    step = _sft(config, base_dir, tokenizer, traces, record, staged, progress, tracker)
    if eval_items:
        _measure_after(config, env, staged, eval_items, engine, record, step, progress, tracker)
    record["total_seconds"] = time.perf_counter() - t_start
    record["torch"] = torch.__version__
    return record


def _write_examples(config: WarmstartConfig, env: Environment, train: list[TaskItem],
                    tokenizer: Any, rng: random.Random) -> _Traces:
    """The traces of ``train`` (``build_traces``) rendered by ``expert_episode`` (tools really run,
    answers really graded) as SFT examples; those over ``max_tokens`` left out and counted."""
    out = _Traces()
    for item, actions, thoughts, kind in build_traces(config, env, train, rng):
        with_thought = "with" if any(thoughts) else "without"
        key = f"{item.meta.get('type') or 'item'}_{with_thought}"
        out.thoughts[key] = out.thoughts.get(key, 0) + 1
        ep = expert_episode(ScriptedEnv(env, actions), item, tokenizer, thoughts=thoughts)
        ex = episode_example(ep)
        if len(ex.token_ids) > config.max_tokens:
            out.too_long += 1
            continue
        out.examples.append(ex)
        out.kinds[kind] = out.kinds.get(kind, 0) + 1
        out.reward[kind] = out.reward.get(kind, 0.0) + float(ep.reward or 0.0)
    if not out.examples:
        raise ValueError(f"warmstart: no trace of {config.family}/{config.train_split} fits "
                         f"max_tokens={config.max_tokens}")
    return out


def _sft(config: WarmstartConfig, base_dir: Path, tokenizer: Any, traces: _Traces,
         record: dict[str, Any], staged: Path, progress: Any, tracker: Any) -> int:
    """SFT of ``base_dir``'s top ``trainable_layers`` on the traces; the result is saved into
    ``staged`` and its loss history and time go into ``record``. Returns the optimiser steps."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.config.use_cache = False
    trainable = freeze_lower_layers(model, config.trainable_layers)
    params = [p for p in model.parameters() if p.requires_grad]
    examples = traces.examples
    steps_per_epoch = math.ceil(len(examples) / config.batch_size)
    total = steps_per_epoch * config.epochs
    opt = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    sched = warmup_cosine(opt, config.warmup_steps, total)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    gen = torch.Generator().manual_seed(config.seed)
    progress.note(f"SFT of {base_dir.name}: {len(examples)} traces ({traces.kinds}), median "
                  f"{record['trace_tokens']['median']} tokens, {config.epochs} epochs, "
                  f"{total} steps, {trainable:,} trainable parameters, {record['threads']} threads")
    progress.total = total
    history, t_sft = [], time.perf_counter()
    model.train()
    for epoch in range(1, config.epochs + 1):
        def on_step(s: int, loss: float) -> None:
            _log(tracker, (epoch - 1) * steps_per_epoch + s, "", {"loss/sft": loss})
            progress.advance(epoch=f"{epoch}/{config.epochs}", loss=round(loss, 4))

        losses = sft_epoch(model, opt, sched, examples, config.batch_size, gen, pad, params,
                           on_step)
        history.append({"epoch": epoch, "loss": sum(losses) / len(losses),
                        "seconds": time.perf_counter() - t_sft})
    record["sft_seconds"] = time.perf_counter() - t_sft
    record["history"] = history
    model.eval()
    model.config.use_cache = True
    model.save_pretrained(staged, safe_serialization=True)
    tokenizer.save_pretrained(staged)
    return total


def _measure_after(config: WarmstartConfig, env: Environment, staged: Path,
                   eval_items: list[TaskItem], engine: str, record: dict[str, Any], step: int,
                   progress: Any, tracker: Any) -> None:
    """The warm-started policy on ``eval_items`` at ``eval_temperature`` (``after``), at 1.0 where
    that differs (``after_t1``) and greedily with ``measure_greedy`` (``after_greedy``)."""
    progress.note(f"measuring the warm-started policy on {len(eval_items)} "
                  f"{config.eval_split} items")
    t0 = time.perf_counter()
    record["after"] = measure(config, env, staged, eval_items, engine, config.eval_temperature)
    record["after"]["seconds"] = time.perf_counter() - t0
    if config.eval_temperature != 1.0:
        record["after_t1"] = measure(config, env, staged, eval_items, engine, 1.0)
        _log(tracker, step, "eval/t1_", record["after_t1"])
    _log(tracker, step, "eval/after_", record["after"])
    if config.measure_greedy:
        record["after_greedy"] = measure(config, env, staged, eval_items, engine, 0.0)
        _log(tracker, step, "eval/greedy_", record["after_greedy"])


def _log(tracker: Any, step: int, prefix: str, figures: Mapping[str, Any]) -> None:
    """The float figures of ``figures`` as MLflow metrics ``prefix + name`` at ``step``."""
    metrics = {f"{prefix}{k}": v for k, v in figures.items() if isinstance(v, float)}
    if tracker is not None and metrics:
        tracker.log_metrics(step, metrics)
