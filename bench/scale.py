"""Scale-out benchmark (issue 20): the engine pool and the trainer group on a Ray cluster.

    python -m bench.scale [--cluster local:2] [--engine hf|vllm] [--engines 1,2]
                          [--ranks 1,2] [--items 16] [--k 4] [--max-tokens 48]
                          [--policy tiny|smollm2|DIR] [--out FILE.json] [--engine-opts JSON]

Measured, each on the same requests (seeded per request, so every configuration generates the
same tokens):

* **rollout**: the expansion of one tree level through ``run_episodes`` on a pool of 1, 2 (4)
  engine actors: wall seconds and generated tokens/s (after one warm-up batch per pool);
* **prefix cache** (vLLM only: the transformers engine has none): level-0 requests (``k``
  samples per item), then one continuation of every sampled first turn, as Stage 2 asks for;
  the hit rate is vLLM's own counters over the continuations (hit tokens / queried tokens), with
  sticky routing (a tree stays on one engine) against round-robin;
* **update**: one policy update of the paths rolled out (advantages +-1 by reward) on 1 and 2
  trainer ranks (DDP), wall seconds of the update call (rank 0's save included);
* **sync**: new weights into every engine: ``disk`` (each engine reloads the checkpoint) against
  ``broadcast`` (trainer rank 0 over a gloo group).

On a 2-core machine no speed-up is expected and none is claimed: two engine actors share the
same two cores (and the actors' start-up is paid once). The figures say what the overhead is; a
GPU machine (``scripts/gpu_check.sh``) runs the same command with ``--engine vllm``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from trace_rl.rollout.react import Start, run_episodes
from trace_rl.rollout.types import GenRequest, SamplingSettings


def _policy(name: str, tmp: Path) -> str:
    if name == "tiny":
        from trace_rl.policy.tiny import make_tiny_policy

        return str(make_tiny_policy(tmp / "tiny", preset="tiny", pretrain_steps=150))
    if Path(name).is_dir():
        return name
    from trace_rl.policy.named import resolve_policy

    return str(resolve_policy(name))


def _starts(items: int, k: int) -> tuple[Any, list[Start]]:
    from trace_rl.envs.registry import make_env

    env = make_env("synth_arith", difficulty=1)
    return env, [Start(it, k=k) for it in env.load("train")[:items]]


def rollout(pool: Any, env: Any, starts: list[Start], sampling: SamplingSettings) -> dict[str, float]:
    """One level's episodes on ``pool``: seconds, generated tokens, tokens/s."""
    run_episodes(pool, env, starts[:2], sampling=sampling, max_turns=3, seed=1)  # warm-up
    t0 = time.perf_counter()
    eps = run_episodes(pool, env, starts, sampling=sampling, max_turns=3, seed=7)
    seconds = time.perf_counter() - t0
    tokens = sum(e.ledger.generated_tokens for e in eps)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "episodes": len(eps), "_episodes": eps}


