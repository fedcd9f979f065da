"""TRACE against the baselines at equal leaf budget, end to end on a CPU.

Every method is the same ``train`` flow with another ``allocator``: grpo, dapo, prompt_only,
random_prefix, trace. Each (method, seed) run starts from the same bootstrapped tiny policy, spends
the same number of trajectories (leaves) per step, and is evaluated on held-out items of the family
at a few checkpoints (``--eval-samples`` rollouts per item at ``--eval-temperature``, the
training temperature by default: greedy decoding saturates). Printed per
method (mean and spread over seeds): final and best held-out accuracy, the area under accuracy
versus cumulative leaf budget (normalised to [0, 1]), the mean effective ratio over steps, tokens
and tool calls spent, and wall time; held-out accuracy at equal generated tokens (``@tokens``: at the
smallest token total any run spent, read off each run's accuracy-vs-tokens curve); above the last
line, TRACE minus each method paired by seed (mean and standard error). A plot of accuracy against
cumulative budget (leaves, and generated tokens) is saved. The last line compares at equal leaf
budget, the issue's basis; ``@tokens`` is a second view of the same runs (a continuation leaf
generates only its suffix, so tree methods spend fewer tokens per leaf).

The learning protocol (``--protocol tokens``; ``--regime paper`` names its configuration for the
tiny LM) replaces the equal-leaf budget with equal generated tokens per step and equal optimiser
steps, runs a negative control in the same invocation and reports as the simulator does:
``bench/learning_protocol.py``.

    python -m bench.learning --regime paper --seeds 0-9    # the protocol; records accumulate
    python -m bench.learning                 # the full benchmark (see --help)
    python -m bench.learning --quick         # a small configuration (what the test suite runs)
    python -m bench.learning --summarise-only [options]   # re-print a benchmark from its records

With ``--jobs 2`` (the default on a 2-core machine) the runs go to two worker processes, each
with its own work dir under ``--workdir`` (``job-<method>-s<seed>``; query one with
``trace sql --workdir ...``); ``--jobs 1`` keeps every run in one process and one DuckDB file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from bench import RECORDS
from bench.learning_protocol import REGIMES
from bench.learning_report import report
from bench.learning_runs import (METHODS, VARIANTS, _eval, check_signatures, eval_plan, eval_run_id,
                                 hard_setting, load_run, parse_seeds, recorded_runs, run_one,
                                 run_parallel, save_run, signature)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from bench import learning_protocol as protocol

    args = protocol.parse(_parser(), argv)
    tokens = args.protocol == "tokens"
    if args.quick:
        args.steps, args.eval_every, args.eval_items, args.eval_samples = 2, 2, 8, 2
        args.seeds = args.seeds or "1"
        args.root_budget, args.pool_size = 4, 8
    if args.summarise_only:
        return protocol.report(protocol.records_folder(args), args.final_of, vars(args)) \
            if tokens else summarise_recorded(args)
    if args.jobs is None:
        args.jobs = 1 if args.quick else min(2, os.cpu_count() or 1)
    if tokens:
        return protocol.run(args, _policy_and_base, _start_accuracy)
    workdir, records = Path(args.workdir), records_of(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    seeds = parse_seeds(args.seeds or "3", args.seed_start)
    policy, base, skip = _policy_and_base(args, workdir)
    eval_steps, ev = eval_plan(args, skip)
    sig = signature(base, eval_steps, ev, policy)
    check_signatures(records, sig)
    start = _start_accuracy(base, policy, records, sig, args.eval_items, skip, args.eval_samples,
                            args.eval_temperature)
    # The hard split's start first, so that a family without one fails before any run.
    hard_start = _hard_start(args, base, policy, records, sig) if args.hard_items else None
    # Each run measures its final checkpoint on the hard split as it ends, into its record.
    hard = hard_setting(args.hard_items, _hard_samples(args), args.eval_temperature) \
        if args.hard_items else None
    jobs = [(m, s) for s in seeds for m in methods if load_run(records, sig, m, s) is None]
    if args.jobs <= 1:
        for m, s in jobs:
            save_run(records, sig, run_one(m, s, base, policy, workdir, eval_steps,
                                           start_accuracy=start, hard=hard, **ev))
    elif jobs:
        run_parallel(jobs, args.jobs, base, policy, workdir, eval_steps, start, ev, sig, hard,
                     records)
    # Every recorded seed of these methods made with these settings, this invocation's and
    # earlier ones'.
    results = sorted((r for r in recorded_runs(records, sig) if r.method in methods),
                     key=lambda r: (r.seed, methods.index(r.method)))
    return report(results, vars(args), start, records, hard_start=hard_start)


def records_of(args: argparse.Namespace) -> Path:
    """Where the equal-leaf benchmark's records go: ``--records``, else ``results/learning_<family>``
    (with ``--quick``, the work dir: a test's runs are not records)."""
    if args.records:
        return Path(args.records)
    return Path(args.workdir) if args.quick else RECORDS / f"learning_{args.family}"


def _kept(path: Path, key: str, value: Any, measure: Any) -> float:
    """An accuracy measured once per settings (``{key: value}``) and kept in ``path``, so that a
    later invocation adding seeds or methods does not measure it again."""
    if path.exists() and (kept := json.loads(path.read_text())).get(key) == value:
        return float(kept["accuracy"])
    accuracy = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({key: value, "accuracy": accuracy}, indent=1) + "\n")
    return accuracy


