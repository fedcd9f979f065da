"""TRACE against the baselines, end to end on a CPU: every method is the same ``train`` flow with
another ``allocator`` (or a ``VARIANTS`` row) from the same bootstrapped tiny policy, evaluated on
held-out items at a few checkpoints (docs/results.md, "Learning benchmark (the tiny LM, end to
end)"). ``--protocol leaves``: equal leaf budgets; ``--protocol tokens`` (``--regime paper``): the
flat baselines sized to the reference's generated tokens per step, and a negative control.

    python -m bench.learning --regime paper --seeds 0-9    # the protocol; records accumulate
    python -m bench.learning --quick                       # a small configuration (the tests')
    python -m bench.learning --summarise-only [options]    # re-print a benchmark from its records

Records: one JSON per (structure, method, seed) under ``records_of(args)``, written as each run
ends; a later invocation with the same settings runs only what is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from bench import RECORDS, add_options
from bench.learning_report import conclude, report, run_log, structure_rows
from bench.learning_runs import (METHODS, VARIANTS, RunResult, _eval, check_signatures, eval_plan, load_run,
                                 parse_seeds, read_records, recorded_runs, run_one, save_run, signature)
from trace_core.allocators import Budget

REFERENCE = "trace_cover"
"""The row whose generated tokens per step the matched baselines spend (``--protocol tokens``)."""
MATCHED = {"grpo": 0, "dapo": 0, "prompt_only": 2}
"""The flat baselines sized to the reference's tokens, and their group (0: ``group_size``)."""
ORACLE = "trace_cover_oracle"
"""The reference with its predictor replaced by a Monte-Carlo oracle (``oracle_rollouts``)."""
TOKEN_METHODS = (REFERENCE, "grpo", "dapo", "prompt_only", "trace", "cover_oracle", ORACLE)
OPTIONAL = (ORACLE,)
"""Rows a seed is complete without, run last (their oracle costs several times the run's own
rollouts)."""
CONTROL_METHODS = (REFERENCE, "grpo", "dapo", "prompt_only")
"""The control needs the reference and the baselines the closing line's best is taken from."""
LM_RESULTS = RECORDS / "learning_lm"

REGIMES: dict[str, dict[str, Any]] = {
    "paper": {"family": "synth_arith", "policy_difficulty": 1, "difficulty": 2, "mix": "1,2,2",
              "control_difficulty": 1, "protocol": "tokens", "steps": 20, "eval_every": 5,
              "eval_items": 300, "eval_samples": 2, "final_of": 2,
              "methods": f"trace_cover,grpo,dapo,prompt_only,trace,{ORACLE}"},
}
"""``--regime``: defaults under the explicit options (docs/results.md says why the paper regime)."""


