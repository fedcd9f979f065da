"""The policy update on root-to-leaf paths (TreePO-style): tokens, masks, advantages -> AdamW.

Every root-to-leaf path of a step's trees is one training sequence: the prompt, then per turn the
policy's tokens (trained, advantage of that turn) and the observation tokens (masked). The loss is
``trace_core.loss.policy_loss``; old log-probs are recomputed with the pre-update weights (one
forward pass, as verl does), so the first epoch has ratio 1 and later epochs are clipped.

On R ranks of a torch.distributed group (``Ranks``; the Ray trainer group of
``trace_rl.cluster``), every rank builds the same mini-batches and micro-batches from the same
paths and seed, computes the old log-probs and the backward pass of its own micro-batches only
(micro-batch j belongs to rank j mod R), and DDP sums the gradients. Each micro-batch's loss is
weighted by its share of the mini-batch's units (tokens or sequences) counted over all ranks, so
the summed gradient is one process's: R ranks take the same optimiser steps as one process.
The KL guard's statistics and the returned statistics are reduced over the ranks too.
"""

from __future__ import annotations

import contextlib
import copy
import math
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trace_core.loss import engine_mismatch, policy_loss, tis_weights
from trace_core.seeds import GLOBAL_TORCH_RNG
from trace_rl.policy.freeze import freeze_lower_layers
from trace_rl.policy.logprobs import TOP_K, position_kl, token_logprobs, with_top  # noqa: F401 (re-exported)
from trace_rl.policy.packing import Packed, pack, packing_agrees, worth_packing
from trace_rl.policy.trunk import FrozenTrunk

OPTIMIZER_STATE = "optimizer.pt"
"""File of a policy checkpoint that holds the AdamW state (what resuming a run needs)."""


def save_state(state: Any, path: Path) -> None:
    """``torch.save`` without the zip records' CRC-32 (the optimiser state, 27 MB for the tiny
    policy, every step: ~33 ms here, ~48 with CRCs). A checkpoint is written under a temporary
    name and renamed whole, so a torn file is never read; ``torch.load`` reads it as usual."""
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(state, path)
    finally:
        torch.serialization.set_crc32_options(crc)


@dataclass(frozen=True)
class PathSample:
    """One training sequence."""

    token_ids: Sequence[int]
    loss_mask: Sequence[int]  # 1 on policy tokens
    advantages: Sequence[float]  # per token (0 where masked)
    group: int = -1
    """The tree (prompt group) of the path; -1 = a group of its own. A mini-batch holds whole
    groups, so the advantages of each optimiser step stay centred as they are within a group."""
    engine_logprobs: Sequence[float] | None = None
    """Per token, the rollout engine's log-prob of the sampled token (0 where ``loss_mask`` is
    0); None = not known. With it the update measures the engine/trainer mismatch and can apply
    truncated importance sampling (``UpdateSettings.tis_cap``)."""


