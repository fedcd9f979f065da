"""What a second torch thread gives the policy update: ``python -m studies.update_threads``.

The RL runs' trainer takes ``$TRACE_TORCH_THREADS`` threads (default 1, ``tasks.runtime``): for
the tiny policy a second thread gained nothing and spin-waited against the rollout engine. The
update runs while the engine sits idle between steps, though, and SmolLM2's update is most of a
HotpotQA step (260 s of a 320-s step, 2026-12-04). This times ``PolicyTrainer.update`` on the same
synthetic paths and settings as ``studies.trunk_reuse`` (``timed_settings``: the RL runs' cost
settings, the frozen trunk reused) with 1 and with 2 threads, alternating so that a busy machine
slows both alike.

    python -m studies.update_threads                      # SmolLM2-135M-Instruct, 16 x 512 tokens
    python -m studies.update_threads --tokens 1024 --repeats 2

The closing line: ``update threads: 1 -> <a> s, 2 -> <b> s (<x>x faster)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Sequence

import torch

from studies.trunk_reuse import paths, timed_settings, timed_update


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from transformers import AutoConfig

    from trace_rl.policy.named import resolve_policy

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="smollm2", help="HF directory or named policy")
    ap.add_argument("--trainable-layers", type=int, default=6)
    ap.add_argument("--paths", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per path")
    ap.add_argument("--repeats", type=int, default=1, help="timed updates of each thread count")
    ap.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    policy = resolve_policy(args.policy)
    samples = paths(AutoConfig.from_pretrained(policy).vocab_size, args.paths, args.tokens)
    settings = timed_settings(args.trainable_layers, reuse_trunk=True)
    times: dict[int, list[float]] = {1: [], 2: []}
    before = torch.get_num_threads()
    try:
        for _ in range(args.repeats):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                seconds, _ = timed_update(policy, settings, samples)
                times[threads].append(seconds)
                print(f"threads={threads}: {seconds:.1f} s", flush=True)
    finally:
        torch.set_num_threads(before)  # a caller (a test) keeps its own count
    one, two = statistics.median(times[1]), statistics.median(times[2])
    result = {"policy": args.policy, "paths": args.paths, "tokens": args.tokens,
              "trainable_layers": args.trainable_layers, "seconds": times, "speedup": one / two}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"update threads: 1 -> {one:.1f} s, 2 -> {two:.1f} s ({one / two:.2f}x faster)")
    return result


if __name__ == "__main__":
    main()
