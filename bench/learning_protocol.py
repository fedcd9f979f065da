"""The learning benchmark under the learning protocol (``bench.learning --protocol tokens``, and
``--regime paper``): the simulator's protocol (``bench.learning_sim``) on the tiny LM.

* **Equal generated tokens per step, equal optimiser steps.** The reference, ``trace_cover``, runs
  first at the leaf budget M (1 + N); each flat baseline (grpo, dapo, prompt_only) of the same
  seed then runs the same number of steps with whole groups (``group_size`` prompts' worth for
  grpo and dapo, pairs for prompt_only) sized so that its generated tokens per step match the
  reference's (``matched_leaves``: the reference's mean generated tokens per step over its mean
  tokens per bare rollout, a full rollout of the same policy family; DAPO stops early once its
  batch holds enough mixed groups, so it may spend less). Tree rows (``trace``, ``cover_oracle``)
  keep the leaf budget; every table shows each method's achieved tokens per step.
* **A negative control in the same invocation**: every method of ``CONTROL_METHODS`` on the same
  family at one constant difficulty (``--control-difficulty``, no mix) from the same policy; its
  closing difference must come out near zero.
* **Report** (``bench.protocol_report``, shared with the simulator): per method, mixed prompts per
  step (a count), the effective ratio, prompts per step, generated and training tokens per step,
  leaves, the final held-out accuracy (mean of the last ``--final-of`` evaluations), its paired
  difference from GRPO, and the generated tokens it needs to reach GRPO's final accuracy as a
  ratio to GRPO's (median over seeds, bootstrap interval); then the power statement and the
  closing line ``TRACE-cover vs best baseline at equal tokens and steps: ...; control ...``.

Records: one compact JSON per (structure, method, seed) under ``--records``
(``<records>/<main|control>/runs/<method>-s<seed>.json``), written as each run ends, so that seeds
accumulate across invocations: a later invocation runs only what is missing and reports on every
seed the folder holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench import RECORDS
from bench.learning_runs import (RunResult, check_signatures, eval_plan, load_run, run_one, run_record,
                                 save_run, signature)
from bench.protocol_report import conclude, print_table, rows_of, run_log

REFERENCE = "trace_cover"
"""The row whose generated tokens per step the matched baselines spend."""
MATCHED = {"grpo": 0, "dapo": 0, "prompt_only": 2}
"""The flat baselines sized to the reference's tokens, and their group (0: ``group_size``)."""
METHODS = (REFERENCE, "grpo", "dapo", "prompt_only", "trace", "cover_oracle")
CONTROL_METHODS = (REFERENCE, "grpo", "dapo", "prompt_only")
"""The control needs the reference and the baselines the closing line's best is taken from."""
RESULTS = RECORDS / "learning_lm"

REGIMES: dict[str, dict[str, Any]] = {
    "paper": {"family": "synth_arith", "policy_difficulty": 1, "difficulty": 2, "mix": "1,2,2",
              "control_difficulty": 1, "protocol": "tokens", "steps": 20, "eval_every": 5,
              "eval_items": 300, "eval_samples": 2, "final_of": 2,
              "methods": "trace_cover,grpo,dapo,prompt_only,trace"},
}
"""``--regime``: defaults for the command line (explicit options override them). ``paper``: the
default run's bootstrapped tiny policy (synth_arith, d = 1) trained on a pool of one d = 1 item to
two d = 2 items, where sampling four rollouts of each prompt from the start mixes ~1/3 of the
groups (the starting policy solves 51% of d = 1 items, 82% of their 4-groups mixed, and 3.6% of
d = 2 items, 12.5% mixed), as the paper's GRPO mixes 0.27-0.35; control: all items at d = 1.
synth_arith has no oracle (``Environment.oracle_success``), so ``cover_oracle`` is not among its
methods; on a family with one (synth_chain) ``--methods`` adds it."""


def matched_leaves(tokens_per_step: float, tokens_per_leaf: float, group: int) -> int:
    """Leaves per step of a flat baseline whose generated tokens per step match
    ``tokens_per_step`` when each leaf (a full rollout) generates ``tokens_per_leaf``: whole
    groups of ``group``, at least one."""
    if not (tokens_per_step > 0 and tokens_per_leaf > 0 and group >= 1):
        raise ValueError(f"matched_leaves: need positive tokens ({tokens_per_step}, "
                         f"{tokens_per_leaf}) and a group >= 1 ({group})")
    return group * max(1, round(tokens_per_step / (group * tokens_per_leaf)))