@dataclass(frozen=True, kw_only=True)
class UpdateSettings:
    """The policy update's knobs. No defaults for those a training run sets: they come from
    ``trace_rl.config.sections.Update.update_settings``, where each is documented."""

    learning_rate: float
    clip_low: float
    clip_high: float
    kl_coef: float
    epochs: int
    micro_batch: int
    agg: str
    mini_batches: int
    """Optimiser steps per epoch (at most one per ``micro_batch`` paths): the step's paths are
    split into this many mini-batches of whole groups (``PathSample.group``, balanced in size)
    and the gradients of a mini-batch's micro-batches are accumulated (weighted so the mini-batch loss
    is ``agg`` over all of its paths) before one clipped AdamW step."""
    target_kl: float
    """Trust-region guard (0 = off): after each optimiser step the mini-batch it used is scored
    again; if the approximate KL of the sampling policy from the updated one (k3, mean over
    policy tokens) exceeds this, that step is undone (weights and AdamW moments) and the update
    ends there. PPO implementations stop early on the same statistic (SB3's and TRL's
    ``target_kl``); undoing the step as well keeps a single overshooting step from landing."""
    target_position_kl: float
    """Position-wise guard (0 = off): as ``target_kl``, on the largest KL(sampling || updated)
    of the next-token distribution at one policy-token position of the mini-batch
    (``position_kl``). Catches a step that moves one likely token (a turn's first token) far,
    which the mean over a path's tokens dilutes."""
    trainable_layers: int = 0
    """Only the top this-many decoder layers (and the final norm) are trained; 0 = every
    parameter (``trace_rl.policy.freeze``). The optimiser holds every parameter either way (a
    frozen one never gets a gradient, so AdamW keeps no state for it), so checkpoints and the
    FSDP2 trainer see one parameter order."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip of each optimiser step (not a run parameter)."""
    clip_ratio_c: float = 0.0
    """Dual clip of the policy loss (0 = off; else > 1 + ``clip_high``): a negative-advantage
    token whose ratio exceeds it gets no gradient (``trace_core.loss.policy_loss``)."""
    tis_cap: float = 0.0
    """Truncated importance sampling (0 = off; else the cap C >= 1): each policy token's loss is
    weighted by min(pi_train / pi_engine, C), the trainer's probability of the sampled token over
    the engine's (``trace_core.loss.tis_weights``). Needs every path's ``engine_logprobs``."""
    reuse_trunk: bool = True
    """With ``trainable_layers`` leaving frozen layers below, keep their output for each of this
    rank's micro-batches from the old log-probs' forward and run only the trainable layers in the
    update's later passes (``trace_rl.policy.trunk``): the same logits, fewer layers computed,
    one hidden-state tensor per micro-batch held for the update (not a run parameter)."""
    pack: bool = True
    """Run each micro-batch as one packed row of its distinct prefixes instead of a padded batch
    (``trace_rl.policy.packing``), where that computes less (``worth_packing``): the same
    log-probs, loss and gradients to float rounding, each prefix that paths share computed once
    and no padding (not a run parameter). The trainer compares the two on its first micro-batch
    and packs no more, with a warning, where they differ."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in a group of trainer ranks (torch.distributed, initialised by the
    caller: gloo on CPU, NCCL on GPU)."""

    rank: int
    world: int
    group: Any = None
    """The process group of the trainers (None: the default group)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"Ranks: rank={self.rank} outside [0, world={self.world})")

    def owns(self, micro_batch: int) -> bool:
        """Whether this rank computes micro-batch ``micro_batch`` (numbered over the update)."""
        return micro_batch % self.world == self.rank


def _pad(samples: Sequence[PathSample], pad_id: int) -> dict[str, torch.Tensor]:
    T = max(len(s.token_ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, T), pad_id, dtype=torch.long)  # [B, T]
    attn = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    adv = torch.zeros((B, T), dtype=torch.float32)
    known = all(s.engine_logprobs is not None for s in samples)
    engine = torch.zeros((B, T), dtype=torch.float32) if known else None
    for b, s in enumerate(samples):
        n = len(s.token_ids)
        ids[b, :n] = torch.tensor(list(s.token_ids))
        attn[b, :n] = 1
        mask[b, :n] = torch.tensor(list(s.loss_mask), dtype=torch.float32)
        adv[b, :n] = torch.tensor(list(s.advantages), dtype=torch.float32)
        if known:
            engine[b, :n] = torch.tensor(list(s.engine_logprobs), dtype=torch.float32)
    out = {"ids": ids, "attn": attn, "mask": mask, "adv": adv}
    if known:
        out["engine"] = engine
    return out


def _whole_group_bins(samples: Sequence[PathSample], n: int, rng: torch.Generator) -> list[list[int]]:
    """``n`` lists of sample indices: the groups in random order, each whole, each to the list
    with the fewest paths so far (sizes differ by at most the largest group); empty lists
    dropped. Paths of group -1 are groups of their own."""
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(samples):
        groups.setdefault(x.group if x.group >= 0 else -1 - i, []).append(i)
    keys = list(groups)
    bins: list[list[int]] = [[] for _ in range(n)]
    for k in torch.randperm(len(keys), generator=rng).tolist():
        min(bins, key=len).extend(groups[keys[k]])
    return [b for b in bins if b]


def _add_mismatch(sums: dict[str, float], part: dict[str, float], weighted: bool = True) -> None:
    """Adds one batch's ``engine_mismatch`` (means over its tokens; ``weighted``: turned into
    token-weighted sums) or another rank's sums to ``sums``; the max is kept as a max."""
    n = part.get("mismatch_tokens", 0.0)
    if not n:
        return
    scale = n if weighted else 1.0
    for k in ("mismatch_abs_mean", "mismatch_kl"):
        sums[k] = sums.get(k, 0.0) + part[k] * scale
    sums["mismatch_kl_max"] = max(sums.get("mismatch_kl_max", 0.0), part["mismatch_kl_max"])
    sums["mismatch_tokens"] = sums.get("mismatch_tokens", 0.0) + n


