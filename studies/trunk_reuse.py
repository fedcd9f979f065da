"""What reusing the frozen trunk saves in a policy update: ``python -m studies.trunk_reuse``.

Times ``PolicyTrainer.update`` on the same synthetic paths with ``reuse_trunk`` off and on
(``trace_rl.policy.trunk``), alternating the two so that a busy machine slows both alike, and
checks that both land on the same weights. The defaults are those of the RL runs on the SmolLM2
warm starts (``trainable_layers=6`` of 30, two PPO epochs, micro-batches of 4, the KL guard's
re-scoring on): 16 paths of 512 tokens, a quarter of them prompt.

    python -m studies.trunk_reuse                                  # SmolLM2-135M-Instruct
    python -m studies.trunk_reuse --policy DIR --trainable-layers 2 --tokens 256

The closing line: ``trunk reuse: update <off> s -> <on> s (<x>x faster); weights differ by <d>``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any, Sequence

import torch


def paths(vocab: int, n: int, tokens: int, seed: int = 0) -> list[Any]:
    """``n`` paths of ``tokens`` random ids; the first quarter of each is prompt (masked), the
    rest policy tokens with advantage +-1 (groups of four, centred)."""
    from trace_rl.policy.update import PathSample

    rng = random.Random(seed)
    prompt = tokens // 4
    out = []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(tokens)]
        mask = [0] * prompt + [1] * (tokens - prompt)
        adv = 1.0 if i % 2 == 0 else -1.0
        out.append(PathSample(ids, mask, [adv * m for m in mask], group=i // 4))
    return out


def timed_settings(trainable_layers: int, reuse_trunk: bool, epochs: int = 2, micro_batch: int = 4,
                   guard: bool = True) -> Any:
    """The update settings these benchmarks time: the RL runs' on the SmolLM2 warm starts where
    they set the cost (PPO epochs, micro-batches, trainable layers, the KL guard's re-scoring),
    but two mini-batches and ``seq-mean-token-mean`` where the runs take TrainConfig's one and
    ``seq-mean-token-sum``, and lr 1e-5; ``guard`` keeps the re-scoring on without ever stopping
    (every step is re-scored), off sets its limits to 0."""
    from trace_rl.policy.update import UpdateSettings

    limit = 1e3 if guard else 0.0
    return UpdateSettings(
        learning_rate=1e-5, clip_low=0.2, clip_high=0.28, kl_coef=0.0, epochs=epochs,
        micro_batch=micro_batch, agg="seq-mean-token-mean", mini_batches=2, target_kl=limit,
        target_position_kl=limit, trainable_layers=trainable_layers, reuse_trunk=reuse_trunk)


def timed_update(policy: str, settings: Any, samples: Sequence[Any]) -> tuple[float, torch.Tensor]:
    """(seconds of one ``update``, the weights after it, flattened)."""
    from trace_rl.policy.update import PolicyTrainer

    trainer = PolicyTrainer(policy, settings, seed=0)
    t0 = time.perf_counter()
    trainer.update(samples, torch.Generator().manual_seed(0))
    seconds = time.perf_counter() - t0
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters() if p.requires_grad])
    return seconds, flat


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="smollm2",
                    help="an HF model directory, or a named policy (default: smollm2)")
    ap.add_argument("--trainable-layers", type=int, default=6)
    ap.add_argument("--paths", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per path")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--no-guard", action="store_true", help="turn the KL guard's re-scoring off")
    ap.add_argument("--repeats", type=int, default=2, help="timed updates of each setting")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    from trace_rl.policy.named import resolve_policy

    policy = resolve_policy(args.policy)
    vocab = AutoConfig.from_pretrained(policy).vocab_size
    samples = paths(vocab, args.paths, args.tokens)
    times: dict[bool, list[float]] = {False: [], True: []}
    weights: dict[bool, torch.Tensor] = {}
    for _ in range(args.repeats):
        for reuse in (False, True):
            settings = timed_settings(args.trainable_layers, reuse, args.epochs, args.micro_batch,
                                      guard=not args.no_guard)
            seconds, weights[reuse] = timed_update(policy, settings, samples)
            times[reuse].append(seconds)
            print(f"reuse_trunk={reuse}: {seconds:.1f} s", flush=True)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    gap = float((weights[False] - weights[True]).abs().max())
    result = {"policy": args.policy, "trainable_layers": args.trainable_layers,
              "paths": args.paths, "tokens": args.tokens, "micro_batch": args.micro_batch,
              "epochs": args.epochs, "guard": not args.no_guard, "seconds_off": times[False],
              "seconds_on": times[True], "speedup": off / on, "max_weight_difference": gap}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"trunk reuse: update {off:.1f} s -> {on:.1f} s ({off / on:.2f}x faster); "
          f"weights differ by {gap:.1e}")
    return result


if __name__ == "__main__":
    main()
