"""The policy update against the machine's limit: ``python -m studies.optimiser WORKDIR``.

Replays one stored step's policy update (``PolicyTrainer.update`` on the step's own paths, from
the checkpoint the step started from, with the run's update settings) on padded micro-batches
(``pack=False``, the update before packing) and on packed ones (``trace_rl.policy.packing``),
alternating the two so that a busy machine slows both alike, and checks that both land on the
same weights. Per setting it reports:

* trained tokens per second: the paths' tokens times the optimiser steps taken, over the
  update's seconds;
* achieved FLOP/s, 6 x parameters x trained tokens per second (the work of a forward and a
  backward pass of every trained token, whether or not the update computes it);
* the positions it computes per pass over the step's paths (padded: micro-batch x longest path;
  packed: the distinct prefixes);

against a matmul roofline measured in the same run: the model's own linear layers (forward,
and the backward's two matmuls) on as many rows as one packed and one padded micro-batch of the
step hold, at the update's torch threads. Its finding (packed 5.03x padded) is in docs/results.md,
"The overhead of a step, and the optimiser against the machine"; it ran on the last step of
``bench.overhead``'s default case (``--keep``).

    python -m studies.optimiser WORKDIR [--run RUN_ID] [--step N] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from trace_core.seeds import update_seed


def step_samples(workdir: str, run_id: str, step: int) -> tuple[Any, list[Any]]:
    """(the run's config, the step's paths as the policy update saw them)."""
    from tasks import learn, runtime
    from trace_rl.config import config_from_mapping
    from trace_rl.storage.store import TreeStore

    store = TreeStore(Path(workdir) / "trace.duckdb", create=False)
    cfg = config_from_mapping(store.get_run(run_id)["config"])
    at = runtime.StepRef(str(workdir), run_id, step)
    trees = runtime.step_trees(at)
    paths = learn.tree_advantages.fn(cfg, at, trees)  # the stored values again
    return cfg, learn._samples(trees.table, paths)


def _linear_shapes(model: Any) -> list[tuple[int, int]]:
    """(in, out) of every linear map one token passes through, the LM head included."""
    return [(m.in_features, m.out_features) for m in model.modules()
            if isinstance(m, torch.nn.Linear)]


def roofline(model: Any, rows: int, repeats: int = 3) -> float:
    """FLOP/s of the model's linear layers on ``rows`` rows: y = x W^T, then the backward's
    dx = dy W and dW = dy^T x (float32, this process's torch threads); the best of
    ``repeats``."""
    shapes = _linear_shapes(model)
    tensors = [(torch.randn(rows, i), torch.randn(o, i), torch.randn(rows, o)) for i, o in shapes]
    flops = sum(3 * 2 * rows * i * o for i, o in shapes)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for x, w, dy in tensors:
            torch.nn.functional.linear(x, w)
            dy @ w
            dy.t() @ x
        best = min(best, time.perf_counter() - t0)
    return flops / best


def _positions(trainer: Any, samples: Sequence[Any], rng_seed: int) -> tuple[int, int, int]:
    """(padded positions, packed positions, paths' tokens) of one pass over ``samples`` in the
    update's micro-batches."""
    from trace_rl.policy.packing import pack
    from trace_rl.policy.update import _whole_group_bins

    s = trainer.settings
    trainable = [x for x in samples if any(m and a != 0 for m, a in zip(x.loss_mask, x.advantages))]
    n_mini = max(1, min(s.mini_batches, -(-len(trainable) // s.micro_batch)))
    padded = packed = 0
    for paths in _whole_group_bins(trainable, n_mini, torch.Generator().manual_seed(rng_seed)):
        for i in range(0, len(paths), s.micro_batch):
            part = [trainable[j].token_ids for j in paths[i:i + s.micro_batch]]
            padded += len(part) * max(len(p) for p in part)
            packed += pack(part).size
    return padded, packed, sum(len(x.token_ids) for x in trainable)


def measure(workdir: str, run_id: str, step: int, repeats: int = 2) -> dict[str, Any]:
    """Both settings timed on step ``step``'s update (its paths, its starting checkpoint)."""
    from tasks import runtime
    from trace_rl.policy.update import PolicyTrainer

    cfg, samples = step_samples(workdir, run_id, step)
    start = runtime.Paths(Path(workdir)).policy_dir(run_id, step - 1) if step else None
    policy = str(start) if start is not None and start.is_dir() else cfg.policy
    seed = update_seed(cfg.seed, step)  # the step's own update generator
    runs: dict[str, list[dict[str, Any]]] = {"padded": [], "packed": []}
    weights: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        for name in ("padded", "packed"):
            settings = dataclasses.replace(cfg.update_settings, pack=name == "packed")
            trainer = PolicyTrainer(policy, settings, seed=cfg.seed)
            t0 = time.perf_counter()
            stats = trainer.update(samples, torch.Generator().manual_seed(seed))
            seconds = time.perf_counter() - t0
            weights[name] = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
            runs[name].append({"seconds": seconds, "updates": stats["updates"],
                               "loss": stats.get("loss"), "packed": trainer.pack})
            print(f"  optimiser {name}: {seconds:.1f} s", flush=True)
    params = sum(p.numel() for p in trainer.model.parameters())
    padded_pos, packed_pos, tokens = _positions(trainer, samples, seed)
    micro = max(1, -(-len(samples) // trainer.settings.micro_batch))
    out: dict[str, Any] = {"run_id": run_id, "step": step, "paths": len(samples),
                           "parameters": params, "path_tokens": tokens,
                           "positions": {"padded": padded_pos, "packed": packed_pos},
                           "threads": torch.get_num_threads(),
                           "max_weight_difference": float((weights["padded"] - weights["packed"])
                                                          .abs().max())}
    for name, rs in runs.items():
        seconds = statistics.median(r["seconds"] for r in rs)
        trained = tokens * rs[0]["updates"]
        out[name] = {"seconds": [r["seconds"] for r in rs], "median_s": seconds,
                     "updates": rs[0]["updates"], "loss": rs[0]["loss"],
                     "tokens_per_s": trained / seconds,
                     "flops_per_s": 6 * params * trained / seconds}
    out["roofline_flops_per_s"] = {name: roofline(trainer.model, max(1, pos // micro))
                                   for name, pos in (("padded", padded_pos), ("packed", packed_pos))}
    out["speedup"] = out["packed"]["tokens_per_s"] / out["padded"]["tokens_per_s"]
    return out


def report(r: dict[str, Any]) -> str:
    roof = r["roofline_flops_per_s"]
    lines = [f"optimiser of step {r['step']} ({r['paths']} paths, {r['path_tokens']} tokens, "
             f"{r['parameters'] / 1e6:.2f}M parameters, {r['threads']} torch thread(s)):",
             "  setting  positions/pass  median s  trained tok/s  achieved GFLOP/s  "
             "matmul roofline GFLOP/s  achieved/roofline"]
    for name in ("padded", "packed"):
        x = r[name]
        lines.append(f"  {name:7s}  {r['positions'][name]:14d}  {x['median_s']:8.2f}  "
                     f"{x['tokens_per_s']:13.0f}  {x['flops_per_s'] / 1e9:16.2f}  "
                     f"{roof[name] / 1e9:23.2f}  {x['flops_per_s'] / roof[name]:17.2f}")
    lines.append(f"  packed / padded: {r['speedup']:.2f}x trained tokens/s; weights differ by "
                 f"{r['max_weight_difference']:.1e}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from trace_rl.storage.store import TreeStore

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir")
    ap.add_argument("--run", default=None, help="run id (default: the work dir's only run)")
    ap.add_argument("--step", type=int, default=None, help="step (default: the last complete)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from tasks import runtime

    runtime.configure_threads()  # the trainer's threads in a run ($TRACE_TORCH_THREADS, 1)
    store = TreeStore(Path(args.workdir) / "trace.duckdb", create=False)
    run_id = args.run or store.query("SELECT run_id FROM runs").to_pylist()[0]["run_id"]
    step = args.step if args.step is not None else store.last_complete_step(run_id)
    result = measure(args.workdir, run_id, step, args.repeats)
    print(report(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
