"""Scale-out benchmark: the engine pool and the trainer group on a Ray cluster, on the same
seeded requests in every configuration: rollout tokens/s per pool size, prefix-cache hits by
routing, one policy update per trainer group size (Ray actors or ``--update-on mp``), weight sync
by disk against broadcast (docs/cluster.md; figures: docs/results.md, "Scaling out on Ray").

    python -m bench.scale --cluster local:1 --engine hf --engines 1,2 --ranks 1,2 --update-on mp
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import add_options
from trace_rl.config import TrainConfig
from trace_rl.rollout.react import Start, run_episodes
from trace_rl.rollout.types import GenRequest, SamplingSettings


def _policy(name: str, tmp: Path) -> str:
    """``tiny`` (built here), a named policy (``smollm2``) or a Hugging Face directory."""
    from trace_rl.policy.named import resolve_policy
    from trace_rl.policy.tiny import make_tiny_policy

    if name == "tiny":
        return str(make_tiny_policy(tmp / "tiny", preset="tiny", pretrain_steps=150))
    return resolve_policy(name)


def rollout(pool: Any, env: Any, starts: list[Start], sampling: SamplingSettings
            ) -> tuple[dict[str, float], list[Any]]:
    """One level's episodes on ``pool``: (seconds, generated tokens, tokens/s; the episodes)."""
    run_episodes(pool, env, starts[:2], sampling=sampling, max_turns=3, seed=1)  # warm-up
    t0 = time.perf_counter()
    eps = run_episodes(pool, env, starts, sampling=sampling, max_turns=3, seed=7)
    seconds = time.perf_counter() - t0
    tokens = sum(e.ledger.generated_tokens for e in eps)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "episodes": len(eps)}, eps


def prefix_hits(pool: Any, env: Any, starts: list[Start], sampling: SamplingSettings) -> dict[str, float]:
    """Level-0 requests, then one continuation of every sampled first turn: the continuations'
    prefix-cache ``hit_rate`` by vLLM's counters and, for every engine, ``routed_prefix_rate``
    (``routed_prefix_tokens``: an upper bound on what a real cache of blocks can hit)."""
    from trace_rl.rollout.format import TurnFormat

    fmt = TurnFormat(pool.tokenizer)
    level0 = [GenRequest(tuple(fmt.prompt_ids(env.system_prompt(), env.user_prompt(s.item))), s.k,
                         replace(sampling, seed=100 + i), affinity=s.item.id) for i, s in enumerate(starts)]
    outs = pool.generate(level0)
    owners0 = list(pool.last_owners)
    q0, h0 = pool.prefix_cache_stats()
    cont = [GenRequest(req.prompt_ids + tuple(c.token_ids), 1, replace(sampling, seed=200 + i * 10 + j),
                       affinity=req.affinity)
            for i, (req, cs) in enumerate(zip(level0, outs)) for j, c in enumerate(cs)]
    pool.generate(cont)
    q1, h1 = pool.prefix_cache_stats()
    routed = routed_prefix_tokens(pool.n, level0, owners0, outs, cont, pool.last_owners)
    queried = sum(len(r.prompt_ids) for r in cont)
    return {"queried_tokens": q1 - q0, "hit_tokens": h1 - h0,
            "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else float("nan"),
            "prompt_tokens": queried, "routed_prefix_tokens": routed,
            "routed_prefix_rate": routed / queried if queried else float("nan")}


def routed_prefix_tokens(n: int, level0: list[GenRequest], owners0: list[int],
                         outs: list[list[Any]], cont: list[GenRequest],
                         owners1: list[int]) -> int:
    """Prompt tokens of the continuations ``cont`` (sent to engines ``owners1``) that are a prefix
    of a sequence their engine computed before: a level-0 prompt with one of its completions
    (``outs``, on engines ``owners0``), or an earlier continuation's prompt (an unbounded cache)."""
    held: list[list[tuple[int, ...]]] = [[] for _ in range(n)]
    for req, e, cs in zip(level0, owners0, outs):
        held[e] += [tuple(req.prompt_ids) + tuple(c.token_ids) for c in cs]
    routed = 0
    for req, e in zip(cont, owners1):
        routed += max((len(os.path.commonprefix([tuple(req.prompt_ids), seq])) for seq in held[e]),
                      default=0)
        held[e].append(tuple(req.prompt_ids))
    return routed