def prefix_hits(pool: Any, env: Any, starts: list[Start], sampling: SamplingSettings) -> dict[str, float]:
    """Hit rate of the continuations of every first turn (vLLM's counters, in tokens)."""
    from trace_rl.rollout.format import TurnFormat

    fmt = TurnFormat(pool.tokenizer)
    level0 = [GenRequest(tuple(fmt.prompt_ids(env.system_prompt(), env.user_prompt(s.item))), s.k,
                         SamplingSettings(max_tokens=sampling.max_tokens, temperature=1.0,
                                          seed=100 + i), affinity=s.item.id)
              for i, s in enumerate(starts)]
    outs = pool.generate(level0)
    q0, h0 = pool.prefix_cache_stats()
    cont = [GenRequest(req.prompt_ids + tuple(c.token_ids), 1,
                       SamplingSettings(max_tokens=sampling.max_tokens, temperature=1.0,
                                        seed=200 + i * 10 + j), affinity=req.affinity)
            for i, (req, cs) in enumerate(zip(level0, outs)) for j, c in enumerate(cs)]
    pool.generate(cont)
    q1, h1 = pool.prefix_cache_stats()
    return {"queried_tokens": q1 - q0, "hit_tokens": h1 - h0,
            "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else float("nan")}


def _paths(episodes: list[Any]) -> list[Any]:
    from trace_rl.policy.update import PathSample

    out = []
    for g, ep in enumerate(episodes):
        ids, mask = list(ep.prompt_ids), [0] * len(ep.prompt_ids)
        for t in ep.turns:
            ids += t.gen_ids + t.obs_ids
            mask += [1] * len(t.gen_ids) + [0] * len(t.obs_ids)
        a = 1.0 if (ep.reward or 0) > 0 else -1.0
        out.append(PathSample(ids, mask, [a * m for m in mask], group=g // 4))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default="local:2")
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--engines", default="1,2", help="pool sizes to measure (comma-separated)")
    ap.add_argument("--ranks", default="1,2", help="trainer group sizes to measure")
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--policy", default="tiny", help="tiny (built here), smollm2, or an HF dir")
    ap.add_argument("--engine-opts", default="{}", help="JSON of engine options (e.g. "
                    '\'{"gpu_memory_utilization": 0.3}\' for two vLLM actors on one GPU)')
    ap.add_argument("--gpu-share", type=float, default=1.0,
                    help="GPU fraction of each engine actor and trainer rank (0.3: three share a GPU)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    from trace_rl import cluster
    from trace_rl.cluster.pool import EnginePool
    from trace_rl.cluster.session import Session
    from trace_rl.config import TrainConfig

    engine_opts = json.loads(args.engine_opts)
    sizes = [int(x) for x in args.engines.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    policy = _policy(args.policy, tmp)
    t0 = time.perf_counter()
    cluster.connect(args.cluster, cpus_per_node=max(2, max(sizes) + max(ranks)))
    result: dict[str, Any] = {"cluster": args.cluster, "engine": args.engine, "policy": args.policy,
                              "items": args.items, "k": args.k, "max_tokens": args.max_tokens,
                              "cluster_start_s": time.perf_counter() - t0,
                              "rollout": {}, "prefix_cache": {}, "update": {}, "sync": {}}
    env, starts = _starts(args.items, args.k)
    sampling = SamplingSettings(max_tokens=args.max_tokens, temperature=1.0)
    episodes = None
    for n in sizes:
        t0 = time.perf_counter()
        pool = EnginePool(args.engine, policy, n, gpu_share=args.gpu_share, **engine_opts)
        start_s = time.perf_counter() - t0
        r = rollout(pool, env, starts, sampling)
        episodes = episodes or r.pop("_episodes")
        r.pop("_episodes", None)
        result["rollout"][n] = {"pool_start_s": start_s, **r}
        print(f"rollout, {n} engine actor(s): {r['tokens']} tokens in {r['seconds']:.1f} s = "
              f"{r['tokens_per_s']:.0f} tok/s (pool start {start_s:.0f} s)", flush=True)
        if args.engine == "vllm" and n > 1:
            for routing in ("sticky", "round_robin"):
                pool.routing, pool._routes = routing, {}
                result["prefix_cache"][routing] = prefix_hits(pool, env, starts, sampling)
                print(f"prefix cache, {n} engines, {routing}: "
                      f"{result['prefix_cache'][routing]['hit_rate']:.1%}", flush=True)
        pool.close()
    if args.engine != "vllm":
        result["prefix_cache"] = "n/a: the transformers engine has no prefix cache"
    settings = TrainConfig().update_settings
    paths = _paths(episodes)
    for r_ in ranks:
        s = Session(args.cluster, args.engine, engines=max(sizes), ranks=r_,
                    weight_sync="broadcast", gpu_share=args.gpu_share, engine_opts=engine_opts)
        try:
            out = tmp / f"ranks{r_}"
            s.update(settings, 0, policy, paths, 1, 1.0, out)  # starts the group; loads the policy
            t0 = time.perf_counter()
            stats = s.update(settings, 0, str(out), paths, 2, 1.0, tmp / f"ranks{r_}-b")
            result["update"][r_] = {"seconds": time.perf_counter() - t0, "paths": len(paths),
                                    "optimiser_steps": stats.get("updates")}
            print(f"update, {r_} rank(s): {result['update'][r_]['seconds']:.1f} s for "
                  f"{len(paths)} paths", flush=True)
            if r_ == max(ranks):  # the sync comparison, on the largest group
                s.engine(policy, policy)
                new = str(tmp / f"ranks{r_}-b")
                s.weight_sync = "disk"
                s.sync(new)
                s.weight_sync = "broadcast"
                s.sync(new)  # first broadcast: builds the group
                s.sync(new)
                s.weight_sync = "disk"
                s.sync(new)
                result["sync"] = {"disk_s": [x for how, x in s.syncs if how == "disk"],
                                  "broadcast_s": [x for how, x in s.syncs if how == "broadcast"],
                                  "engines": s.engines}
                print(f"sync to {s.engines} engines: disk {result['sync']['disk_s']} s, "
                      f"broadcast {result['sync']['broadcast_s']} s (the first builds the group)",
                      flush=True)
        finally:
            s.close()
    cluster.shutdown()
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        args.out.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
