"""The project's own update with FSDP2 (``torch.distributed.fsdp.fully_shard``) instead of DDP.

``FSDPTrainer`` is a ``PolicyTrainer`` whose model is sharded over the ranks (each decoder layer a
unit, then the whole model): the parameters, their gradients and the AdamW moments live as
``DTensor`` shards, a rank holds 1/R of them between updates. The update itself is
``PolicyTrainer.update`` unchanged: the same mini-batches, micro-batch j on rank j mod R, the loss
weighted by its share of the units over all ranks.

That update has each rank compute its own micro-batches only, so ranks run different numbers of
forward passes, and FSDP2 all-gathers inside a forward: were the parameters re-sharded after each
forward, one rank would wait in an all-gather the other never enters. So the parameters are
gathered at the points every rank passes together (the start of the update, after each optimiser
step, after a KL-guard snapshot) and kept whole through the forwards and the accumulating
backwards (``reshard_after_forward=False``, ``set_reshard_after_backward(False)`` while
``set_requires_gradient_sync(False)``); the last backward of a step reduce-scatters the gradients
and re-shards. Between updates the parameters are sharded. Within an update this is ZeRO-2's
memory (whole parameters, sharded gradients and optimiser state), not ZeRO-3's.

The checkpoint is the one ``PolicyTrainer`` writes (an HF directory with the full weights and an
``optimizer.pt`` of full tensors, in the same parameter order), so a run trained with FSDP2
resumes with DDP or one process and the other way round.
"""

from __future__ import annotations

import contextlib
import inspect
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from trace_rl.policy.update import OPTIMIZER_STATE, PolicyTrainer, Ranks, UpdateSettings, save_state

STRATEGIES = ("ddp", "fsdp2")
"""How a group of trainer ranks shares the update (``TrainConfig.trainer_strategy``)."""


def full(t: Any) -> Any:
    """A ``DTensor``'s whole tensor (a collective: every rank calls it), anything else as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of an HF causal LM (``model.model.layers`` in the Qwen/Llama
    families), each its own FSDP unit; none found: the model is one unit."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def _same_optimizer(old: torch.optim.Optimizer, params: Any) -> torch.optim.Optimizer:
    """The optimiser ``PolicyTrainer`` made, again on ``params`` (the shards): same class, same
    settings (those of its ``defaults`` its constructor takes: AdamW's ``defaults`` also hold
    ``decoupled_weight_decay``, which its constructor sets itself)."""
    cls = type(old)
    takes = inspect.signature(cls).parameters
    return cls(params, **{k: v for k, v in old.defaults.items() if k in takes})


class FSDPTrainer(PolicyTrainer):
    """``PolicyTrainer`` on R ranks with FSDP2. Every rank must call ``update`` and ``save``."""

    def __init__(self, model_dir: str | Path, settings: UpdateSettings, *, seed: int = 0,
                 reference_dir: str | Path | None = None, ranks: Ranks) -> None:
        if ranks.group is not None:
            raise ValueError("FSDPTrainer: a trainer group other than the default one is not "
                             "supported (its device mesh is built on the default group)")
        # One process's trainer first (full weights, the saved optimiser state), then sharded.
        super().__init__(model_dir, settings, seed=seed, reference_dir=reference_dir)
        self.ranks = ranks
        # Every pass runs the whole sharded model: a pass that skips the frozen layers' units
        # (UpdateSettings.reuse_trunk) is not what the gathers above are arranged for.
        self.trunk = None
        saved = self.optimizer.state_dict() if (Path(model_dir) / OPTIMIZER_STATE).exists() else None
        # The mesh on the device the trainer holds the model on (CPU here: gloo; GPU untested).
        mesh = init_device_mesh(next(self.model.parameters()).device.type, (ranks.world,))
        for layer in _decoder_layers(self.model):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=False)
        self.train_model = self.model
        self.optimizer = _same_optimizer(self.optimizer, self.model.parameters())
        if saved is not None:
            self.optimizer.load_state_dict(self._sharded_optimizer_state(saved))
        self.optimizer.register_step_post_hook(lambda *_: self._gather())
        self.full_weights: dict[str, torch.Tensor] | None = None
        """Rank 0's full weights as last saved, every name of ``state_dict()`` (what a weight
        broadcast sends)."""

    def _units(self) -> Iterator[FSDPModule]:
        return (m for m in self.model.modules() if isinstance(m, FSDPModule))

    def _gather(self) -> None:
        """Every unit's whole parameters (an all-gather; every rank at the same point)."""
        for unit in self._units():
            unit.unshard()

    def _scatter(self) -> None:
        for unit in self._units():
            unit.reshard()

    def _sharded_optimizer_state(self, saved: dict) -> dict:
        """A one-process AdamW state (full tensors) cut into this rank's shards."""
        params = list(self.model.parameters())
        state = {}
        for i, per_param in saved["state"].items():
            p = params[int(i)]
            state[i] = {k: distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None)
                        if torch.is_tensor(v) and v.shape == p.shape and k != "step" else v
                        for k, v in per_param.items()}
        return {"state": state, "param_groups": saved["param_groups"]}

    def update(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self._gather()
        try:
            return super().update(*args, **kwargs)
        finally:
            self._scatter()

    def _sync(self, last: bool) -> Any:
        """Gradients accumulate unsharded and unreduced until the last backward of a step, which
        reduce-scatters them and re-shards the parameters."""
        return self._syncing(last)

    @contextlib.contextmanager
    def _syncing(self, last: bool) -> Iterator[None]:
        self.model.set_requires_gradient_sync(last)
        self.model.set_reshard_after_backward(last)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
            self.model.set_reshard_after_backward(True)

    def _snapshot(self) -> tuple[dict[str, torch.Tensor], dict]:
        snapshot = super()._snapshot()  # state_dict() re-shards the parameters
        self._gather()
        return snapshot

    def save(self, out_dir: str | Path) -> Path:
        """Gather the full weights and optimiser state (every rank), rank 0 writes them as
        ``PolicyTrainer.save`` does."""
        weights: dict[str, torch.Tensor] = {}
        untied: dict[str, torch.Tensor] = {}  # a tied tensor (lm_head = embed_tokens) once, as HF saves it
        gathered: dict[int, torch.Tensor] = {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            if id(v) not in gathered:
                gathered[id(v)] = untied[k] = full(v).detach()
            weights[k] = gathered[id(v)]
        optim = self.optimizer.state_dict()
        optim["state"] = {i: {k: full(v) for k, v in s.items()} for i, s in optim["state"].items()}
        out = Path(out_dir)
        if self.ranks.rank != 0:
            return out
        self.full_weights = weights
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(tmp, state_dict=untied, safe_serialization=True)
        self.tokenizer.save_pretrained(tmp)
        save_state(optim, tmp / OPTIMIZER_STATE)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        return out


def make_trainer(strategy: str, model_dir: str | Path, settings: UpdateSettings, *, seed: int,
                 ranks: Ranks) -> PolicyTrainer:
    """The trainer of one rank: ``ddp`` (``PolicyTrainer`` with DDP; one rank: one process) or
    ``fsdp2`` (``FSDPTrainer``; one rank: one process too, there is nothing to shard)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"trainer_strategy={strategy!r}; choose one of {STRATEGIES}")
    if strategy == "fsdp2" and ranks.world > 1:
        return FSDPTrainer(model_dir, settings, seed=seed, ranks=ranks)
    return PolicyTrainer(model_dir, settings, seed=seed, ranks=ranks)
