"""The policy update on a group of trainer ranks, each a Ray actor in a spread placement group.

Every rank runs the project's own ``PolicyTrainer`` with its ``Ranks`` (DDP over gloo on CPU,
NCCL on GPU): the driver sends every rank the same paths and seed, each computes its own
micro-batches, the gradients are summed with the loss normaliser counted over all ranks, so the
ranks take one process's optimiser steps (tests/test_distributed_update.py). Rank 0 writes the
checkpoint (weights, tokenizer, optimiser state): a file system the driver and the engines see.

The group lives across steps, like the single-process trainer kept in ``tasks.learn``: a step
whose input checkpoint is the one the group saved last continues with the optimiser in memory;
any other (the first step, a resumed run) reloads the ranks from that directory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trace_rl.cluster import accelerator, kill_actors
from trace_rl.cluster.sync import Layout, WeightGroup, layout
from trace_rl.cluster.fsdp import FSDPTrainer, make_trainer
from trace_rl.environ import torch_threads
from trace_rl.policy.update import PathSample, PolicyTrainer, Ranks, UpdateSettings


class TrainerRank:
    """The body of one trainer actor."""

    def __init__(self, rank: int, world: int) -> None:
        import torch

        torch.set_num_threads(torch_threads())
        self.rank, self.world = rank, world
        self.trainer: PolicyTrainer | None = None
        self.weight_store: Any = None
        self.weight_group: WeightGroup | None = None

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the others (its node's address, a free port)."""
        import socket

        from trace_rl.cluster.sync import node_address

        with socket.socket() as s:
            s.bind(("", 0))
            return node_address(), s.getsockname()[1]

    def init_group(self, address: str, port: int) -> None:
        import torch
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world)

    def load(self, model_dir: str, settings: UpdateSettings, seed: int, strategy: str) -> None:
        """A new trainer (``ddp`` or ``fsdp2``) on ``model_dir`` (its optimiser state when saved
        there)."""
        self.trainer = make_trainer(strategy, model_dir, settings, seed=seed,
                                    ranks=Ranks(self.rank, self.world))

    def update(self, samples: Sequence[PathSample], rng_seed: int, lr_scale: float,
               out_dir: str) -> dict[str, float]:
        import torch

        if self.trainer is None:
            raise RuntimeError("TrainerRank.update before load")
        stats = self.trainer.update(samples, torch.Generator().manual_seed(rng_seed),
                                    lr_scale=lr_scale)
        if self.rank == 0 or isinstance(self.trainer, FSDPTrainer):  # FSDP2: every rank gathers
            t0 = time.perf_counter()
            self.trainer.save(out_dir)
            stats["save_seconds"] = time.perf_counter() - t0
        return stats

    def layout(self) -> Layout:
        return layout(self._state())

    def host_weight_group(self, world: int) -> tuple[str, int]:
        self.weight_store, address, port = WeightGroup.host(world)
        return address, port

    def join_weight_group(self, world: int) -> None:
        self.weight_group = WeightGroup.join("", 0, 0, world, store=self.weight_store)

    def send_weights(self) -> float:
        t0 = time.perf_counter()
        self.weight_group.send(self._state())
        return time.perf_counter() - t0

    def _state(self) -> dict[str, Any]:
        if isinstance(self.trainer, FSDPTrainer):  # shards: the full weights rank 0 last saved
            return dict(self.trainer.full_weights or {})
        return dict(self.trainer.model.state_dict())

    def where(self) -> tuple[int, str]:
        return os.getpid(), ray.get_runtime_context().get_node_id()


class TrainerGroup:
    """``world`` trainer actors, one per bundle of a SPREAD placement group."""

    def __init__(self, world: int, settings: UpdateSettings, seed: int,
                 gpu_share: float = 1.0, strategy: str = "ddp") -> None:
        """``gpu_share``: the GPU fraction of each rank on a GPU cluster (1: a GPU each);
        ``strategy``: ``ddp`` or ``fsdp2`` (``trace_rl.cluster.fsdp``)."""
        if world < 1:
            raise ValueError(f"TrainerGroup: world={world} ranks, need >= 1")
        self.world, self.settings, self.seed = world, settings, seed
        self.strategy = strategy
        res = accelerator()
        need = gpu_share if res == "GPU" else 1
        self.pg = placement_group([{res: need}] * world, strategy="SPREAD")
        ray.get(self.pg.ready())
        actor = ray.remote(TrainerRank)
        self.actors = [actor.options(
            num_cpus=1 if res == "CPU" else 0, num_gpus=need if res == "GPU" else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=r)).remote(r, world)
            for r in range(world)]
        address, port = ray.get(self.actors[0].address.remote())
        ray.get([a.init_group.remote(address, port) for a in self.actors])
        self.loaded: str | None = None
        """The checkpoint the ranks' models and optimisers match (None: nothing loaded)."""

    def update(self, policy_dir: str, samples: Sequence[PathSample], rng_seed: int,
               lr_scale: float, out_dir: str | Path) -> dict[str, float]:
        """One update of the policy in ``policy_dir`` on ``samples``; rank 0 saves it to
        ``out_dir``. Returns rank 0's statistics (reduced over the ranks)."""
        if self.loaded != str(policy_dir):
            ray.get([a.load.remote(str(policy_dir), self.settings, self.seed, self.strategy)
                     for a in self.actors])
        self.loaded = None
        stats = ray.get([a.update.remote(list(samples), rng_seed, lr_scale, str(out_dir))
                         for a in self.actors])[0]
        self.loaded = str(out_dir)
        return stats

    def broadcast(self, pool: Any, model_dir: str) -> float:
        """Send rank 0's weights (those saved in ``model_dir``) to every engine of ``pool``
        (``EnginePool``) over a gloo group of their own; returns seconds."""
        if self.loaded != str(model_dir):
            raise RuntimeError(f"broadcast: the trainer holds {self.loaded}, not {model_dir}")
        t0 = time.perf_counter()
        world = pool.n + 1
        if not pool.weight_group_ready:  # first sync, or an engine was replaced
            address, port = ray.get(self.actors[0].host_weight_group.remote(world))
            ray.get([self.actors[0].join_weight_group.remote(world)]
                    + [a.join_weight_group.remote(address, port, i + 1, world)
                       for i, a in enumerate(pool.actors)])
            pool.weight_group_ready = True
            self._layout = ray.get(self.actors[0].layout.remote())
        ray.get([self.actors[0].send_weights.remote(), *pool.receive_weights(model_dir, self._layout)])
        return time.perf_counter() - t0

    def where(self) -> list[tuple[int, str]]:
        return ray.get([a.where.remote() for a in self.actors])

    def close(self) -> None:
        kill_actors(self.actors)
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001
            pass
