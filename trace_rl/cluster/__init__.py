"""Scale-out on Ray: a pool of rollout engines and a group of trainer ranks (docs/cluster.md).

Imported only when ``TrainConfig.cluster`` is set (``tasks.runtime``); with it empty, Ray is never
imported and a run is the single process it always was. The Prefect flow stays in the driver
process and is the only writer of DuckDB and MLflow: the engine actors (``pool``) receive token
requests and return completions, the trainer actors (``trainer``) receive training paths and write
the policy checkpoint, and new weights reach the engines from the checkpoint on disk or by a
broadcast from trainer rank 0 (``sync``).

``connect(spec)`` starts or joins the cluster once per process:

* ``local:N``: N simulated nodes on this machine (``ray.cluster_utils.Cluster``: a head and N - 1
  worker raylets, each with its own object store), the way a multi-node run is tested here;
* ``auto``: the cluster this machine's ``ray start`` joined;
* ``HOST:PORT`` or ``ray://HOST:PORT``: the cluster of that head node (GCS or Ray Client address).
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Any

_STATE: dict[str, Any] = {}
REPO = Path(__file__).resolve().parents[2]

WORKER_ENV = {"TRACE_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "RAY_USAGE_STATS_ENABLED": "0"}
"""Set in every actor: one torch thread per actor (the engines and ranks are the parallelism;
OpenMP spin-waiting between actors sharing cores is ruinous, tasks.runtime.configure_threads),
and vLLM's workers spawned, not forked, inside an actor (a forked CUDA or Ray runtime hangs)."""


def parse(spec: str) -> tuple[str, int]:
    """``("local", N)`` for ``local:N``, else ``("address", 0)``; ``ValueError`` for empty."""
    if not spec:
        raise ValueError("cluster: empty spec; the single-process run does not use Ray")
    if spec.startswith("local:"):
        n = spec.split(":", 1)[1]
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"cluster={spec!r}: local:N needs N >= 1 simulated nodes")
        return "local", int(n)
    return "address", 0


def connect(spec: str, cpus_per_node: int = 2) -> dict[str, Any]:
    """Start (``local:N``) or join (``auto``, an address) the Ray cluster of ``spec`` once per
    process; returns ``ray.cluster_resources()``. ``cpus_per_node``: the logical CPUs of each
    simulated node (enough for the actors placed on it)."""
    import ray

    if _STATE.get("spec") == spec and ray.is_initialized():
        return ray.cluster_resources()
    if _STATE:
        raise RuntimeError(f"cluster: this process is connected to {_STATE['spec']!r}; "
                           f"it cannot switch to {spec!r}")
    kind, n = parse(spec)
    env = {**WORKER_ENV, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    print(f"cluster: {'starting' if kind == 'local' else 'joining'} Ray cluster {spec}",
          file=sys.stderr, flush=True)
    if kind == "local":
        from ray.cluster_utils import Cluster

        node = {"num_cpus": cpus_per_node, "include_dashboard": False}
        local = Cluster(initialize_head=True, head_node_args=node)
        for _ in range(n - 1):
            local.add_node(**{k: v for k, v in node.items() if k != "include_dashboard"})
        _STATE["local"] = local
        ray.init(address=local.address, runtime_env={"env_vars": env}, log_to_driver=True)
    else:
        ray.init(address=spec, runtime_env={"env_vars": env}, log_to_driver=True)
    _STATE["spec"] = spec
    atexit.register(shutdown)
    return ray.cluster_resources()


def shutdown() -> None:
    """Leave the cluster (and stop a ``local:N`` one)."""
    if not _STATE:
        return
    import ray

    ray.shutdown()
    local = _STATE.pop("local", None)
    if local is not None:
        local.shutdown()
    _STATE.clear()


def accelerator() -> str:
    """``"GPU"`` when the cluster has GPUs (one per engine actor and per trainer rank), else
    ``"CPU"`` (one logical CPU each)."""
    import ray

    return "GPU" if ray.cluster_resources().get("GPU", 0) >= 1 else "CPU"


def kill_actors(actors: list[Any]) -> None:
    """End each actor (a pool's engines, a group's ranks) at close; Ray may be down already."""
    import ray

    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001 -- closing at exit, Ray may be down already
            pass
