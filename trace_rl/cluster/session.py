"""What one driver process holds on a Ray cluster: the engine pool and the trainer group of a run,
created on first use and kept across steps (as the single-process engine and trainer are)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from trace_rl.cluster import connect, parse
from trace_rl.cluster.fsdp import STRATEGIES
from trace_rl.cluster.pool import EnginePool
from trace_rl.cluster.trainer import TrainerGroup
from trace_rl.policy.update import PathSample, UpdateSettings

_SESSIONS: dict[tuple, "Session"] = {}


class Session:
    """The pool and trainer group of one run (``engines`` engine actors of ``kind``,
    ``ranks`` trainer ranks) on the cluster ``spec``."""

    def __init__(self, spec: str, kind: str, engines: int, ranks: int, weight_sync: str,
                 gpu_share: float = 1.0, engine_opts: dict[str, Any] | None = None,
                 strategy: str = "ddp") -> None:
        """``gpu_share``: GPU fraction of each engine and rank (below 1 they share GPUs);
        ``engine_opts``: passed to every engine; ``strategy``: the trainer ranks' ``ddp`` or
        ``fsdp2`` (``trace_rl.cluster.fsdp``)."""
        if weight_sync not in ("disk", "broadcast"):
            raise ValueError(f"weight_sync={weight_sync!r}; choose disk or broadcast")
        if strategy not in STRATEGIES:
            raise ValueError(f"trainer_strategy={strategy!r}; choose one of {STRATEGIES}")
        self.strategy = strategy
        self.spec, self.kind, self.engines, self.ranks = spec, kind, engines, ranks
        self.weight_sync = weight_sync
        self.gpu_share, self.engine_opts = gpu_share, dict(engine_opts or {})
        kind_, nodes = parse(spec)
        per_node = max(2, math.ceil((engines + ranks) / max(nodes, 1)))
        self.resources = connect(spec, cpus_per_node=per_node)
        self.pool: EnginePool | None = None
        self.trainer: TrainerGroup | None = None
        self.home: str | None = None
        self.syncs: list[tuple[str, float]] = []
        """(how, seconds) of every weight sync: ``disk`` or ``broadcast``."""

    def engine(self, home_dir: str, policy_dir: str) -> EnginePool:
        """The pool (started on ``home_dir`` on first use), holding ``policy_dir``'s weights."""
        if self.pool is None:
            t0 = time.perf_counter()
            print(f"cluster: starting {self.engines} {self.kind} engine actor(s) on {home_dir}",
                  file=sys.stderr, flush=True)
            self.pool = EnginePool(self.kind, home_dir, self.engines, gpu_share=self.gpu_share,
                                   **self.engine_opts)
            self.home = home_dir
            print(f"cluster: engine pool ready in {time.perf_counter() - t0:.0f} s",
                  file=sys.stderr, flush=True)
        if self.pool.weights_dir != policy_dir:
            self.sync(policy_dir)
        return self.pool

    def sync(self, policy_dir: str) -> float:
        """Bring every engine to ``policy_dir``'s weights: a broadcast from trainer rank 0 when
        asked for and the trainer holds exactly them, else from the checkpoint on disk."""
        assert self.pool is not None
        if self.weight_sync == "broadcast" and self.trainer is not None \
                and self.trainer.loaded == str(policy_dir):
            how, seconds = "broadcast", self.trainer.broadcast(self.pool, str(policy_dir))
        else:
            how, seconds = "disk", self.pool.load_weights(policy_dir)
        self.syncs.append((how, seconds))
        return seconds

    def update(self, settings: UpdateSettings, seed: int, policy_dir: str,
               samples: Sequence[PathSample], rng_seed: int, lr_scale: float,
               out_dir: str | Path) -> dict[str, float]:
        """The policy update on the trainer group (started on first use)."""
        if self.trainer is None:
            t0 = time.perf_counter()
            self.trainer = TrainerGroup(self.ranks, settings, seed, gpu_share=self.gpu_share,
                                        strategy=self.strategy)
            print(f"cluster: {self.ranks} {self.strategy} trainer rank(s) ready in "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        return self.trainer.update(policy_dir, samples, rng_seed, lr_scale, out_dir)

    def close(self) -> None:
        for part in (self.pool, self.trainer):
            if part is not None:
                part.close()
        self.pool = self.trainer = None


def session(spec: str, kind: str, engines: int, ranks: int, weight_sync: str,
            run_id: str, strategy: str = "ddp") -> Session:
    """The process's session of ``run_id`` (created on first use)."""
    key = (spec, kind, engines, ranks, weight_sync, run_id, strategy)
    if key not in _SESSIONS:
        _SESSIONS[key] = Session(spec, kind, engines, ranks, weight_sync, strategy=strategy)
    return _SESSIONS[key]


def close_sessions() -> None:
    while _SESSIONS:
        _SESSIONS.popitem()[1].close()


def sessions() -> list[Session]:
    return list(_SESSIONS.values())


__all__ = ["Session", "close_sessions", "session", "sessions"]
