"""Weight broadcast: trainer rank 0 sends the new weights to every engine actor over a process
group of their own (gloo; rank 0 = the trainer, ranks 1..N = the engines), then each engine loads
them in place (``HFEngine.load_tensors``; vLLM's ``reload_weights(weights_iterator=...)`` through
``VLLMEngine.load_tensors``, which also resets its prefix cache).

The group is built from a ``TCPStore`` and ``ProcessGroupGloo`` directly rather than
``init_process_group``: trainer rank 0 already has a default group (its DDP ranks), and the
engines must not join that one. The tensors travel as one flat float32 buffer (one collective,
not one per tensor); ``layout`` tells the engines how to cut it.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

Layout = list[tuple[str, tuple[int, ...]]]


def node_address() -> str:
    """This node's address as the other nodes reach it (Ray's view of it when Ray is up)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:  # pragma: no cover - the cluster package always has Ray
        pass
    return socket.gethostbyname(socket.gethostname())


def layout(state: dict[str, torch.Tensor]) -> Layout:
    """Names and shapes of ``state``'s tensors, in the order they are sent."""
    bad = [k for k, v in state.items() if not v.is_floating_point()]
    if bad:
        raise ValueError(f"weight broadcast: tensors {bad[:5]} are not floating point")
    return [(k, tuple(v.shape)) for k, v in sorted(state.items())]


class WeightGroup:
    """One member of the broadcast group. Rank 0 first calls ``WeightGroup.host`` (a store on a
    free port), then every member, rank 0 included, ``join`` at the same time."""

    def __init__(self, store: Any, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world = rank, world
        self.pg = dist.ProcessGroupGloo(store, rank, world, datetime.timedelta(seconds=timeout_s))

    @staticmethod
    def host(world: int, timeout_s: float = 300.0) -> tuple[Any, str, int]:
        """Rank 0's store on a free port: (store, address, port) for the others to join."""
        store = dist.TCPStore("0.0.0.0", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        return store, node_address(), store.port

    @classmethod
    def join(cls, address: str, port: int, rank: int, world: int, store: Any = None,
             timeout_s: float = 300.0) -> "WeightGroup":
        if store is None:
            store = dist.TCPStore(address, port, world, is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        return cls(store, rank, world, timeout_s)

    def send(self, state: dict[str, torch.Tensor]) -> int:
        """Rank 0: broadcast ``state`` (in ``layout`` order); returns the bytes sent."""
        if self.rank != 0:
            raise RuntimeError("WeightGroup.send: only rank 0 sends")
        flat = torch.cat([state[k].detach().reshape(-1).to(torch.float32).cpu()
                          for k, _ in layout(state)])
        self.pg.broadcast(flat, 0).wait()
        return flat.numel() * 4

    def receive(self, shapes: Layout) -> dict[str, torch.Tensor]:
        """Ranks 1..N: the tensors rank 0 broadcast, by name."""
        sizes = [int(torch.Size(s).numel()) for _, s in shapes]
        flat = torch.empty(sum(sizes), dtype=torch.float32)
        self.pg.broadcast(flat, 0).wait()
        return {name: part.view(shape) for (name, shape), part
                in zip(shapes, torch.split(flat, sizes))}
