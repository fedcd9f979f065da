"""The bootstrap's entry points: ``bootstrap_policy`` (a family and a directory), ``run_bootstrap``
(a ready config; the cache), and the command line ``python -m trace_rl.policy.bootstrap``."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import transformers

from trace_rl.envs.base import Environment, TaskItem
from trace_rl.envs.registry import make_env
from trace_rl.policy import cache
from trace_rl.policy.bootstrap.cache import holds, input_hash, read_record
from trace_rl.policy.bootstrap.config import RECORD, BootstrapConfig, family_config
from trace_rl.policy.bootstrap.training import train_policy
from trace_rl.policy.tiny import PRESETS


DEFAULT = {k: f.default for k, f in BootstrapConfig.model_fields.items()}
"""``BootstrapConfig``'s defaults by field (the command line's)."""


def bootstrap_policy(family: str, out_dir: str | Path, *, difficulty: int,
                     threads: int | None = None, cache_dir: str | Path | None = None,
                     show_progress: bool = False, **settings: Any) -> Path:
    """Build (or reuse) the SFT-warm-started tiny policy of ``family`` in ``out_dir``; return it.

    ``settings`` are further ``BootstrapConfig`` fields (preset, seed, sft_examples, noise, ...;
    left out or None: the family's setting or the default; ``family_config``).
    Cached: when ``out_dir/bootstrap.json`` holds the same input hash, nothing is recomputed; with
    ``cache_dir``, a policy built once for the same inputs is copied from there (``run_bootstrap``).
    ``show_progress``: report each phase and SFT step (``trace_rl.progress``).
    """
    config = family_config(family, difficulty=difficulty, **settings)
    return run_bootstrap(config, out_dir, threads=threads, cache_dir=cache_dir,
                         show_progress=show_progress)


def run_bootstrap(config: BootstrapConfig, out_dir: str | Path, threads: int | None = None,
                  cache_dir: str | Path | None = None, show_progress: bool = False) -> Path:
    """``bootstrap_policy`` for a ready ``BootstrapConfig``; ``threads`` (default 1) sets torch's
    CPU threads during the run (restored afterwards). One by default, not the idle cores
    (``auto_threads``): a backward pass of the tiny model on 1 and on 2 threads differs by ~1e-8
    (float sums in another order), so the policy, and every figure of the default run, would
    depend on how busy the machine was when it first bootstrapped; on one thread it depends on
    the CPU alone (156 s of SFT on an Intel Xeon).

    With ``cache_dir`` (``trace_rl.environ.cache_dir()`` from the flows) the policy is built once
    per machine: it lives in ``cache_dir/policies/<family>-<input hash>``, keyed by everything that
    determines it (``input_hash``: recipe version, config, system prompt, items), and each work
    dir gets its own copy, so a work dir stays whole when moved or when the cache is cleared. A
    file lock makes a second process wanting the same policy wait for the first instead of
    training it twice."""
    out = Path(out_dir)
    env = make_env(config.family, difficulty=config.difficulty, seed=config.seed,
                   n_train=config.sft_examples,
                   n_test=config.eval_items + config.report_items,
                   **({"mix": tuple(config.mix)} if config.mix else {}), **dict(config.options))
    # A family may keep its SFT traces apart from the prompts RL trains on (``sft_split``).
    train, test = env.load(getattr(env, "sft_split", "train")), env.load("test")
    digest = input_hash(config, env, train + test)
    if holds(out, digest):
        return out
    if out.exists() and read_record(out) is None and any(out.iterdir()):
        raise FileExistsError(f"bootstrap_policy: {out} exists, is not empty and has no {RECORD}; "
                              "refusing to overwrite it (choose an empty or new directory)")
    if cache_dir is None:
        _build(config, env, train, test, digest, out, threads, show_progress)
        return out
    cached = Path(cache_dir) / "policies" / f"{config.family}-{digest[:16]}"
    return cache.build_once(cached, out, lambda d: holds(d, digest),
                            lambda d: _build(config, env, train, test, digest, d, threads,
                                             show_progress),
                            "bootstrap" if show_progress else None)


def _build(config: BootstrapConfig, env: Environment, train: list[TaskItem], test: list[TaskItem],
           digest: str, out: Path, threads: int | None, show_progress: bool) -> None:
    """Train the policy and move it onto ``out`` atomically (``cache.build_staged``)."""
    eval_items, report_items = test[:config.eval_items], test[config.eval_items:]
    previous_threads = torch.get_num_threads()
    threads = threads or 1
    torch.set_num_threads(threads)

    def make(staged: Path, work: Path) -> dict[str, Any]:
        record = train_policy(config, env, train, eval_items, report_items, staged, work,
                              show_progress)
        return record | {"input_hash": digest, "threads": threads}

    try:
        cache.build_staged(out, RECORD, make)
    finally:
        torch.set_num_threads(previous_threads)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m trace_rl.policy.bootstrap --family synth_arith --out DIR``."""
    p = argparse.ArgumentParser(prog="python -m trace_rl.policy.bootstrap", description=(
        "Bootstrap a tiny CPU policy for a synthetic family: tokenizer, model, SFT warm start, "
        "cache."))
    p.add_argument("--family", required=True, help="task family, e.g. synth_arith")
    p.add_argument("--out", required=True, help="output policy directory")
    p.add_argument("--difficulty", type=int, required=True)
    p.add_argument("--mix", type=lambda t: tuple(int(x) for x in t.split(",")), default=(),
                   help="item difficulties taken in turn, e.g. 1,2,3 (with --difficulty 3)")
    p.add_argument("--preset", default=DEFAULT["preset"], choices=sorted(PRESETS))
    p.add_argument("--seed", type=int, default=DEFAULT["seed"])
    p.add_argument("--sft-examples", type=int, default=None,
                   help=f"default {DEFAULT['sft_examples']}, or the family's own")
    p.add_argument("--sft-epochs", type=int, default=None,
                   help=f"default {DEFAULT['sft_epochs']}, or the family's own")
    p.add_argument("--target", type=float, nargs=2, default=DEFAULT["target_success"],
                   metavar=("LOW", "HIGH"))
    p.add_argument("--noise", type=float, default=DEFAULT["noise"])
    p.add_argument("--lr", type=float, default=DEFAULT["learning_rate"])
    p.add_argument("--merged-digits", action="store_true",
                   help="BPE may merge digits (the recipe before version 4)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    transformers.utils.logging.disable_progress_bar()
    t0 = time.perf_counter()
    out = bootstrap_policy(args.family, args.out, difficulty=args.difficulty, preset=args.preset,
                           seed=args.seed, sft_examples=args.sft_examples,
                           sft_epochs=args.sft_epochs, target_success=tuple(args.target),
                           noise=args.noise, learning_rate=args.lr,
                           split_digits=not args.merged_digits, mix=args.mix)
    rec = read_record(out) or {}
    print(f"{out}: {args.family} d={args.difficulty} preset={args.preset} "
          f"params={rec.get('params')} epochs={rec.get('epochs_run')} (kept {rec.get('epoch_kept')}) "
          f"sft_s={rec.get('sft_seconds', 0):.1f} success sampled={rec.get('success_sampled', 0):.3f} "
          f"greedy={rec.get('success_greedy', 0):.3f} init={rec.get('success_init', 0):.3f} "
          f"(this call {time.perf_counter() - t0:.1f}s)")