def _paths(episodes: list[Any]) -> list[Any]:
    """The episodes as update paths, advantage +-1 by reward, in groups of 4."""
    from trace_rl.policy.sft import episode_example
    from trace_rl.policy.update import PathSample

    out = []
    for g, ep in enumerate(episodes):
        ex, a = episode_example(ep), 1.0 if (ep.reward or 0) > 0 else -1.0
        out.append(PathSample(list(ex.token_ids), list(ex.loss_mask), [a * m for m in ex.loss_mask],
                              group=g // 4))
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    for flag, choices, help in (("--engine", ("hf", "vllm"), None), ("--strategy", ("ddp", "fsdp2"), None),
                                ("--update-on", ("ray", "mp"), "trainer ranks as Ray actors or "
                                 "torch.multiprocessing processes without Ray")):
        ap.add_argument(flag, default=choices[0], choices=choices, help=help)
    add_options(ap, ("--cluster", "local:2", ""),
                ("--engines", "1,2", "pool sizes to measure (comma-separated)"),
                ("--ranks", "1,2", "trainer group sizes to measure"), ("--items", 16, ""), ("--k", 4, ""),
                ("--max-tokens", 48, ""), ("--policy", "tiny", "tiny (built here), smollm2, or an HF dir"),
                ("--engine-opts", "{}", "JSON of engine options"),
                ("--gpu-share", 1.0, "GPU fraction of each engine actor and trainer rank"),
                ("--out", Path, ""))
    args = ap.parse_args(argv)
    args.engine_opts = json.loads(args.engine_opts)
    args.engines, args.ranks = ([int(x) for x in v.split(",")] for v in (args.engines, args.ranks))
    return args


def measure_pools(args: argparse.Namespace, policy: str, result: dict[str, Any]) -> list[Any]:
    """Rollout, and prefix-cache hits by routing on pools of several engines; the first pool's episodes."""
    from trace_rl.cluster.pool import EnginePool
    from trace_rl.envs.registry import make_env

    env = make_env("synth_arith", difficulty=1)
    starts = [Start(it, k=args.k) for it in env.load("train")[:args.items]]
    sampling = SamplingSettings(max_tokens=args.max_tokens, temperature=1.0)
    episodes = None
    for n in args.engines:
        t0 = time.perf_counter()
        pool = EnginePool(args.engine, policy, n, gpu_share=args.gpu_share, **args.engine_opts)
        start_s = time.perf_counter() - t0
        try:
            r, eps = rollout(pool, env, starts, sampling)
            episodes = episodes or eps
            result["rollout"][n] = {"pool_start_s": start_s, **r}
            print(f"rollout, {n} engine actor(s): {r['tokens']} tokens in {r['seconds']:.1f} s = "
                  f"{r['tokens_per_s']:.0f} tok/s (pool start {start_s:.0f} s)", flush=True)
            for routing in ("sticky", "round_robin") if n > 1 else ():
                pool.routing, pool._routes = routing, {}
                hits = result["prefix_cache"][routing] = prefix_hits(pool, env, starts, sampling)
                print(f"prefix cache, {n} engines, {routing}: vLLM counters "
                      f"{hits['hit_rate']:.1%}, routed prefix {hits['routed_prefix_rate']:.1%}",
                      flush=True)
        finally:
            pool.close()
    return episodes


def measure_ray(args: argparse.Namespace, policy: str, paths: list[Any], tmp: Path,
                result: dict[str, Any]) -> None:
    """The update on each trainer group size as Ray actors; the sync comparison on the largest."""
    from trace_rl.cluster.session import Session

    settings = TrainConfig().update_settings
    for r_ in args.ranks:
        s = Session(args.cluster, args.engine, engines=max(args.engines), ranks=r_,
                    weight_sync="broadcast", gpu_share=args.gpu_share,
                    engine_opts=args.engine_opts, strategy=args.strategy)
        try:
            out = tmp / f"ranks{r_}"
            s.update(settings, 0, policy, paths, 1, 1.0, out)  # starts the group; loads the policy
            t0 = time.perf_counter()
            stats = s.update(settings, 0, str(out), paths, 2, 1.0, tmp / f"ranks{r_}-b")
            _record_update(result, r_, time.perf_counter() - t0, len(paths), stats)
            if r_ == max(args.ranks):  # the sync comparison, on the largest group
                result["sync"] = measure_sync(s, policy, str(tmp / f"ranks{r_}-b"))
        finally:
            s.close()


def _record_update(result: dict[str, Any], ranks: int, seconds: float, paths: int,
                   stats: dict[str, float]) -> None:
    result["update"][ranks] = {"seconds": seconds, "paths": paths,
                               "optimiser_steps": stats.get("updates")}
    print(f"update, {ranks} rank(s): {seconds:.1f} s for {paths} paths", flush=True)


def measure_sync(s: Any, policy: str, new: str) -> dict[str, Any]:
    """New weights into every engine: disk, broadcast (the first builds the group), broadcast, disk."""
    s.engine(policy, policy)
    for how in ("disk", "broadcast", "broadcast", "disk"):
        s.weight_sync = how
        s.sync(new)
    sync = {"disk_s": [x for how, x in s.syncs if how == "disk"],
            "broadcast_s": [x for how, x in s.syncs if how == "broadcast"], "engines": s.engines}
    print(f"sync to {s.engines} engines: disk {sync['disk_s']} s, broadcast "
          f"{sync['broadcast_s']} s (the first builds the group)", flush=True)
    return sync


def _mp_rank(rank: int, world: int, port: int, policy: str, strategy: str, paths: list[Any],
             out: str) -> None:
    """One trainer rank without Ray, timed as ``measure_ray`` times its group; rank 0 writes it."""
    import torch
    import torch.distributed as dist

    from trace_rl.cluster.fsdp import make_trainer
    from trace_rl.policy.update import Ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        trainer = make_trainer(strategy, policy, TrainConfig().update_settings, seed=0,
                               ranks=Ranks(rank, world))
        trainer.update(paths, torch.Generator().manual_seed(1))
        t0 = time.perf_counter()
        stats = trainer.update(paths, torch.Generator().manual_seed(2))
        seconds = time.perf_counter() - t0
        if rank == 0:
            Path(out).write_text(json.dumps({"seconds": seconds, "stats": stats}))
        del trainer
    finally:
        dist.destroy_process_group()


def measure_mp(args: argparse.Namespace, policy: str, paths: list[Any], tmp: Path,
               result: dict[str, Any]) -> None:
    """The update on each group size as torch.multiprocessing ranks (no Ray)."""
    import socket

    import torch.multiprocessing as mp

    for r_ in args.ranks:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out = tmp / f"mp-ranks{r_}.json"
        mp.start_processes(_mp_rank, args=(r_, port, policy, args.strategy, paths, str(out)),
                           nprocs=r_, start_method="spawn")
        got = json.loads(out.read_text())
        _record_update(result, r_, got["seconds"], len(paths), got["stats"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from trace_rl import cluster

    args = parse(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    policy = _policy(args.policy, tmp)
    t0 = time.perf_counter()
    cluster.connect(args.cluster, cpus_per_node=max(2, max(args.engines) + max(args.ranks)))
    result: dict[str, Any] = {k: getattr(args, k) for k in ("cluster", "engine", "policy", "items", "k",
                                                            "max_tokens", "strategy", "update_on")}
    result.update(date=time.strftime("%Y-%m-%d"), cluster_start_s=time.perf_counter() - t0,
                  rollout={}, prefix_cache={}, update={}, sync={})
    try:
        paths = _paths(measure_pools(args, policy, result))
        if args.update_on == "mp":
            cluster.shutdown()  # the ranks alone on the machine: no raylets, no object store
            measure_mp(args, policy, paths, tmp, result)
        else:
            measure_ray(args, policy, paths, tmp, result)
    finally:
        cluster.shutdown()
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        args.out.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    from trace_rl.engines import entry_point

    entry_point(main)  # its engines stop with it (trace_rl.engines.lifecycle)