def warmup_scale(warmup_steps: int, step: int) -> float:
    """Learning-rate factor of RL step ``step`` (0-based) under a linear warm-up over
    ``warmup_steps`` steps: (step + 1) / warmup_steps, then 1 (0 steps: always 1); what
    ``PolicyTrainer.update`` takes as ``lr_scale``."""
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)


@dataclass
class _Micro:
    """One micro-batch of an update: padded tensors, and (on the rank that computes it) the
    sampling policy's and the reference's token log-probs."""

    index: int
    """Its number over the update (micro-batch j belongs to rank j mod R)."""
    batch: dict[str, Any]
    old: torch.Tensor | None
    ref: torch.Tensor | None
    units: float
    """What ``agg`` averages over in it: policy tokens, or sequences with any."""
    hidden: torch.Tensor | None = None
    """The frozen trunk's output for it (``UpdateSettings.reuse_trunk``), or None."""
    weights: torch.Tensor | None = None
    """Truncated importance weights of its tokens (``UpdateSettings.tis_cap``), or None."""


@dataclass
class _Tally:
    """Running sums of one ``PolicyTrainer.update`` call."""

    totals: dict[str, float] = field(default_factory=dict)
    """Per-micro-batch statistics of ``policy_loss`` (and the loss), summed."""
    grad_norms: float = 0.0
    n_micro: int = 0
    n_updates: int = 0
    stopped: bool = False
    kl_max: float = 0.0
    """Largest mini-batch KL after an optimiser step (with the guard on)."""
    token_max: float = 0.0
    """Largest single-token k3 among those mini-batches."""
    position_max: float = 0.0
    """Largest next-token-distribution KL at one position among them."""
    mismatch: dict[str, float] = field(default_factory=dict)
    """Engine/trainer mismatch of this rank's micro-batches: token-weighted sums, and the max."""


