"""The bootstrap's training run: tokenizer and model, SFT epochs measured by real rollouts until
the held-out success lies in the target range, and the record of what was built and measured."""

from __future__ import annotations

import copy
import logging
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from trace_rl.engines.hf import HFEngine
from trace_rl.envs.base import Environment, TaskItem
from trace_rl.policy.bootstrap.config import RECIPE_VERSION, BootstrapConfig
from trace_rl.policy.bootstrap.data import tokenizer_texts, turn_budget, write_examples
from trace_rl.policy.sft import SFTExample, sft_epoch, warmup_cosine
from trace_rl.policy.tiny import PRESETS, build_model, build_tokenizer, save_policy
from trace_rl.progress import Progress, Silent
from trace_rl.rollout.react import Start, run_episodes
from trace_rl.rollout.types import SamplingSettings

log = logging.getLogger(__name__)


def measure_success(engine: Any, env: Environment, items: Sequence[TaskItem], *,
                    temperature: float, seed: int, max_turn_tokens: int,
                    max_context: int | None = None) -> float:
    """Mean reward of one real rollout per item (``run_episodes``) at ``temperature``."""
    if not items:
        raise ValueError("measure_success: no items")
    episodes = run_episodes(engine, env, [Start(item) for item in items],
                            sampling=SamplingSettings(max_tokens=max_turn_tokens,
                                                      temperature=temperature),
                            seed=seed, max_context=max_context)
    return sum(float(ep.reward or 0.0) for ep in episodes) / len(episodes)


def _distance(x: float, lo: float, hi: float) -> float:
    return max(lo - x, 0.0, x - hi)


class _Probe:
    """One HF engine for all measurements of a training run; each measurement writes the model's
    current weights to ``directory`` and loads them into the engine (``load_weights``)."""

    def __init__(self, config: BootstrapConfig, env: Environment, model: torch.nn.Module,
                 tokenizer: Any, directory: Path, max_turn_tokens: int):
        self.config, self.env, self.model, self.tokenizer = config, env, model, tokenizer
        self.directory, self.max_turn_tokens = directory, max_turn_tokens
        save_policy(model, tokenizer, directory)
        self.engine = HFEngine(directory, device="cpu", seed=config.seed)

    def measure(self, items: list[TaskItem], temperature: float, salt: int) -> float:
        save_policy(self.model, self.tokenizer, self.directory)
        self.engine.load_weights(self.directory)
        return measure_success(self.engine, self.env, items, temperature=temperature,
                               seed=self.config.seed * 1000 + salt,
                               max_turn_tokens=self.max_turn_tokens,
                               max_context=PRESETS[self.config.preset].max_positions)


@dataclass
class _Fit:
    """What the SFT epochs gave: per-epoch figures and the kept epoch."""

    history: list[dict[str, float]]
    gap: float
    """Distance of the kept epoch's held-out success from the target range (0 = met)."""
    epoch: int
    state: dict[str, torch.Tensor]
    seconds: float


def train_policy(config: BootstrapConfig, env: Environment, train: list[TaskItem],
                 eval_items: list[TaskItem], report_items: list[TaskItem], staged: Path,
                 work: Path, show_progress: bool = False) -> dict[str, Any]:
    """Train the policy of ``config`` on ``train``, stop by ``eval_items``, measure it on
    ``report_items``, save it into ``staged``; return its record (``bootstrap.json``)."""
    total_steps = math.ceil(len(train) / config.batch_size) * config.sft_epochs  # at most
    label = f"bootstrap {config.family} d{config.difficulty}"
    with (Progress(label, total_steps) if show_progress else Silent()) as progress:
        return _train_steps(config, env, train, eval_items, report_items, staged, work,
                            progress)