def _start_accuracy(base: dict[str, Any], policy: str, folder: Path, sig: str, items: int,
                    skip: int, samples: int, temperature: float) -> float:
    """The starting policy's held-out accuracy for these settings (``signature``): the first
    accuracy of a recorded run of them, else kept in ``<folder>/start.json``."""
    for record in sorted((folder / "runs").glob("*.json")):
        if (data := json.loads(record.read_text())).get("signature") == sig:
            return float(data["result"]["accuracy"][0])
    return _kept(folder / "start.json", "signature", sig, lambda: _eval(
        {**base, "policy": policy, "run_id": eval_run_id(policy)}, policy, items, skip, samples,
        temperature))


def _hard_samples(args: argparse.Namespace) -> int:
    return args.hard_samples or args.eval_samples


def _hard_start(args: argparse.Namespace, base: dict[str, Any], policy: str, records: Path,
                sig: str) -> float:
    """The starting policy's accuracy on the hard split (``--hard-items``), kept in
    ``<records>/hard_start.json`` for these settings."""
    setting = {"signature": sig, **hard_setting(args.hard_items, _hard_samples(args),
                                                args.eval_temperature)}
    return _kept(records / "hard_start.json", "setting", setting, lambda: _eval(
        {**base, "policy": policy, "run_id": eval_run_id(policy), "eval_split": "hard"},
        policy, args.hard_items, 0, _hard_samples(args), args.eval_temperature))


