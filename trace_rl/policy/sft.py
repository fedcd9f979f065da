"""Supervised fine-tuning on episodes, shared by the two warm starts (``trace_rl.policy.bootstrap``
for the tiny policy, ``trace_rl.policy.warmstart`` for a real model): an episode as one training
sequence with a loss mask, right-padded batches, the cross-entropy on the policy's tokens (its
shared system prompt run once per batch), one clipped AdamW step, one epoch in a seeded order,
the warm-up-then-cosine schedule, and the CPU threads to train with.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers import DynamicCache

from trace_rl.envs.base import Environment, TaskItem
from trace_rl.rollout.types import Action, Episode

IGNORE_INDEX = -100
"""Label of a token that carries no loss (transformers' convention)."""


@dataclass(frozen=True)
class SFTExample:
    """One training sequence: the episode's tokens and which of them the policy wrote."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    """1 on ``gen_ids`` tokens (trained), 0 on prompt and observation tokens."""


class ScriptedEnv:
    """``env`` with ``expert_actions`` replaced by a fixed script, so ``expert_episode`` renders
    (and really runs and grades) an imperfect trace exactly as it renders the gold one."""

    def __init__(self, env: Environment, actions: Sequence[Action]):
        self._env, self._actions = env, list(actions)

    def expert_actions(self, item: TaskItem) -> list[Action]:
        return list(self._actions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)


def episode_example(ep: Episode) -> SFTExample:
    """prompt_ids | gen_ids | obs_ids | ... as one sequence, the loss mask set on gen_ids only."""
    ids, mask = list(ep.prompt_ids), [0] * len(ep.prompt_ids)
    for turn in ep.turns:
        ids += turn.gen_ids
        mask += [1] * len(turn.gen_ids)
        ids += turn.obs_ids
        mask += [0] * len(turn.obs_ids)
    return SFTExample(tuple(ids), tuple(mask))


def sft_batch(examples: Sequence[SFTExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``/``attention_mask``/``labels`` [B, T]; labels are the token ids on
    masked-in positions and ``IGNORE_INDEX`` elsewhere (prompt, observations, padding). The model
    shifts labels itself, so position t's label is the token the model must produce there."""
    if not examples:
        raise ValueError("sft_batch: no examples")
    T = max(len(e.token_ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)  # [B, T]
    attn = torch.zeros((len(examples), T), dtype=torch.long)  # [B, T]
    labels = torch.full((len(examples), T), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    for b, e in enumerate(examples):
        if len(e.token_ids) != len(e.loss_mask):
            raise ValueError(f"sft_batch: example {b} has {len(e.token_ids)} tokens but "
                             f"{len(e.loss_mask)} mask entries")
        n = len(e.token_ids)
        row = torch.tensor(e.token_ids, dtype=torch.long)
        ids[b, :n] = row
        attn[b, :n] = 1
        keep = torch.tensor(e.loss_mask, dtype=torch.bool)
        labels[b, :n] = torch.where(keep, row, torch.full_like(row, IGNORE_INDEX))
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def shared_prefix_len(examples: Sequence[SFTExample]) -> int:
    """Leading tokens identical in every example and masked in all of them (the family's system
    prompt): ``sft_loss`` runs them once per batch instead of once per row."""
    first = examples[0].token_ids
    n = min(min(len(e.token_ids) for e in examples),
            min(e.loss_mask.index(1) if 1 in e.loss_mask else len(e.loss_mask) for e in examples))
    for e in examples[1:]:
        n = next((i for i in range(n) if e.token_ids[i] != first[i]), n)
    # The token at the split is a label of the suffix pass; keep it a masked (prompt) token.
    return max(0, n - 1)


def sft_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor], shared: int = 0) -> torch.Tensor:
    """Mean cross-entropy over the labelled tokens of ``batch`` (from ``sft_batch``).

    With ``shared > 0`` the first ``shared`` tokens (identical and unlabelled in every row) go
    through the model once, their key/value cache is repeated over the batch, and only the rest
    of each row is computed; gradients still flow into the shared part. Equal to the plain loss
    up to float rounding, for about half the compute on the synthetic families, whose system
    prompt is half of every trace.
    """
    if shared <= 0:
        return model(**batch).loss
    ids, attn, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]  # [B, T]
    cache = DynamicCache()
    model(input_ids=ids[:1, :shared], use_cache=True, past_key_values=cache)
    cache.batch_repeat_interleave(ids.shape[0])
    T = ids.shape[1]
    pos = torch.arange(shared, T)[None].expand(ids.shape[0], -1)  # [B, T - shared]
    return model(input_ids=ids[:, shared:], attention_mask=attn, position_ids=pos,
                 past_key_values=cache, use_cache=True, labels=labels[:, shared:]).loss


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int,
                  total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps``, then cosine decay to 0 at ``total_steps``."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps))
        * 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))


def sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             chunk: Sequence[SFTExample], pad_id: int, params: Sequence[torch.nn.Parameter]) -> float:
    """One optimiser step on ``chunk`` (gradient norm clipped to 1 over ``params``); its loss."""
    loss = sft_loss(model, sft_batch(chunk, pad_id), shared_prefix_len(chunk))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    scheduler.step()
    return float(loss.detach())


def sft_epoch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
              examples: Sequence[SFTExample], batch_size: int, generator: torch.Generator,
              pad_id: int, params: Sequence[torch.nn.Parameter],
              on_step: Callable[[int, float], None]) -> list[float]:
    """One pass over ``examples`` in an order drawn from ``generator``, ``batch_size`` per step;
    ``on_step(step in the epoch, loss)`` after each step. Returns the steps' losses."""
    order = torch.randperm(len(examples), generator=generator).tolist()
    losses = []
    for s in range(math.ceil(len(examples) / batch_size)):
        chunk = [examples[i] for i in order[s * batch_size:(s + 1) * batch_size]]
        losses.append(sft_step(model, optimizer, scheduler, chunk, pad_id, params))
        on_step(s, losses[-1])
    return losses


def auto_threads() -> int:
    """CPU cores not already busy (by the 1-minute load average), at least 1. On a shared 2-core
    machine a second torch thread that has to wait for a busy core costs far more than it gives
    (measured: 4x the CPU time per SFT step under load), so threads follow the idle cores."""
    cores = os.cpu_count() or 1
    return max(1, min(cores, round(cores - os.getloadavg()[0])))