def matched_budget(reference: RunResult, method: str, group_size: int) -> dict[str, int]:
    """The config fields that give flat ``method`` the reference run's generated tokens per step:
    its mean over the run, over the reference's mean tokens per bare rollout (every bare rollout
    is a full rollout from the root, what a flat method's leaf is)."""
    steps = reference.extra["steps"]
    per_step = float(np.mean(steps["tokens"]))
    per_leaf = float(np.sum(steps["bare_tokens"]) / max(np.sum(steps["bare"]), 1.0))
    leaves = matched_leaves(per_step, per_leaf, MATCHED[method] or group_size)
    return {"root_budget": leaves, "multiplier": 0}


@dataclass
class Structure:
    """One family configuration of the invocation: the main one or the control."""

    name: str
    base: dict[str, Any]
    signature: str
    start: float
    workdir: Path
    records: Path
    methods: tuple[str, ...]


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line, with ``--regime``'s defaults under the explicit options."""
    known, _ = parser.parse_known_args(argv)
    if known.regime:
        parser.set_defaults(**REGIMES[known.regime])
    return parser.parse_args(argv)


def run(args: argparse.Namespace, policy_and_base: Any, start_accuracy: Any) -> dict[str, Any]:
    """Every missing (structure, method, seed) run, each recorded as it ends, then the report.
    ``policy_and_base(args, workdir)`` and ``start_accuracy(...)`` are bench.learning's."""
    from bench.learning_runs import parse_seeds

    workdir = Path(args.workdir)
    records = records_folder(args)
    seeds = parse_seeds(args.seeds or "3", args.seed_start)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip()) \
        if args.methods else METHODS
    if REFERENCE not in methods:
        raise SystemExit(f"--protocol tokens: the methods must include the reference {REFERENCE}")
    policy, base, skip = policy_and_base(args, workdir)
    eval_steps, ev = eval_plan(args, skip)
    control_args = argparse.Namespace(**{**vars(args), "policy": policy, "mix": "",
                                         "difficulty": args.control_difficulty})
    _, control_base, _ = policy_and_base(control_args, workdir)
    structures = {}
    for name, b, ms in (("main", base, methods),
                        ("control", control_base, tuple(m for m in CONTROL_METHODS if m in methods))):
        sig = signature(b, eval_steps, ev, policy)
        wd = workdir / name
        structures[name] = Structure(name, b, sig, start_accuracy(
            b, policy, wd, sig, args.eval_items, skip, args.eval_samples, args.eval_temperature),
            wd, records / name, ms)
    jobs = job_order(seeds, {name: st.methods for name, st in structures.items()})
    for st in structures.values():  # records of other settings are not silently mixed in
        check_signatures(st.records, st.signature)
    jobs = [j for j in jobs if load_run(structures[j[0]].records, structures[j[0]].signature,
                                        j[1], j[2]) is None]
    run_jobs(jobs, structures, args.jobs, policy, eval_steps, ev)
    return report(records, args.final_of, vars(args))


def job_order(seeds: Sequence[int], methods: dict[str, Sequence[str]]) -> list[tuple[str, str, int]]:
    """(structure, method, seed) in the order runs start: seed by seed, the references of every
    structure first, then the matched baselines (which wait for them), then the other rows, so
    that paired seeds of the closing line complete as early as they can."""
    rank = lambda m: 0 if m == REFERENCE else 1 if m in MATCHED else 2  # noqa: E731
    return [(name, m, s) for s in seeds for r in (0, 1, 2) for name, ms in methods.items()
            for m in ms if rank(m) == r]


def records_folder(args: argparse.Namespace) -> Path:
    if args.records:
        return Path(args.records)
    return RESULTS / args.regime if args.regime else Path(args.workdir) / "records"


def _budget(st: Structure, method: str, seed: int) -> dict[str, int] | None:
    """The run's budget fields: the leaf budget (none) or, for a matched baseline, its size from
    the reference of the same seed; None while that reference is not recorded."""
    if method not in MATCHED:
        return {}
    ref = load_run(st.records, st.signature, REFERENCE, seed)
    if ref is None:
        return None
    from trace_rl.config import TrainConfig

    return matched_budget(ref, method, st.base.get("group_size", TrainConfig().group_size))


def _job(st: Structure, method: str, seed: int, budget: dict[str, int], policy: str,
         eval_steps: Sequence[int], ev: dict[str, Any]) -> str:
    """One run, in this process or a worker, recorded as it ends. It keeps only the evaluated
    checkpoints (``keep_checkpoints`` 1 with ``checkpoint_every`` = the evaluation interval: 13 MB
    a step for the tiny policy; not in the run id or the signature). None is deleted after the
    record: the worker's evaluation engine was made from the first checkpoint it evaluated and
    reloads weights into it."""
    from tasks.runtime import configure_threads

    configure_threads()
    job_dir = st.workdir / f"job-{method}-s{seed}"
    r = run_one(method, seed, {**st.base, **budget, "keep_checkpoints": 1}, policy, job_dir,
                eval_steps, start_accuracy=st.start, **ev)
    r.extra["budget"] = budget
    return str(save_run(st.records, st.signature, r, compact=True))


