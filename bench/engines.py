"""Engines benchmark: per model, vLLM against transformers on the same seeded requests: start-up,
tokens/s, weight sync, the engine/trainer log-prob mismatch, and vLLM's prefix-cache share on
two-turn trajectories (docs/results.md, "Engines benchmark").

    python -m bench.engines [--models tiny,smollm2] [--prompts 8] [--n 4] [--max-tokens 64]
                            [--continuations 2] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench import add_options
from trace_rl.engines import make_engine
from trace_rl.policy.smollm import smollm2_dir
from trace_rl.policy.tiny import make_tiny_policy
from trace_rl.rollout.format import TurnFormat
from trace_rl.rollout.types import Engine, GenRequest, SamplingSettings

TOPICS = ("the capital of the country where the river starts", "the sum of 17 and 25",
          "who wrote the book about the whale", "the population of the largest city",
          "the year the bridge was finished", "how many legs three spiders have",
          "the weather tomorrow in the city by the lake", "the product of 12 and 13")
OBSERVATION = "<tool_response>{\"result\": 42, \"source\": \"kb\"}</tool_response>"


@dataclass
class EngineRun:
    engine: str
    startup_s: float
    tokens: int
    seconds: float
    sync_s: float
    mismatch: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def chat_prompts(fmt: TurnFormat, count: int, seed: int) -> list[tuple[int, ...]]:
    """``count`` chat-template prompts of varied length (1-4 questions per user message)."""
    rng = random.Random(seed)
    return [tuple(fmt.prompt_ids("Answer with tool calls; finish with <answer>.",
                                 f"Find {' and '.join(rng.sample(TOPICS, rng.randint(1, 4)))}."))
            for _ in range(count)]


def throughput(engine: Engine, prompts, n: int, max_tokens: int, seed: int) -> tuple[int, float, list]:
    """Generated tokens, seconds and (prompt, completion) pairs of one batch of the requests."""
    reqs = [GenRequest(p, n, SamplingSettings(max_tokens=max_tokens, temperature=1.0,
                                              seed=seed + i)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    seconds = time.perf_counter() - t0
    pairs = [(p, c) for p, cs in zip(prompts, out) for c in cs]
    return sum(len(c.token_ids) for _, c in pairs), seconds, pairs


def mismatch(model_dir: Path, pairs) -> dict[str, float]:
    """``engine_mismatch`` of the engine's log-probs of its sampled tokens against the trainer's
    (float32 transformers forward of prompt + completion, one sequence at a time: no padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trace_core.loss import engine_mismatch
    from trace_rl.policy.logprobs import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    train, engine = [], []
    with torch.no_grad():
        for prompt, c in pairs:
            if not c.token_ids:
                continue
            ids = torch.tensor([list(prompt) + list(c.token_ids)])
            lp = token_logprobs(model, ids, torch.ones_like(ids))[0, len(prompt):]
            train.append(lp)
            engine.append(torch.tensor(c.logprobs, dtype=torch.float32))
    t, e = torch.cat(train)[None], torch.cat(engine)[None]
    return engine_mismatch(t, e, torch.ones_like(t))


def prefix_cache_share(engine, prompts, turn_tokens: int, continuations: int,
                       seed: int) -> tuple[int, int, int]:
    """(prefixes, queries, hits) of vLLM's prefix cache over continuations of two-turn prefixes."""
    fmt = TurnFormat(engine.tokenizer)
    turn = SamplingSettings(max_tokens=turn_tokens, temperature=1.0, stop=("</tool_call>",))
    histories = [list(p) for p in prompts]
    prefixes: list[tuple[int, ...]] = []
    for depth in range(2):
        reqs = [GenRequest(tuple(h), 1, replace(turn, seed=seed + i))
                for i, h in enumerate(histories)]
        for h, (c,) in zip(histories, engine.generate(reqs)):
            h += c.token_ids + fmt.obs_ids(OBSERVATION, c.token_ids)  # the rollouts' glue
            prefixes.append(tuple(h))
    q0, h0 = engine.prefix_cache_stats()
    engine.generate([GenRequest(p, continuations, SamplingSettings(
        max_tokens=turn_tokens, temperature=1.0, seed=seed + 1000 + i))
        for i, p in enumerate(prefixes)])
    q1, h1 = engine.prefix_cache_stats()
    return len(prefixes), q1 - q0, h1 - h0


def run_model(model_dir: Path, args) -> tuple[list[EngineRun], tuple[int, int, int]]:
    runs, cache = [], (0, 0, 0)
    for kind in ("vllm", "hf"):
        t0 = time.perf_counter()
        engine = make_engine(kind, model_dir, device=args.device,
                             **({"max_model_len": 2048} if kind == "vllm" else {}))
        startup = time.perf_counter() - t0
        try:
            prompts = chat_prompts(TurnFormat(engine.tokenizer), args.prompts, args.seed)
            throughput(engine, prompts[:2], 1, 8, args.seed)  # warm-up, not measured
            tokens, seconds, pairs = throughput(engine, prompts, args.n, args.max_tokens, args.seed)
            sync = engine.load_weights(model_dir)
            runs.append(EngineRun(kind, startup, tokens, seconds, sync, mismatch(model_dir, pairs)))
            if kind == "vllm":
                cache = prefix_cache_share(engine, prompts, args.turn_tokens, args.continuations,
                                           args.seed)
        finally:
            engine.close()
    return runs, cache


def main(argv: list[str] | None = None) -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_options(p, ("--models", "tiny,smollm2", "comma list of: tiny, smollm2"),
                ("--prompts", 8, "distinct prompts per batch"), ("--n", 4, "samples per prompt"),
                ("--max-tokens", 64, "generated tokens cap per sample"),
                ("--turn-tokens", 48, "tokens per turn (prefix phase)"),
                ("--continuations", 2, "samples per stored prefix"),
                ("--device", "cuda" if torch.cuda.is_available() else "cpu", ""), ("--seed", 0, ""))
    args = p.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(models) - {"tiny", "smollm2"}
    if unknown or not models:
        p.error(f"--models: unknown {sorted(unknown)}; choose from tiny, smollm2")

    print(f"device={args.device} torch_threads={torch.get_num_threads()} prompts={args.prompts} "
          f"n={args.n} max_tokens={args.max_tokens}", flush=True)
    results: dict[str, tuple[list[EngineRun], tuple[int, int, int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label in models:
            model_dir = smollm2_dir() if label == "smollm2" else make_tiny_policy(
                Path(tmp) / "tiny", preset="tiny", seed=args.seed)
            results[label] = run_model(model_dir, args)
            runs, (prefixes, queries, hits) = results[label]
            for r in runs:
                print(f"{label:8s} {r.engine:5s} startup {r.startup_s:6.1f} s  "
                      f"{r.tokens:6d} tokens in {r.seconds:7.2f} s = {r.tokens_per_s:8.1f} tok/s  "
                      f"weight sync {r.sync_s:6.3f} s", flush=True)
                m = r.mismatch
                print(f"{label:8s} {r.engine:5s} engine/trainer mismatch on {m['mismatch_tokens']:.0f} "
                      f"tokens: mean |dlogp| {m['mismatch_abs_mean']:.2e}, KL {m['mismatch_kl']:.2e} "
                      f"(max token {m['mismatch_kl_max']:.2e})", flush=True)
            print(f"{label:8s} vllm  prefix cache: {prefixes} prefixes x {args.continuations} "
                  f"continuations, {hits}/{queries} prompt tokens from cache "
                  f"({100 * hits / max(queries, 1):.1f}%)", flush=True)
    headline = "smollm2" if "smollm2" in results else models[0]
    runs, (_, queries, hits) = results[headline]
    speed = {r.engine: r.tokens_per_s for r in runs}
    if headline != "smollm2":
        print(f"(SmolLM2 not run: both figures below are for the {headline} model)")
    print(f"vLLM/transformers tokens/s: {speed['vllm'] / speed['hf']:.2f}x; "
          f"prefix-cache hit: {100 * hits / max(queries, 1):.1f}%")


if __name__ == "__main__":
    from trace_rl.engines import entry_point

    entry_point(main)  # its engines stop with it (trace_rl.engines.lifecycle)