@dataclass
class Structure:
    """One family configuration: the equal-leaf one, or the tokens protocol's main or control."""

    name: str
    base: dict[str, Any]
    signature: str
    start: float
    workdir: Path
    records: Path
    methods: tuple[str, ...]
    matched: bool = True
    """Whether the ``MATCHED`` baselines are sized to the reference (the tokens protocol)."""
    runner: Callable[..., RunResult] = run_one
    """One (method, seed) run, called as ``run_one`` is (``bench.peers``: TRL's or this project's)."""
    notes: dict[str, Any] = field(default_factory=dict)
    """Added to every run's ``extra`` (``bench.peers``: the TRL version, machine and settings)."""

    def recorded(self) -> list[RunResult]:
        """Every recorded run of these settings and methods, by seed then method."""
        return sorted((r for r in recorded_runs(self.records, self.signature) if r.method in self.methods),
                      key=lambda r: (r.seed, self.methods.index(r.method)))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(_parser(), argv)
    tokens = args.protocol == "tokens"
    quick(args, root_budget=4)
    workdir, records = Path(args.workdir), records_of(args)
    if args.summarise_only and tokens:
        return protocol_report(records, args.final_of, vars(args))
    if args.summarise_only:  # every run in the folder (one setting: check_signatures)
        if not (runs := recorded_runs(records)):
            raise FileNotFoundError(f"--summarise-only: no records in {records / 'runs'}")
        return report(runs, runs[0].accuracy[0])
    if args.jobs is None:
        args.jobs = 1 if args.quick else min(2, os.cpu_count() or 1)
    seeds = parse_seeds(args.seeds or "3")
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    if tokens and REFERENCE not in methods:
        raise SystemExit(f"--protocol tokens: the methods must include the reference {REFERENCE}")
    policy, base, skip = _policy_and_base(args, workdir)
    eval_steps, ev = eval_plan(args, skip)
    if tokens:
        control_args = argparse.Namespace(**{**vars(args), "policy": policy, "mix": "",
                                             "difficulty": args.control_difficulty})
        plan = [("main", base, methods, workdir / "main", records / "main"),
                ("control", _policy_and_base(control_args, workdir)[1],
                 tuple(m for m in CONTROL_METHODS if m in methods), workdir / "control",
                 records / "control")]
    else:
        plan = [("leaves", base, methods, workdir, records)]
    structures = {}
    notes = {"settings": invocation(args, policy)}
    for name, b, ms, wd, rec in plan:
        b = {**b, "keep_checkpoints": 1}  # only the evaluated ones (13 MB a step for the tiny policy)
        sig = signature(b, eval_steps, ev, policy)
        check_signatures(rec, sig)  # records of other settings are not silently mixed in
        start = _start_accuracy(b, policy, wd, sig, ev, rec)
        structures[name] = Structure(name, b, sig, start, wd, rec, ms, matched=tokens, notes=notes)
    run_jobs(job_order(seeds, {n: st.methods for n, st in structures.items()}), structures,
             args.jobs, policy, eval_steps, ev)
    if tokens:
        return protocol_report(records, args.final_of, vars(args))
    return report(structures["leaves"].recorded(), structures["leaves"].start)


def invocation(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """What a record keeps of the command that made it: every option as given (``--set``
    included) and ``policy_path``, the starting policy as resolved (the signature names a warm
    start by that path, not by a link to it)."""
    return {**vars(args), "policy_path": policy}


def quick(args: argparse.Namespace, **sizes: int) -> None:
    """``--quick`` (the tests'): two steps, 8 held-out items x 2, a pool of 8, one seed; ``sizes``."""
    if args.quick:
        vars(args).update({"steps": 2, "eval_every": 2, "eval_items": 8, "eval_samples": 2, "pool_size": 8,
                           "seeds": args.seeds or "1", **sizes})


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with ``--regime``'s defaults under the explicit options."""
    known, _ = parser.parse_known_args(argv)
    if known.regime:
        parser.set_defaults(**REGIMES[known.regime])
    return parser.parse_args(argv)


def records_of(args: argparse.Namespace) -> Path:
    """Where the records go: ``--records``; else, equal leaves, ``results/learning_<family>``
    (with ``--quick`` the work dir: a test's runs are not records); the tokens protocol,
    ``results/learning_lm/<regime>`` (without a regime ``<workdir>/records``)."""
    if args.records:
        return Path(args.records)
    if args.protocol == "tokens":
        return LM_RESULTS / args.regime if args.regime else Path(args.workdir) / "records"
    return Path(args.workdir) if args.quick else RECORDS / f"learning_{args.family}"


def _start_accuracy(base: dict[str, Any], policy: str, workdir: Path, sig: str,
                    ev: dict[str, Any], records: Path) -> float:
    """The starting policy's held-out accuracy for these settings (``signature``), measured once
    per work dir (``<workdir>/start.json``) and checked against the runs in ``records``: a policy
    bootstrapped from the same inputs on another CPU has other weights, so its runs would not pair."""
    path = workdir / "start.json"
    if path.exists() and (kept := json.loads(path.read_text())).get("signature") == sig:
        accuracy = float(kept["accuracy"])
    else:
        accuracy = _eval({**base, "policy": policy}, policy, **ev)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"signature": sig, "accuracy": accuracy}, indent=1) + "\n")
    elsewhere = sorted({f"{r.accuracy[0]:.6g}" for s, r in read_records(records) if s == sig}
                       - {f"{accuracy:.6g}"})
    if elsewhere:
        raise SystemExit(f"{records}: its runs start from held-out accuracy {', '.join(elsewhere)}, "
                         f"this machine's starting policy from {accuracy:.6g}: they were made from "
                         "another policy or on another CPU and would not pair; give another --records "
                         "folder (or run where they were made)")
    return accuracy


