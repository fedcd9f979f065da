"""TRL's ``GRPOTrainer`` on this project's families: its ``rollout_func`` runs the multi-turn ReAct
loop (``trace_rl.rollout.react``) on an ``HFEngine`` that holds the trainer's current weights, the
completion being every turn's generated and observation tokens with ``env_mask`` marking the
generated ones, and the family's grader is its reward function (``Rollouts.reward``; a
stateful family's, function calling, grades in the rollout, where the episode's state is). TRL is the
optional extra ``peers`` (``pip install -e .[peers] -c requirements/cpu-constraints.txt``),
imported only where a function here needs it. ``bench/peers.py`` compares this with the train
flow.

    rollouts = Rollouts(cfg, policy, env, items, seed)
    trainer = grpo_trainer(cfg, policy, rollouts, out_dir)
    trainer.train()
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from trace_rl.config import TrainConfig
from trace_rl.envs.base import Environment, TaskItem


class Rollouts:
    """TRL's ``rollout_func`` for ``env``'s ``items`` (prompts are their questions): one start per
    run of equal consecutive prompts (TRL repeats each prompt ``num_generations`` times), K
    completions each, sampled with ``cfg``'s settings. Counts the generated tokens, the calls, the
    seconds spent and the rewards that differ from the loop's (``reward``)."""

    def __init__(self, cfg: TrainConfig, policy: str, env: Environment,
                 items: Mapping[str, TaskItem], seed: int) -> None:
        from trace_rl.engines import context_limit
        from trace_rl.engines.hf import HFEngine

        self.cfg, self.env, self.seed = cfg, env, seed
        self.questions = [it.question for it in items.values()]
        self.by_question = {it.question: it for it in items.values()}
        self.engine = HFEngine(policy, seed=seed)
        self.max_context = context_limit(policy)
        self.calls = 0
        self.generated_tokens = 0
        self.rollout_s = 0.0
        self.reward_mismatches = 0

    COUNTERS = ("calls", "generated_tokens", "rollout_s", "reward_mismatches")

    def counters(self) -> dict[str, float]:
        """What a resumed run must carry over: the calls made (each call's sampling seed follows
        from their number), the tokens generated, the seconds spent, the rewards that differed."""
        return {k: getattr(self, k) for k in self.COUNTERS}

    def restore(self, counters: Mapping[str, float]) -> None:
        """Continue from ``counters`` (a checkpoint's): the next call samples as the
        uninterrupted run's next call would."""
        for k in self.COUNTERS:
            setattr(self, k, type(getattr(self, k))(counters[k]))

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        from trace_rl.policy.sft import episode_example
        from trace_rl.rollout.react import Start, run_episodes
        from trace_rl.rollout.types import SamplingSettings

        t0 = time.perf_counter()
        self.engine.load_tensors({k: v.detach() for k, v in trainer.model.state_dict().items()})
        starts = [Start(self.by_question[p], (), len(list(same)))
                  for p, same in itertools.groupby(prompts)]
        cfg = self.cfg
        episodes = run_episodes(self.engine, self.env, starts,
                                sampling=SamplingSettings(max_tokens=cfg.max_new_tokens,
                                                          temperature=cfg.temperature, seed=cfg.seed),
                                max_turns=cfg.max_turns, tool_timeout_s=cfg.tool_timeout_s,
                                seed=self.seed * 100_003 + self.calls, max_context=self.max_context)
        self.calls += 1
        rows = []
        for ep in episodes:
            ex, n = episode_example(ep), len(ep.prompt_ids)
            self.generated_tokens += sum(len(t.gen_ids) for t in ep.turns)
            last = ep.turns[-1].action if ep.turns else None
            answered = last is not None and last.kind == "answer"
            rows.append({"prompt_ids": list(ep.prompt_ids), "completion_ids": list(ex.token_ids[n:]),
                         "logprobs": [x for t in ep.turns
                                      for x in [*t.gen_logprobs, *[0.0] * len(t.obs_ids)]],
                         "env_mask": list(ex.loss_mask[n:]), "answer": last.answer if answered else None,
                         "answered": answered, "episode_reward": float(ep.reward or 0.0)})
        self.rollout_s += time.perf_counter() - t0
        return {k: [r[k] for r in rows] for k in rows[0]}

    def reward(self, prompts: list[str], completions: list[Any], answer: list[Any],
               answered: list[bool], episode_reward: list[float], **_: Any) -> list[float]:
        """The family's grader as a TRL reward function: the final answer graded against the
        item's gold (0 when the episode ended without one: turn cap, context or a bad action).
        Counts where it differs from the reward the ReAct loop gave the episode (none expected).
        A stateful family's grade needs the episode's final state (function calling checks the
        calls made, ``Environment.verify_final``), which only the rollout sees: its reward is
        the one the loop gave, handed over by the rollout function."""
        if self.env.stateful:
            return [float(r) for r in episode_reward]
        out = [float(self.env.verify(self.by_question[p], a).reward) if ok else 0.0
               for p, a, ok in zip(prompts, answer, answered)]
        self.reward_mismatches += sum(x != y for x, y in zip(out, episode_reward))
        return out