def _train_steps(config: BootstrapConfig, env: Environment, train: list[TaskItem],
                 eval_items: list[TaskItem], report_items: list[TaskItem], staged: Path,
                 work: Path, progress: Progress | Silent) -> dict[str, Any]:
    t_start = time.perf_counter()
    progress.note(f"training a tokenizer and writing {len(train)} SFT traces")
    rng = random.Random(f"bootstrap:{config.family}:{config.seed}")
    tokenizer = build_tokenizer(tokenizer_texts(env, train[:config.tokenizer_items]),
                                vocab_size=config.vocab_size, split_digits=config.split_digits,
                                split_names=config.split_names)
    model = build_model(tokenizer, config.preset, seed=config.seed)
    examples, kinds, trace_success = write_examples(config, env, train, tokenizer, rng)
    max_turn_tokens = turn_budget(env, train, tokenizer)
    probe = _Probe(config, env, model, tokenizer, work / "probe", max_turn_tokens)
    progress.note(f"measuring the untrained policy on {len(eval_items)} held-out items")
    success_init = probe.measure(eval_items, 1.0, 0)
    fit = _fit(config, model, tokenizer, examples, eval_items, probe, progress)
    model.load_state_dict(fit.state)
    model.eval()
    progress.note(f"kept epoch {fit.epoch}; measuring it on {len(report_items)} report items "
                  "(sampled and greedy)")
    success_sampled = probe.measure(report_items, 1.0, 10_000)
    success_greedy = probe.measure(report_items, 0.0, 20_000)
    probe.engine.close()
    save_policy(model, tokenizer, staged)
    return {
        "config": config.to_json(), "recipe_version": RECIPE_VERSION,
        "params": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer),
        "sft_traces": kinds, "sft_trace_success": trace_success,
        "max_turn_tokens": max_turn_tokens,
        "epochs_run": len(fit.history), "epoch_kept": fit.epoch, "target_met": fit.gap == 0.0,
        "history": fit.history,
        "success_init": success_init,
        "success_sampled": success_sampled, "success_greedy": success_greedy,
        "report_items": len(report_items),
        "sft_seconds": fit.seconds, "total_seconds": time.perf_counter() - t_start,
        "torch": torch.__version__, "python": sys.version.split()[0],
    }


def _fit(config: BootstrapConfig, model: torch.nn.Module, tokenizer: Any,
         examples: list[SFTExample], eval_items: list[TaskItem], probe: _Probe,
         progress: Progress | Silent) -> _Fit:
    """SFT epochs, each measured on ``eval_items``, until the success is in the target range
    (``config.sft_epochs`` at most); keeps the epoch nearest the range (the later on a tie)."""
    lo, hi = config.target_success
    progress.note(f"SFT: up to {config.sft_epochs} epochs, stopping once held-out success is in "
                  f"[{lo}, {hi}]")
    params = list(model.parameters())
    total_steps = math.ceil(len(examples) / config.batch_size) * config.sft_epochs
    opt = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=0.0)
    sched = warmup_cosine(opt, config.warmup_steps, total_steps)
    gen = torch.Generator().manual_seed(config.seed)
    history: list[dict[str, float]] = []
    best: _Fit | None = None
    t_sft = time.perf_counter()
    for epoch in range(1, config.sft_epochs + 1):
        model.train()
        losses = sft_epoch(model, opt, sched, examples, config.batch_size, gen,
                           tokenizer.pad_token_id, params,
                           lambda _, loss: progress.advance(epoch=f"{epoch}/{config.sft_epochs}",
                                                            loss=loss))
        model.eval()
        progress.note(f"epoch {epoch}: measuring held-out success on {len(eval_items)} items")
        success = probe.measure(eval_items, 1.0, epoch)
        progress.advance(0, success=success)
        history.append({"epoch": epoch, "loss": sum(losses) / len(losses), "eval_success": success,
                        "seconds": time.perf_counter() - t_sft})
        log.info("bootstrap %s epoch %d: loss %.4f, held-out success %.3f (%.0fs)", config.family,
                 epoch, history[-1]["loss"], success, history[-1]["seconds"])
        gap = _distance(success, lo, hi)
        if best is None or gap <= best.gap:  # on a tie the later, better-fit epoch wins
            best = _Fit(history, gap, epoch, copy.deepcopy(model.state_dict()), 0.0)
        if gap == 0.0:
            break
    assert best is not None
    best.seconds = time.perf_counter() - t_sft
    return best