class PolicyTrainer:
    """Holds the policy, its optimiser and (for KL) a frozen reference, across steps."""

    def __init__(self, model_dir: str | Path, settings: UpdateSettings, *, seed: int = 0,
                 reference_dir: str | Path | None = None, ranks: Ranks | None = None):
        """``ranks``: this trainer's place in a group of ranks (None: one process). Built under
        ``GLOBAL_TORCH_RNG``: it seeds torch's global generator, which the predictor's init, fit
        beside the update, seeds and draws from too."""
        with GLOBAL_TORCH_RNG:
            self._build(model_dir, settings, seed, reference_dir, ranks)

    def _build(self, model_dir: str | Path, settings: UpdateSettings, seed: int,
               reference_dir: str | Path | None, ranks: Ranks | None) -> None:
        # Here, not at module level: importing the flows (deployments.deploy, a flow run's start,
        # the CLI) need not pay transformers' ~3 s of CPU until a trainer is built.
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.ranks = ranks if ranks is not None and ranks.world > 1 else None
        self.settings = settings
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model.train()
        self.trainable = freeze_lower_layers(self.model, settings.trainable_layers)
        self.trunk: FrozenTrunk | None = None
        if settings.reuse_trunk and 0 < settings.trainable_layers < len(self.model.model.layers):
            self.trunk = FrozenTrunk(self.model, settings.trainable_layers)
        self._trunk_checked = False
        self.pack = settings.pack
        self._pack_checked = False
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.learning_rate,
                                           weight_decay=0.0)
        opt_path = Path(model_dir) / OPTIMIZER_STATE
        if opt_path.exists():
            self.optimizer.load_state_dict(torch.load(opt_path, weights_only=True))
            for group in self.optimizer.param_groups:  # the saved state carries the old lr
                group["lr"] = settings.learning_rate
        self.reference = None
        if settings.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(
                str(reference_dir or model_dir), dtype=torch.float32).eval()
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.tokenizer.eos_token_id or 0)
        # The training forward; DDP sums the ranks' gradients on the last backward of a step.
        self.train_model: torch.nn.Module = self.model
        if self.ranks is not None:
            self.train_model = DistributedDataParallel(self.model, process_group=self.ranks.group)

    def _owns(self, micro_batch: int) -> bool:
        return self.ranks is None or self.ranks.owns(micro_batch)

    def update(self, samples: Sequence[PathSample], rng: torch.Generator, *,
               lr_scale: float = 1.0) -> dict[str, float]:
        """Epochs of clipped PG over the samples in micro-batches; returns mean statistics.
        ``lr_scale`` multiplies the learning rate for this call (a warm-up schedule)."""
        s = self.settings
        if not 0.0 < lr_scale <= 1.0:
            raise ValueError(f"lr_scale must be in (0, 1], got {lr_scale}")
        for group in self.optimizer.param_groups:
            group["lr"] = s.learning_rate * lr_scale
        trainable = [x for x in samples if any(m and a != 0 for m, a in zip(x.loss_mask, x.advantages))]
        stats: dict[str, float] = {"paths": float(len(samples)), "paths_with_signal": float(len(trainable))}
        if not trainable:
            return stats
        t0 = time.perf_counter()
        tally = _Tally()
        minis, micros = self._micro_batches(trainable, rng, tally)
        for _ in range(s.epochs):
            if tally.stopped:
                break
            for m in torch.randperm(len(minis), generator=rng).tolist():
                if self._optimiser_step([micros[j] for j in minis[m]], tally):
                    break
        if self.ranks is not None:  # every rank's sums
            tally.totals, tally.n_micro = self._gather_totals(tally.totals, tally.n_micro)
        tally.totals["grad_norm"] = tally.grad_norms
        stats.update({k: v / tally.n_micro for k, v in tally.totals.items()})
        if s.target_kl > 0 or s.target_position_kl > 0:
            stats["kl_after_step_max"] = tally.kl_max
            stats["kl_token_max"] = tally.token_max
            stats["kl_position_max"] = tally.position_max
            stats["kl_stopped"] = float(tally.stopped)
        stats.update(self._mismatch_stats(tally.mismatch))
        stats["updates"] = float(tally.n_updates)
        stats["lr"] = s.learning_rate * lr_scale
        stats["seconds"] = time.perf_counter() - t0
        return stats

    def _micro_batches(self, trainable: Sequence[PathSample], rng: torch.Generator, tally: _Tally
                       ) -> tuple[list[list[int]], list[_Micro]]:
        """(per mini-batch the indices of its micro-batches, the micro-batches): mini-batches of
        whole groups (fixed for the call), each split into micro-batches of ``micro_batch`` paths,
        numbered over the update. This rank's own micro-batches carry the sampling policy's
        log-probs (and top-k next-token log-probs, for the position guard) and the reference's;
        where the paths carry the engine's log-probs, their mismatch with the sampling policy's is
        added to ``tally`` and, with TIS on, the micro-batch gets its importance weights."""
        s = self.settings
        if s.tis_cap and any(x.engine_logprobs is None for x in trainable):
            raise ValueError("tis_cap > 0 needs the engine's log-probs of every path "
                             "(PathSample.engine_logprobs), and some paths have none")
        n_mini = max(1, min(s.mini_batches, math.ceil(len(trainable) / s.micro_batch)))
        minis: list[list[int]] = []
        micros: list[_Micro] = []
        with torch.no_grad():
            for paths in _whole_group_bins(trainable, n_mini, rng):
                minis.append([])
                for i in range(0, len(paths), s.micro_batch):
                    part = [trainable[j] for j in paths[i:i + s.micro_batch]]
                    b = _pad(part, self.pad_id)
                    old = ref = hidden = None
                    if self._owns(len(micros)):  # another rank's micro-batch: its units only
                        packed = b["packed"] = self._packing(part, b)
                        with self.trunk.capture() if self.trunk else contextlib.nullcontext([]) as kept:
                            old, b["top_ids"], b["top_logp"] = with_top(self.model, b["ids"], b["attn"],
                                                                        packed=packed)
                        hidden = kept[0] if kept and self._trunk_agrees(b, kept[0], old) else None
                        ref = token_logprobs(self.reference, b["ids"], b["attn"], packed=packed) \
                            if self.reference else None
                    weights = None
                    if old is not None and "engine" in b:
                        _add_mismatch(tally.mismatch, engine_mismatch(old, b["engine"], b["mask"]))
                        if s.tis_cap:
                            weights = tis_weights(old, b["engine"], b["mask"], s.tis_cap)
                    minis[-1].append(len(micros))
                    # What the aggregation averages over: tokens or sequences.
                    units = float(b["mask"].sum()) if s.agg == "token-mean" \
                        else float((b["mask"].sum(dim=1) > 0).sum())
                    micros.append(_Micro(len(micros), b, old, ref, units, hidden, weights))
        return minis, micros

    def _packing(self, part: Sequence[PathSample], b: dict[str, Any]) -> Packed | None:
        """The micro-batch ``part`` (padded as ``b``) packed, or None: packing off, or the
        padded batch computes less. On the first micro-batch this process packs for the model's
        shape, the packed log-probs are compared with the padded batch's; where they differ,
        packing is turned off (``packing_agrees``)."""
        if not self.pack:
            return None
        packed = pack([x.token_ids for x in part])
        B, T = b["ids"].shape
        if not worth_packing(packed, B, T, self.model.config):
            return None
        if not self._pack_checked:
            self._pack_checked = True
            def measure() -> float:
                padded = token_logprobs(self.model, b["ids"], b["attn"])
                return float(((token_logprobs(self.model, b["ids"], b["attn"], packed=packed)
                               - padded).abs() * b["attn"]).max())

            agrees, gap = packing_agrees(self.model, measure)
            if not agrees:
                if gap is not None:
                    warnings.warn(f"pack: {type(self.model).__name__} on the packed micro-batch "
                                  f"gives log-probs {gap:.2g} away from the padded batch's; "
                                  "running padded micro-batches instead", stacklevel=3)
                self.pack = False
                return None
        return packed

    def _trunk_agrees(self, b: dict[str, torch.Tensor], hidden: torch.Tensor,
                      old: torch.Tensor) -> bool:
        """Whether the trainable layers on the kept trunk output give the whole model's log-probs
        (checked once, on the first micro-batch; where they do not, the reuse is turned off)."""
        if self._trunk_checked:
            return self.trunk is not None
        self._trunk_checked = True
        with self.trunk.top_only():
            cut = token_logprobs(self.model, b["ids"], b["attn"], hidden, packed=b.get("packed"))
        gap = float(((cut - old).abs() * b["attn"]).max())
        if gap > 1e-4:
            warnings.warn(f"reuse_trunk: {type(self.model).__name__}'s trainable layers on the "
                          f"frozen trunk's output give log-probs {gap:.2g} away from the whole "
                          "model's; computing the whole model in every pass instead", stacklevel=2)
            self.trunk = None
        return self.trunk is not None

    def _cut(self, mb: _Micro) -> Any:
        """Within it, the model runs on ``mb``'s kept trunk output (where it has one)."""
        return self.trunk.top_only() if mb.hidden is not None and self.trunk else contextlib.nullcontext()

    def _optimiser_step(self, chunk: Sequence[_Micro], tally: _Tally) -> bool:
        """One clipped AdamW step on a mini-batch: the backward of this rank's micro-batches, each
        weighted by its share of the mini-batch's units over all ranks; with a KL guard on, the
        step is undone when it moved the policy too far. Returns whether the update stops."""
        s = self.settings
        guarded = s.target_kl > 0 or s.target_position_kl > 0
        snapshot = self._snapshot() if guarded else None
        self.optimizer.zero_grad(set_to_none=True)
        total_units = sum(mb.units for mb in chunk)  # over every rank's micro-batches
        mine = [mb for mb in chunk if self._owns(mb.index)]
        for n, mb in enumerate(mine):
            self._backward(mb, mb.units / total_units, n == len(mine) - 1, tally)
        if not mine and self.ranks is not None:
            self._empty_backward(chunk[0].batch)  # DDP's all-reduce needs every rank
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), s.max_grad_norm)
        self.optimizer.step()
        tally.grad_norms += float(gn) * len(chunk)
        tally.n_updates += 1
        if snapshot is None:
            return False
        kl, tok, pos = self._kl_after(mine)
        tally.kl_max, tally.token_max = max(tally.kl_max, kl), max(tally.token_max, tok)
        tally.position_max = max(tally.position_max, pos)
        if (0 < s.target_kl < kl) or (0 < s.target_position_kl < pos):
            self._restore(snapshot)
            tally.n_updates -= 1
            tally.stopped = True
        return tally.stopped

    def _backward(self, mb: _Micro, share: float, last: bool, tally: _Tally) -> None:
        """The policy loss of one micro-batch, its backward weighted by ``share`` of the
        mini-batch (DDP's all-reduce on the ``last`` one), its statistics added to ``tally``."""
        s = self.settings
        b = mb.batch
        with self._sync(last=last), self._cut(mb):
            logp = token_logprobs(self.train_model, b["ids"], b["attn"], mb.hidden,
                                  packed=b.get("packed"))
            loss, st = policy_loss(logp, mb.old, b["adv"], b["mask"], clip_low=s.clip_low,
                                   clip_high=s.clip_high, ref_logp=mb.ref,
                                   kl_coef=s.kl_coef, agg=s.agg, clip_ratio_c=s.clip_ratio_c,
                                   is_weights=mb.weights)
            # DDP averages the ranks' gradients: scaled by R, they sum.
            (loss * (share * self._world)).backward()
        st = dict(st)
        st["loss"] = float(loss.detach())
        for k, v in st.items():
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                tally.totals[k] = tally.totals.get(k, 0.0) + float(v)
        tally.n_micro += 1

    @property
    def _world(self) -> int:
        return 1 if self.ranks is None else self.ranks.world

    def _sync(self, last: bool) -> Any:
        """DDP's all-reduce runs on the last backward of an optimiser step (``no_sync`` before)."""
        if self.ranks is None or last:
            return contextlib.nullcontext()
        return self.train_model.no_sync()

    def _empty_backward(self, b: dict[str, torch.Tensor]) -> None:
        """A zero-weighted backward, for a rank with no micro-batch in an optimiser step: DDP's
        all-reduce must be entered by every rank, and this rank adds nothing to the sum."""
        logits = self.train_model(input_ids=b["ids"][:1, :2], attention_mask=b["attn"][:1, :2]).logits
        (logits.sum() * 0.0).backward()

    def _mismatch_stats(self, sums: dict[str, float]) -> dict[str, float]:
        """The update's engine/trainer mismatch over every rank's policy tokens (empty when the
        paths carried no engine log-probs)."""
        if self.ranks is not None:
            parts: list[Any] = [None] * self._world
            dist.all_gather_object(parts, sums, group=self.ranks.group)
            sums = {}
            for part in parts:
                _add_mismatch(sums, part, weighted=False)
        n = sums.get("mismatch_tokens", 0.0)
        if not n:
            return {}
        return {"mismatch_abs_mean": sums["mismatch_abs_mean"] / n,
                "mismatch_kl": sums["mismatch_kl"] / n, "mismatch_kl_max": sums["mismatch_kl_max"],
                "mismatch_tokens": n}

    def _gather_totals(self, totals: dict[str, float], n_micro: int) -> tuple[dict[str, float], int]:
        parts: list[Any] = [None] * self._world
        dist.all_gather_object(parts, (totals, n_micro), group=self.ranks.group)
        merged: dict[str, float] = {}
        for part, _ in parts:
            for k, v in part.items():
                merged[k] = merged.get(k, 0.0) + v
        return merged, sum(n for _, n in parts)

    def _snapshot(self) -> tuple[dict[str, torch.Tensor], dict]:
        weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return weights, copy.deepcopy(self.optimizer.state_dict())

    def _restore(self, snapshot: tuple[dict[str, torch.Tensor], dict]) -> None:
        weights, optimizer = snapshot
        self.model.load_state_dict(weights)
        self.optimizer.load_state_dict(optimizer)

    @torch.no_grad()
    def _kl_after(self, batches: Sequence[_Micro]) -> tuple[float, float, float]:
        """(``policy_loss``'s approx_kl, k3 of the sampling policy from the current one, over the
        policy tokens of ``batches``; its approx_kl_max, the largest k3 of one token; the largest
        ``position_kl`` at a policy token's position). The mean is what ``target_kl`` reads;
        the position-wise KL is what ``target_position_kl`` reads: a move at one position that
        the mean dilutes (a turn's first token collapsing, seen in runs that lost the format)."""
        total = count = top = worst = 0.0
        for mb in batches:
            b = mb.batch
            with self._cut(mb):
                logp, _, new_top = with_top(self.model, b["ids"], b["attn"], keep=b["top_ids"],
                                            hidden=mb.hidden, packed=b.get("packed"))
            _, st = policy_loss(logp, mb.old, b["adv"], b["mask"])
            total += st["approx_kl"] * st["n_tokens"]
            count += st["n_tokens"]
            top = max(top, st["approx_kl_max"])
            kl = position_kl(b["top_logp"], new_top)  # [B, T]
            worst = max(worst, float((kl * b["mask"]).max()))
        if self.ranks is not None:  # the whole mini-batch's: every rank takes the same decision
            sums = torch.tensor([total, count], dtype=torch.float64)
            maxima = torch.tensor([top, worst], dtype=torch.float64)
            dist.all_reduce(sums, group=self.ranks.group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.ranks.group)
            (total, count), (top, worst) = sums.tolist(), maxima.tolist()
        return total / max(count, 1.0), top, worst

    def save(self, out_dir: str | Path) -> Path:
        """Write the policy as an HF directory (what the engines load) plus the optimiser state."""
        out = Path(out_dir)
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            self.model.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            save_state(self.optimizer.state_dict(), tmp / OPTIMIZER_STATE)
        except BaseException:  # a full disk: no half-written copy left holding the space
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)  # a kill mid-save never leaves a half-written checkpoint under `out`
        return out