def _parser() -> argparse.ArgumentParser:
    """The benchmark's command line (``--help``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="synth_arith")
    ap.add_argument("--difficulty", type=int, default=1)
    ap.add_argument("--mix", default="",
                    help="item difficulties taken in turn, e.g. 1,2,3 (a pool of uneven prompts; "
                         "--difficulty must be >= the largest); default: all at --difficulty")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"allocators, or variants: {', '.join(VARIANTS)} (--protocol tokens: "
                         "trace_cover, the reference, among them)")
    ap.add_argument("--protocol", choices=("leaves", "tokens"), default="leaves",
                    help="leaves: every method at the same leaf budget; tokens: the learning "
                         "protocol (bench/learning_protocol.py): grpo, dapo and prompt_only sized to "
                         "trace_cover's generated tokens per step, equal steps, a negative control "
                         "in the same invocation, records under --records")
    ap.add_argument("--regime", choices=sorted(REGIMES), default=None,
                    help="a named configuration of the tokens protocol, as defaults under the "
                         "explicit options: paper = " + " ".join(
                             f"--{k.replace('_', '-')} {v}" for k, v in REGIMES["paper"].items()))
    ap.add_argument("--records", default="",
                    help="where each run's record goes (default results/learning_<family>; "
                         "--protocol tokens: results/learning_lm/<regime>, without a regime "
                         "<workdir>/records; with --quick the work dir)")
    ap.add_argument("--control-difficulty", type=int, default=1,
                    help="--protocol tokens: the negative control's one difficulty (no mix)")
    ap.add_argument("--final-of", type=int, default=1,
                    help="--protocol tokens: final accuracy = mean of the last this many evaluations")
    ap.add_argument("--policy-difficulty", type=int, default=None,
                    help="bootstrap the starting policy at this difficulty without a mix (default: "
                         "at --difficulty and --mix)")
    ap.add_argument("--seeds", default=None,
                    help="a count (3: seeds seed-start .. seed-start + 2) or a range (3-5). Each "
                         "(method, seed) run is kept in <records>/runs/, and a later invocation "
                         "with the same settings reuses it, so seeds accumulate: the report covers "
                         "every recorded seed (default 3; 1 with --quick)")
    ap.add_argument("--seed-start", type=int, default=0,
                    help="first seed of a --seeds count")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--eval-items", type=int, default=200)
    ap.add_argument("--eval-samples", type=int, default=4,
                    help="rollouts per held-out item; accuracy is their mean reward")
    ap.add_argument("--eval-temperature", type=float, default=1.0,
                    help="sampling temperature of the evaluation (1.0 = the training rollouts'; "
                         "greedy saturates: the bootstrapped policy answers 100%% of held-out "
                         "items greedily while sampling succeeds ~50%%)")
    ap.add_argument("--hard-items", type=int, default=0,
                    help="also evaluate each run's final checkpoint (and the start) on this many "
                         "items of the family's hard split (synth_chain: H = 5, 1.5x hazards); "
                         "0 = not. Added to recorded runs without re-running them")
    ap.add_argument("--hard-samples", type=int, default=None,
                    help="rollouts per hard item (default: --eval-samples)")
    ap.add_argument("--learning-rate", type=float, default=None,
                    help="policy learning rate for every method (default: the config's)")
    ap.add_argument("--root-budget", type=int, default=16,
                    help="M: bare rollouts per step of the tree methods (leaves per step: M (1 + N))")
    ap.add_argument("--multiplier", type=int, default=2,
                    help="N: continuation multiplier (2: the smallest of the paper's budget "
                         "configurations, as in bench/allocation.py)")
    ap.add_argument("--pool-size", type=int, default=32)
    ap.add_argument("--train-items", type=int, default=None,
                    help="size of the train split (default: the family's, 2000 for the synthetic "
                         "ones, so a 20-step run rarely rolls out a prompt twice); a smaller split "
                         "makes prompts recur across steps, as in multi-epoch training")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="further TrainConfig fields for every method (e.g. loss_agg=seq-mean-token-mean)")
    ap.add_argument("--policy", default=None,
                    help="start every run from this Hugging Face policy directory instead of the "
                         "family's bootstrapped tiny policy (a bootstrap.json beside it tells "
                         "which test items to skip)")
    ap.add_argument("--workdir", default="bench_runs/learning",
                    help="keeps the bootstrapped policy (cached) and every run's trees and metrics")
    ap.add_argument("--plot", default="docs/learning.png")
    ap.add_argument("--jobs", type=int, default=None,
                    help="(method, seed) runs in parallel worker processes, one torch thread "
                         "each (default: 2 on a machine with >= 2 cores, 1 with --quick); 1 = all "
                         "in this process, in one work dir")
    ap.add_argument("--quick", action="store_true", help="a small configuration for the tests")
    ap.add_argument("--summarise-only", action="store_true",
                    help="run nothing: re-print (and re-plot) the benchmark from its records "
                         "(--protocol tokens: --records; else <workdir>/runs and start.json)")
    return ap


def _policy_and_base(args: argparse.Namespace, workdir: Path) -> tuple[str, dict[str, Any], int]:
    """The starting policy (``--policy``, else the family's bootstrapped tiny policy, cached in
    ``workdir``), the train config every method shares (as a mapping: the method and seed are
    added per run) and how many test items the bootstrap used (skipped by the evaluations)."""
    from flows.bootstrap import bootstrap
    from tasks.evaluate import bootstrap_items
    from trace_rl.config import TrainConfig, load_config
    from trace_rl.config import warmstart_defaults
    from trace_rl.envs.registry import is_generated, options

    mix = [int(d) for d in args.mix.split(",") if d.strip()]
    # The synthetic generators take their split sizes here; a real family's splits are files
    # (its own options, e.g. HotpotQA's top_k, come through --set extra=...).
    synthetic = is_generated(args.family)
    if not synthetic and (args.train_items is not None or mix):
        raise SystemExit(f"--train-items and --mix are options of the synthetic families, not of "
                         f"{args.family!r} (choose its split with --set train_split=...)")
    keys = [kv.split("=", 1)[0].strip() for kv in args.set]
    # --set, parsed (and unknown keys refused) exactly as `trace train key=value` does
    given = [f"family={args.family}", *([f"policy={args.policy}"] if args.policy else []), *args.set]
    overridden = load_config(None, given) if args.set else None
    family_options = (overridden or TrainConfig(family=args.family)).family_options()
    boot = (args.policy_difficulty, None) if args.policy_difficulty else (args.difficulty, mix or None)
    policy = str(Path(args.policy).resolve()) if args.policy else bootstrap(
        family=args.family, difficulty=boot[0], workdir=str(workdir), seed=0,
        preset="test" if args.quick else "tiny", mix=boot[1], options=family_options or None)
    base = {"family": args.family, "difficulty": args.difficulty, "steps": args.steps,
            "root_budget": args.root_budget, "multiplier": args.multiplier,
            "pool_size": args.pool_size, "plot_every": 0, "engine": "hf",
            "eval_items": 0,  # evaluated here, at eval_steps, not by the flow
            "checkpoint_every": args.eval_every}
    skip = bootstrap_items(policy)
    # A family with its own train-split option (synth_chain's chain_train_items) takes
    # --train-items there; the other synthetic families as n_train.
    own_train = next((k for k in options(args.family) if k.endswith("_train_items")), None)
    # A real family's options: those its warm start was built with (HotpotQA's top_k and
    # max_chars: the observations RL shows must be the ones SFT taught it to read), unless --set.
    base["extra"] = {"n_test": skip + args.eval_items, **({"mix": mix} if mix else {}),
                     **({"n_train": args.train_items} if args.train_items is not None
                        and own_train is None else {})} if synthetic else \
        warmstart_defaults(policy, args.family).get("extra", {})
    if own_train and args.train_items is not None:
        base[own_train] = args.train_items
    if args.learning_rate is not None:
        base["learning_rate"] = args.learning_rate
    if overridden is not None:
        base.update({k: getattr(overridden, k) for k in keys})
    return policy, base, skip


def summarise_recorded(args: argparse.Namespace) -> dict[str, Any]:
    """The report of the runs recorded in ``records_of(args)`` (``runs/``, ``start.json`` and
    ``hard_start.json``): every run of the settings ``start.json`` names; nothing runs. The
    table's sizes come from the options given, as when the runs were made."""
    records = records_of(args)
    path = records / "start.json"
    if path.exists():
        start = json.loads(path.read_text())
    else:  # every recorded run's first evaluation is the start
        sigs = {json.loads(p.read_text())["signature"] for p in (records / "runs").glob("*.json")}
        if len(sigs) != 1:
            raise FileNotFoundError(f"--summarise-only: no {path}, and records of {len(sigs)} "
                                    f"settings in {records / 'runs'}")
        sig = sigs.pop()
        start = {"signature": sig, "accuracy": recorded_runs(records, sig)[0].accuracy[0]}
    hard = records / "hard_start.json"
    hard_start = json.loads(hard.read_text())["accuracy"] if hard.exists() else None
    return report(recorded_runs(records, start["signature"]), vars(args), start["accuracy"],
                  records, hard_start=hard_start)


if __name__ == "__main__":
    from trace_rl.engines import entry_point

    entry_point(main)  # its engines stop with it (trace_rl.engines.lifecycle)