def _parser() -> argparse.ArgumentParser:
    """The benchmark's command line (``--help``): ``run_options`` and the protocols' own."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_options(ap)
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"allocators, or variants: {', '.join(VARIANTS)} (tokens: trace_cover among them)")
    ap.add_argument("--protocol", choices=("leaves", "tokens"), default="leaves",
                    help="leaves: equal leaf budgets; tokens: baselines sized to trace_cover's "
                         "generated tokens per step, equal steps, a negative control")
    ap.add_argument("--regime", choices=sorted(REGIMES), default=None,
                    help="defaults under the explicit options: paper = " + " ".join(
                        f"--{k.replace('_', '-')} {v}" for k, v in REGIMES["paper"].items()))
    add_options(ap, ("--records", "", "default results/learning_<family>; tokens: results/learning_lm/"
                                      "<regime> (no regime: <workdir>/records); --quick: the work dir"),
                ("--control-difficulty", 1, "tokens: the control's difficulty"),
                ("--final-of", 1, "tokens: final accuracy = mean of the last this many evaluations"),
                ("--jobs", int, "worker processes, one torch thread each (default 2 on >= 2 cores, 1 "
                                "with --quick; 1: in this process)"))
    ap.add_argument("--summarise-only", action="store_true", help="run nothing: re-print the report")
    return ap


def run_options(ap: argparse.ArgumentParser) -> None:
    """The options of the runs themselves, shared with ``bench.peers``."""
    add_options(
        ap, ("--family", "synth_arith", ""), ("--difficulty", 1, ""),
        ("--mix", "", "item difficulties taken in turn, e.g. 1,2,3 (--difficulty >= the largest); "
                      "default: all at --difficulty"),
        ("--policy-difficulty", int, "bootstrap the starting policy at this difficulty, no mix"),
        ("--policy", str, "a Hugging Face policy directory to start from instead of the family's "
                          "bootstrapped tiny policy"),
        ("--seeds", str, "a count (3: seeds 0-2) or a range (3-5); recorded seeds are reused "
                         "(default 3; 1 with --quick)"),
        ("--steps", 20, ""), ("--eval-every", 5, ""), ("--eval-items", 200, ""),
        ("--eval-samples", 4, "rollouts per held-out item"),
        ("--eval-temperature", 1.0, "of the evaluation (greedy saturates: 100%% greedy against "
                                    "~50%% sampled)"),
        ("--learning-rate", float, "default: the config's"),
        ("--root-budget", 16, "M (leaves per step: M (1 + N))"),
        ("--multiplier", 2, "N: continuation multiplier"), ("--pool-size", 32, ""),
        ("--train-items", int, "size of a synthetic family's train split (default 2000; fewer: "
                               "prompts recur)"),
        ("--workdir", "bench_runs/learning", "the cached bootstrapped policy and every run's trees "
                                             "and metrics"))
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="further TrainConfig fields for every method")
    ap.add_argument("--quick", action="store_true", help="a small configuration for the tests")


def _policy_and_base(args: argparse.Namespace, workdir: Path) -> tuple[str, dict[str, Any], int]:
    """The starting policy (``--policy``, else the family's bootstrapped tiny policy), the train
    config every method shares, and how many test items the bootstrap used (not evaluated on)."""
    from flows.bootstrap import bootstrap
    from tasks.evaluate import bootstrap_items
    from trace_rl.config import TrainConfig, load_config, warmstart_defaults
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
    # A real family's options: those its warm start was built with (HotpotQA's top_k and
    # max_chars: the observations RL shows must be the ones SFT taught it to read), unless --set.
    base["extra"] = ({"n_test": skip + args.eval_items, **({"mix": mix} if mix else {})} if synthetic
                     else warmstart_defaults(policy, args.family).get("extra", {}))
    if args.train_items is not None:  # synth_chain's own chain_train_items, the others' n_train
        own_train = next((k for k in options(args.family) if k.endswith("_train_items")), None)
        if own_train:
            base[own_train] = args.train_items
        else:
            base["extra"]["n_train"] = args.train_items
    if args.learning_rate is not None:
        base["learning_rate"] = args.learning_rate
    if overridden is not None:
        base.update({k: getattr(overridden, k) for k in keys})
    return policy, base, skip


def matched_budget(reference: RunResult, method: str, group_size: int) -> dict[str, int]:
    """The config fields that give flat ``method`` the reference run's mean generated tokens per
    step, at the reference's mean tokens per bare rollout (what a flat method's leaf is)."""
    steps = reference.extra["steps"]
    per_step = float(np.mean(steps["tokens"]))
    per_leaf = float(np.sum(steps["bare_tokens"]) / max(np.sum(steps["bare"]), 1.0))
    return {"root_budget": Budget.matched(per_step, per_leaf, MATCHED[method] or group_size).roots,
            "multiplier": 0}


def job_order(seeds: Sequence[int], methods: dict[str, Sequence[str]]) -> list[tuple[str, str, int]]:
    """(structure, method, seed) in the order runs start, so that paired seeds complete early: seed
    by seed the references, the matched baselines (which wait for them), the other rows; the
    ``OPTIONAL`` rows of every seed last."""
    def rank(m: str) -> int:
        return 0 if m == REFERENCE else 1 if m in MATCHED else 3 if m in OPTIONAL else 2

    jobs = [(name, m, s) for s in seeds for name, ms in methods.items() for m in ms]
    return sorted(jobs, key=lambda j: (rank(j[1]) == 3, seeds.index(j[2]), rank(j[1])))


def _budget(st: Structure, method: str, seed: int) -> dict[str, int] | None:
    """A matched baseline's budget fields, from its seed's reference (None while that is not
    recorded); no fields for the others."""
    if not st.matched or method not in MATCHED:
        return {}
    ref = load_run(st.records, st.signature, REFERENCE, seed)
    if ref is None:
        return None
    from trace_rl.config import TrainConfig

    return matched_budget(ref, method, st.base.get("group_size", TrainConfig().group_size))


def _job(st: Structure, method: str, seed: int, budget: dict[str, int], policy: str,
         eval_steps: Sequence[int], ev: dict[str, Any], job_dir: Path) -> str:
    """One run (``st.runner``), in this process or a worker, recorded as it ends."""
    from tasks.runtime import configure_threads

    configure_threads()
    r = st.runner(method, seed, {**st.base, **budget}, policy, job_dir, eval_steps,
                  start_accuracy=st.start, **ev)
    r.extra.update(st.notes)
    if st.matched:
        r.extra["budget"] = budget
    return str(save_run(st.records, st.signature, r))


def run_jobs(jobs: Sequence[tuple[str, str, int]], structures: dict[str, Structure], workers: int,
             policy: str, eval_steps: Sequence[int], ev: dict[str, Any]) -> None:
    """The jobs not yet recorded, on ``workers`` processes (several: each in
    ``<workdir>/job-<method>-s<seed>``, as a DuckDB file has one writer), each once its budget is
    known; a failed run is reported, and the runs waiting on it are left for a later invocation."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    pending = [(name, m, s) for name, m, s in jobs
               if load_run(structures[name].records, structures[name].signature, m, s) is None]

    def next_ready() -> tuple[tuple[str, str, int], tuple] | None:
        for job in pending:
            st = structures[job[0]]
            budget = _budget(st, job[1], job[2])
            if budget is not None:
                pending.remove(job)
                job_dir = st.workdir if workers <= 1 else st.workdir / f"job-{job[1]}-s{job[2]}"
                return job, (st, job[1], job[2], budget, policy, list(eval_steps), ev, job_dir)
        return None

    def done(job: tuple[str, str, int], get: Any) -> None:
        try:
            print(f"recorded {job[0]} {job[1]} seed {job[2]}: {get()}", flush=True)
        except Exception:  # noqa: BLE001 (one failed run must not lose the others)
            print(f"FAILED {job[0]} {job[1]} seed {job[2]}:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)

    if workers <= 1:
        while (ready := next_ready()) is not None:
            done(ready[0], lambda: _job(*ready[1]))
    else:
        ctx = multiprocessing.get_context("spawn")  # no forked torch / Prefect state
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            running: dict[Any, tuple[str, str, int]] = {}
            while True:
                while len(running) < workers and (ready := next_ready()) is not None:
                    running[pool.submit(_job, *ready[1])] = ready[0]
                if not running:
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in finished:
                    done(running.pop(f), f.result)
    if pending:
        print(f"not run (no recorded reference of their seed): {pending}", file=sys.stderr)


def load_structure(folder: Path) -> dict[int, dict[str, RunResult]]:
    """{seed: {method: run}} of every record in ``folder`` (one setting: else an error)."""
    out: dict[int, dict[str, RunResult]] = {}
    for r in recorded_runs(folder):
        out.setdefault(r.seed, {})[r.method] = r
    return out


def protocol_report(records: Path, final_of: int, args: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """The tokens protocol: the tables of both structures, the power statement and the closing
    line, from every complete seed recorded under ``records``."""
    finals: dict[str, dict[str, np.ndarray]] = {}
    tables: dict[str, list] = {}
    if args:
        print(f"\nfamily {args['family']}, mix {args['mix'] or args['difficulty']} (control: "
              f"d = {args['control_difficulty']}), {args['steps']} steps; reference {REFERENCE} "
              f"M = {args['root_budget']}, N = {args['multiplier']}; held-out {args['eval_items']} "
              f"items x {args['eval_samples']} samples, final = mean of the last {final_of} "
              f"evaluations; records {records}")
    for name in ("main", "control"):
        runs = load_structure(records / name)
        if not runs:
            continue
        methods = [m for m in (*TOKEN_METHODS, *sorted({m for rs in runs.values() for m in rs}))
                   if any(m in rs for rs in runs.values())]
        if args and args.get("methods"):  # a seed is complete with every method it should have
            wanted = [m.strip() for m in args["methods"].split(",") if m.strip()]
            methods = wanted if name == "main" else [m for m in CONTROL_METHODS if m in wanted]
        methods = list(dict.fromkeys(methods))
        required = [m for m in methods if m not in OPTIONAL]
        complete = {s: rs for s, rs in runs.items() if set(required) <= set(rs)}
        counts = ", ".join(f"{m} {sum(m in rs for rs in runs.values())}" for m in methods)
        print(f"\n{name}: {len(complete)} complete seed(s) {sorted(complete)}; runs recorded: {counts}")
        if not complete or "grpo" not in methods:
            continue
        logs = [{m: run_log(rs[m], final_of) for m in methods if m in rs} for rs in complete.values()]
        tables[name], finals[name] = structure_rows(name, logs, required, REFERENCE,
                                                    [m for m in methods if m in OPTIONAL])
    main = finals.get("main", {})
    out: dict[str, Any] = {"tables": tables, "finals": finals}
    if REFERENCE in main and len(main[REFERENCE]) >= 2:
        out.update(conclude(main, finals.get("control"), REFERENCE))
    else:
        print("\nno closing line: fewer than 2 complete seeds")
    return out


if __name__ == "__main__":
    from trace_rl.engines import entry_point

    entry_point(main)  # its engines stop with it (trace_rl.engines.lifecycle)