def run_jobs(jobs: Sequence[tuple[str, str, int]], structures: dict[str, Structure], workers: int,
             policy: str, eval_steps: Sequence[int], ev: dict[str, Any]) -> None:
    """The runs on ``workers`` processes (one in this process), each started once its budget is
    known (a matched baseline after its seed's reference). A failed run is reported and the runs
    waiting on it are left for a later invocation."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    pending = list(jobs)

    def next_ready() -> tuple[tuple[str, str, int], dict[str, int]] | None:
        for job in pending:
            budget = _budget(structures[job[0]], job[1], job[2])
            if budget is not None:
                pending.remove(job)
                return job, budget
        return None

    def done(job: tuple[str, str, int], get: Any) -> None:
        try:
            print(f"recorded {job[0]} {job[1]} seed {job[2]}: {get()}", flush=True)
        except Exception:  # noqa: BLE001 (one failed run must not lose the others)
            print(f"FAILED {job[0]} {job[1]} seed {job[2]}:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)

    if workers <= 1:
        while (ready := next_ready()) is not None:
            (name, method, seed), budget = ready
            done(ready[0], lambda: _job(structures[name], method, seed, budget, policy,
                                        eval_steps, ev))
    else:
        ctx = multiprocessing.get_context("spawn")  # no forked torch / Prefect state
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            running: dict[Any, tuple[str, str, int]] = {}
            while True:
                while len(running) < workers and (ready := next_ready()) is not None:
                    (name, method, seed), budget = ready
                    running[pool.submit(_job, structures[name], method, seed, budget, policy,
                                        list(eval_steps), ev)] = ready[0]
                if not running:
                    break
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in finished:
                    done(running.pop(f), f.result)
    if pending:
        print(f"not run (no recorded reference of their seed): {pending}", file=sys.stderr)


def load_structure(folder: Path) -> dict[int, dict[str, RunResult]]:
    """{seed: {method: run}} of every record in ``folder`` (one signature: else an error)."""
    out: dict[int, dict[str, RunResult]] = {}
    sigs = set()
    for path in sorted((folder / "runs").glob("*.json")):
        data = json.loads(path.read_text())
        sigs.add(data["signature"])
        r = RunResult(**data["result"])
        out.setdefault(r.seed, {})[r.method] = r
    if len(sigs) > 1:
        raise ValueError(f"{folder}: records of {len(sigs)} settings; keep one per folder")
    return dict(sorted(out.items()))


def report(records: Path, final_of: int, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tables of both structures, the power statement and the closing line, from every
    complete seed recorded under ``records``."""
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
        methods = [m for m in (*METHODS, *sorted({m for rs in runs.values() for m in rs}))
                   if any(m in rs for rs in runs.values())]
        if args and args.get("methods"):  # a seed is complete with every method it should have
            wanted = [m.strip() for m in args["methods"].split(",") if m.strip()]
            methods = wanted if name == "main" else [m for m in CONTROL_METHODS if m in wanted]
        methods = list(dict.fromkeys(methods))
        complete = {s: rs for s, rs in runs.items() if set(methods) <= set(rs)}
        counts = ", ".join(f"{m} {sum(m in rs for rs in runs.values())}" for m in methods)
        print(f"\n{name}: {len(complete)} complete seed(s) {sorted(complete)}; runs recorded: {counts}")
        if not complete or "grpo" not in methods:
            continue
        logs = [{m: run_log(rs[m], final_of) for m in methods} for rs in complete.values()]
        table, per_seed = rows_of(logs, methods)
        finals[name], tables[name] = per_seed, table
        first = next(iter(complete.values()))["grpo"].accuracy[0]
        grpo = next(r for r in table if r["method"] == "grpo")
        ref_tokens = next(r["tokens"] for r in table if r["method"] == REFERENCE)
        print(f"start accuracy {100 * first:.1f}; GRPO's effective ratio over its first 5 steps "
              f"{grpo['ratio_start']:.2f}; generated tokens per step / {REFERENCE}'s: " +
              ", ".join(f"{r['method']} {r['tokens'] / ref_tokens:.2f}" for r in table))
        print_table(table)
    main = finals.get("main", {})
    out: dict[str, Any] = {"tables": tables, "finals": finals}
    if REFERENCE in main and len(main[REFERENCE]) >= 2:
        out.update(conclude(main, finals.get("control"), REFERENCE, beside=("trace", "cover_oracle")))
    else:
        print("\nno closing line: fewer than 2 complete seeds")
    return out