def grpo_config(cfg: TrainConfig, seed: int, out_dir: Path, save_every: int = 0) -> Any:
    """TRL's ``GRPOConfig`` on CPU: ``cfg``'s settings where both have one (the steps, learning
    rate, clipping, KL, group size, epochs, temperature), a batch of ``cfg.leaf_budget``
    completions a step, TRL's defaults for the rest; nothing reported, and nothing saved unless
    ``save_every`` (optimiser steps): then a resumable checkpoint (weights, optimiser, RNG) that
    often, the newest two kept."""
    from trl import GRPOConfig

    saving = ({"save_strategy": "steps", "save_steps": save_every, "save_total_limit": 2}
              if save_every else {"save_strategy": "no"})
    return GRPOConfig(
        output_dir=str(out_dir), seed=seed, data_seed=seed, use_cpu=True, report_to="none",
        **saving, logging_steps=10 ** 6, disable_tqdm=True,
        max_steps=cfg.steps * cfg.ppo_epochs, learning_rate=cfg.learning_rate,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=cfg.leaf_budget, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=cfg.group_size, num_iterations=cfg.ppo_epochs,
        epsilon=cfg.clip_low, epsilon_high=cfg.clip_high, beta=cfg.kl_coef,
        temperature=cfg.temperature, top_p=1.0,
        max_completion_length=cfg.max_turns * (cfg.max_new_tokens + 64),
        loss_type="dapo", scale_rewards="group", shuffle_dataset=True,  # TRL's defaults
        dataloader_num_workers=0, bf16=False, fp16=False)


def grpo_trainer(cfg: TrainConfig, policy: str, rollouts: Rollouts, out_dir: Path,
                 callbacks: Sequence[Any] = (), save_every: int = 0) -> Any:
    """TRL's ``GRPOTrainer`` from ``policy`` (float32) on ``rollouts``' prompts, sampled through
    it and rewarded by ``rollouts.reward`` (``grpo_config``'s settings, seed ``rollouts.seed``),
    training the same parameters as the train flow (``cfg.trainable_layers``: the top decoder
    layers only, the rest frozen)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from trace_rl.policy.freeze import freeze_lower_layers

    tokenizer = AutoTokenizer.from_pretrained(policy)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    freeze_lower_layers(model, cfg.trainable_layers)
    args = grpo_config(cfg, rollouts.seed, out_dir, save_every)
    return GRPOTrainer(model=model, reward_funcs=rollouts.reward, args=args,
                       train_dataset=datasets.Dataset.from_list(
                           [{"prompt": q} for q in rollouts.questions]),
                       processing_class=tokenizer, rollout_func=rollouts, callbacks=list(callbacks))
