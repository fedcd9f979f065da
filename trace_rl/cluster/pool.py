"""A pool of rollout engines as Ray actors, behind the same ``Engine`` protocol as one engine.

``EnginePool.generate`` splits a batch of requests between the engine actors and returns the
completions in the order of the requests, so ``run_episodes`` and the expansion tasks use a pool
exactly as they use one engine. Routing is sticky: every request with the same
``GenRequest.affinity`` (the rollout loop sets the item, i.e. its tree) goes to the same engine,
so a tree's continuations find their shared prefix in that engine's prefix cache; a new affinity
goes to the engine holding the fewest. ``routing="round_robin"`` spreads requests one by one
instead (bench/scale.py compares the two). A weight sync starts a new routing table: every
engine's prefix cache was emptied.

Sampling is seeded per request (``SamplingSettings.seed``), so the engine a request lands on
does not change its completion: a pool returns the completions one engine would, up to the
float rounding of batching requests differently.

Fault tolerance: when an engine actor dies mid-batch (its process killed, its node lost, Ray's
memory monitor), its share of the batch is sent again to a new actor started on the current
weights (the last checkpoint directory synced); the batch's results keep their order, so no node
is lost or duplicated. After ``max_replacements`` replacements in one ``generate`` call the error is raised
(Prefect's task retry then re-runs the phase).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import ray
from ray.exceptions import OutOfMemoryError, RayActorError

from trace_rl.cluster import accelerator, kill_actors
from trace_rl.cluster.sync import Layout, WeightGroup
from trace_rl.engines import make_engine
from trace_rl.environ import torch_threads
from trace_rl.rollout.types import Completion, GenRequest

ROUTINGS = ("sticky", "round_robin")


class EngineWorker:
    """The body of one engine actor: an engine of ``kind`` serving ``model_dir``."""

    def __init__(self, kind: str, model_dir: str, opts: dict[str, Any]) -> None:
        import torch

        torch.set_num_threads(torch_threads())
        t0 = time.perf_counter()
        self.engine = make_engine(kind, model_dir, **opts)
        self.group: WeightGroup | None = None
        print(f"{kind} engine ready on {model_dir} in {time.perf_counter() - t0:.1f} s "
              f"(pid {os.getpid()})", flush=True)

    def generate(self, requests: Sequence[GenRequest]) -> list[list[Completion]]:
        return self.engine.generate(requests)

    def load_weights(self, model_dir: str) -> float:
        return self.engine.load_weights(model_dir)

    def join_weight_group(self, address: str, port: int, rank: int, world: int) -> None:
        self.group = WeightGroup.join(address, port, rank, world)

    def receive_weights(self, shapes: Layout) -> float:
        """Take part in a broadcast from trainer rank 0 and load what it sent; seconds."""
        if self.group is None:
            raise RuntimeError("receive_weights: this engine has not joined a weight group")
        t0 = time.perf_counter()
        self.engine.load_tensors(self.group.receive(shapes))
        return time.perf_counter() - t0

    def prefix_cache_stats(self) -> tuple[int, int]:
        stats = getattr(self.engine, "prefix_cache_stats", None)
        return stats() if stats is not None else (0, 0)

    def where(self) -> tuple[int, str]:
        """(pid, Ray node id) of this actor."""
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        self.engine.close()


class EnginePool:
    """``n`` engine actors of ``kind``; see the module docstring."""

    def __init__(self, kind: str, model_dir: str | Path, n: int, *, routing: str = "sticky",
                 max_replacements: int = 2, gpu_share: float = 1.0, **opts: Any) -> None:
        """``gpu_share``: the GPU fraction each engine actor asks for on a GPU cluster (below 1,
        several engines share a GPU: set the engine's own memory fraction to match, e.g.
        vLLM's ``gpu_memory_utilization``); ``opts`` go to the engine's constructor."""
        if n < 1:
            raise ValueError(f"EnginePool: n={n} engines, need >= 1")
        if routing not in ROUTINGS:
            raise ValueError(f"EnginePool: routing={routing!r}; choose one of {ROUTINGS}")
        from transformers import AutoTokenizer

        self.name = f"{kind}-pool"
        self.kind, self.n, self.routing, self.opts = kind, n, routing, opts
        self.max_replacements = max_replacements
        self.weights_dir = str(model_dir)
        """The checkpoint the engines hold (what a replacement actor starts from)."""
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        res = accelerator()
        self._actor_cls = ray.remote(num_cpus=0 if res == "GPU" else 1,
                                     num_gpus=gpu_share if res == "GPU" else 0)(EngineWorker)
        self.actors = [self._start(i) for i in range(n)]
        ray.get([a.where.remote() for a in self.actors])  # every engine is up
        self._routes: dict[str, int] = {}
        self._next = 0
        self.replaced = 0
        """Engine actors replaced after dying (over the pool's life)."""
        self.weight_group_ready = False
        self.last_owners: list[int] = []
        """The engine each request of the last ``generate`` batch went to (bench/scale.py)."""

    def _start(self, i: int) -> Any:
        # SPREAD: engines on different nodes where there are several.
        return self._actor_cls.options(name=None, scheduling_strategy="SPREAD").remote(
            self.kind, self.weights_dir, self.opts)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def route(self, requests: Sequence[GenRequest]) -> list[int]:
        """The engine index of each request (updates the sticky table)."""
        out = []
        for r in requests:
            if self.routing == "sticky" and r.affinity:
                if r.affinity not in self._routes:
                    held = [0] * self.n
                    for e in self._routes.values():
                        held[e] += 1
                    self._routes[r.affinity] = held.index(min(held))
                out.append(self._routes[r.affinity])
            else:
                out.append(self._next % self.n)
                self._next += 1
        return out

    def generate(self, requests: Sequence[GenRequest]) -> list[list[Completion]]:
        """Per request, ``request.n`` completions, from the engine its affinity routes it to."""
        owner = self.route(requests)
        self.last_owners = owner
        shares = {e: [i for i, o in enumerate(owner) if o == e] for e in sorted(set(owner))}
        pending = {e: self.actors[e].generate.remote([requests[i] for i in idx])
                   for e, idx in shares.items()}
        out: list[list[Completion] | None] = [None] * len(requests)
        replaced = 0
        while pending:
            e, ref = next(iter(pending.items()))
            try:
                result = ray.get(ref)
            except (RayActorError, OutOfMemoryError) as exc:  # died, unreachable, OOM-killed
                if replaced >= self.max_replacements:
                    raise RuntimeError(f"engine pool: engine {e} died {replaced + 1} times in "
                                       f"one batch; giving up ({type(exc).__name__})") from exc
                replaced += 1
                self._replace(e, exc)
                pending[e] = self.actors[e].generate.remote([requests[i] for i in shares[e]])
                continue
            for i, completions in zip(shares[e], result):
                out[i] = completions
            del pending[e]
        return out  # type: ignore[return-value]

    def _replace(self, e: int, exc: BaseException) -> None:
        print(f"engine pool: engine {e} died ({type(exc).__name__}); starting a new one on "
              f"{self.weights_dir} and sending its requests again", file=sys.stderr, flush=True)
        try:
            ray.kill(self.actors[e], no_restart=True)
        except Exception:  # noqa: BLE001 -- it is gone already
            pass
        self.actors[e] = self._start(e)
        self.replaced += 1
        self.weight_group_ready = False  # the new engine is not in the broadcast group

    def load_weights(self, model_dir: str | Path) -> float:
        """Every engine loads the checkpoint ``model_dir`` (a file system all nodes see)."""
        t0 = time.perf_counter()
        ray.get([a.load_weights.remote(str(model_dir)) for a in self.actors])
        self.weights_dir = str(model_dir)
        self._routes.clear()
        return time.perf_counter() - t0

    def receive_weights(self, model_dir: str | Path, shapes: Layout) -> list[Any]:
        """Every engine's part of a broadcast (refs to wait on with the sender's); afterwards
        they hold the weights saved in ``model_dir``."""
        self.weights_dir = str(model_dir)
        self._routes.clear()
        return [a.receive_weights.remote(shapes) for a in self.actors]

    def prefix_cache_stats(self) -> tuple[int, int]:
        """(queried prompt tokens, prefix-cache hits) summed over the engines (vLLM only)."""
        stats = ray.get([a.prefix_cache_stats.remote() for a in self.actors])
        return sum(q for q, _ in stats), sum(h for _, h in stats)

    def where(self) -> list[tuple[int, str]]:
        """(pid, node id) of each engine actor."""
        return ray.get([a.where.remote() for a in self.actors])

    def close(self, timeout_s: float = 60.0) -> None:
        """Each engine shuts its own processes down (vLLM's engine core: killing the actor alone
        can leave it behind, seen once after bench/scale.py), then the actors are ended."""
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=timeout_s)
        except Exception:  # noqa: BLE001 -- a dead or stuck engine: the kill below ends it
            pass
        kill_actors(self.actors)
        self.actors = []
