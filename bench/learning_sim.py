"""A fast learning simulator for the mechanism: exact return and gradient of a tabular policy on a
model of the multi-hop chain family (``trace_rl.sim``), trained with the project's allocators,
trees, backup, advantages, calibration and posterior at ``TrainConfig``'s defaults; a seed takes
seconds where the tiny LM takes an hour. The protocol, the regimes and the report:
docs/results.md, "Learning simulator" (every seed also runs the negative control ``arith``).
Records: one JSON per (structure, method, seed); seeds already there are skipped.

    python -m bench.learning_sim --regime paper --seeds 0-39     # the chain family and the control
    python -m bench.learning_sim --regime default --seeds 0-39
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from bench import RECORDS, add_options
from bench.learning_report import conclude, structure_rows
from bench.learning_runs import parse_seeds
from trace_rl.config import TrainConfig
from trace_rl.sim.model import ChainParams
from trace_rl.sim.run import LOG_KEYS, PLUS, REFERENCE, SimSettings, methods, run_seed

REGIMES = {"default": {}, "paper": {"hops": "1:0.2,6:0.4,8:0.4", "hazard_a": 1.0, "hazard_b": 1.0}}
"""The chain family's generator per regime, over ``ChainParams``' defaults."""
DEFAULT_ROWS = (REFERENCE, "grpo", "dapo", "prompt_only", "trace", "oracle_pred", "cover_oracle")
"""The rows run unless ``--methods`` adds more."""
RESULTS = RECORDS / "learning_sim"


def write_records(root: Path, structure: str, seed: int, out: dict, meta: dict) -> None:
    """One compact JSON file per method: the settings and the per-step logs."""
    for name, log in out.items():
        path = root / structure / name / f"seed{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"meta": meta, "seed": seed, "acc0": round(log["acc0"], 6),
                **{k: [round(float(x), 6) for x in log[k]] for k in LOG_KEYS}}
        path.write_text(json.dumps(body, separators=(",", ":")) + "\n")


def load_records(root: Path, structure: str, names: Sequence[str], meta: dict | None = None
                 ) -> dict[int, dict]:
    """{seed: {method: log}} for every seed whose records hold all ``names``; a record written
    under other settings than ``meta`` (None: the first record's) is an error."""
    seeds: dict[int, dict] = {}
    for name in names:
        for path in sorted((root / structure / name).glob("seed*.json")):
            body = json.loads(path.read_text())
            meta = body["meta"] if meta is None else meta
            if body["meta"] != meta:
                raise ValueError(f"{path}: written with other settings {body['meta']}; "
                                 f"this run has {meta}")
            seeds.setdefault(body["seed"], {})[name] = body
    return {s: logs for s, logs in sorted(seeds.items()) if set(logs) >= set(names)}


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    given = {"hops": args.hops or None, "hazard_a": args.hazard_a, "hazard_b": args.hazard_b}
    params = ChainParams(**{**REGIMES[args.regime], **{k: v for k, v in given.items() if v is not None}},
                         alias_share=args.alias_share, cue_rate=args.cue_rate)
    control = ChainParams(structure="arith")
    settings = SimSettings(args.steps, args.pool_size, args.train_items, args.eval_items, args.learning_rate,
                           args.strength, TrainConfig(root_budget=args.root_budget))
    all_rows = methods([p for p in args.plus.split(",") if p])
    keep = set(DEFAULT_ROWS) | {m for m in args.methods.split(",") if m}
    unknown = keep - {m.name for m in all_rows}
    if unknown:
        raise ValueError(f"--methods: unknown {sorted(unknown)}; choose from {[m.name for m in all_rows]}")
    rows = [m for m in all_rows if m.name in keep]
    names = [m.name for m in rows]
    root = Path(args.records) if args.records else RESULTS / f"{args.regime}-{args.protocol}"
    meta = {"params": asdict(params), "steps": settings.steps, "pool": settings.pool_size,
            "train_items": settings.train_items, "eval_items": settings.eval_items,
            "lr": settings.learning_rate, "root_budget": args.root_budget, "protocol": args.protocol}
    structures = {"chain": (params, meta), "control": (control, {**meta, "params": asdict(control)})}
    start = time.time()
    for seed in parse_seeds(args.seeds, count=False):
        for structure, (p, m) in structures.items():
            if seed in load_records(root, structure, names, m):
                continue
            t0 = time.time()
            out = run_seed(seed, rows, p, settings, args.protocol)
            write_records(root, structure, seed, out, m)
            print(f"seed {seed} {structure}: {time.time() - t0:.0f} s", flush=True)
    cfg, wall = settings.train, time.time() - start
    print(f"regime {args.regime}: hops {params.hops}, hazard Beta({params.hazard_a}, "
          f"{params.hazard_b}), alias share {params.alias_share}, cue rate {params.cue_rate}; "
          f"{settings.train_items} train items, pool {settings.pool_size}, {settings.steps} steps, "
          f"{settings.eval_items} test items, lr {settings.learning_rate}; protocol "
          f"{args.protocol}; records {root}")
    print(f"reference {REFERENCE}: M = {cfg.root_budget}, N = {cfg.multiplier} "
          f"({cfg.root_budget * (1 + cfg.multiplier)} leaves/step); matched rows spend its "
          f"generated tokens per step; final accuracy = mean of the last 5 steps; "
          f"this invocation {wall:.0f} s")
    return report(root, names, {s: m for s, (_, m) in structures.items()})


def report(root: Path, names: Sequence[str], metas: dict[str, dict | None] | None = None) -> dict:
    """Both structures' tables over their complete seeds under ``root`` (of ``metas``' settings;
    None: of the one each holds), the power statement and the closing line (``conclude``)."""
    finals: dict[str, dict] = {}
    tables: dict[str, list] = {}
    for structure, meta in (metas or {"chain": None, "control": None}).items():
        logs = load_records(root, structure, names, meta)
        if not logs:
            print(f"{structure}: no complete seeds yet")
            return {}
        tables[structure], finals[structure] = structure_rows(
            f"{structure} (seeds {min(logs)}-{max(logs)})", list(logs.values()), list(names), REFERENCE)
    if len(finals["chain"][REFERENCE]) < 2:
        return {"tables": tables}
    return {"tables": tables, "finals": finals,
            **conclude(finals["chain"], finals.get("control"), REFERENCE)}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regime", choices=sorted(REGIMES), default="default",
                    help="the chain family's generator: default, or paper (GRPO mixes ~1/3 of its groups)")
    ap.add_argument("--protocol", choices=("tokens", "leaves"), default="tokens",
                    help="tokens: baselines matched to trace_cover's generated tokens per step; "
                         "leaves: equal leaves for everyone")
    regime = "(default: the regime's)"
    add_options(
        ap, ("--records", "", "records folder (default results/learning_sim/<regime>-<protocol>)"),
        ("--hops", "", f"hop-count distribution H:weight,... {regime}"),
        ("--hazard-a", float, f"Beta a of the per-item hazard rate {regime}"),
        ("--hazard-b", float, f"Beta b of the per-item hazard rate {regime}"),
        ("--alias-share", ChainParams.alias_share, "share of hazards that are aliases"),
        ("--cue-rate", ChainParams.cue_rate, "chance a hazard shows its text cue"),
        ("--pool-size", TrainConfig().pool_size, "candidate prompts per step"),
        ("--train-items", SimSettings.train_items, "train pool (recurs every train_items / pool_size steps)"),
        ("--eval-items", SimSettings.eval_items, "held-out test items"), ("--steps", SimSettings.steps, ""),
        ("--root-budget", TrainConfig().root_budget, "M: bare rollouts per step (leaves: M (1 + N))"),
        ("--seeds", "0-19", "paired seeds, e.g. 0-19"),
        ("--learning-rate", SimSettings.learning_rate, "Adam step size on the logits"),
        ("--strength", SimSettings.strength, "posterior prior weight k (pseudo-rollouts)"),
        ("--plus", "", f"TRACE+ candidates to run ({', '.join(m.name for m in PLUS)})"),
        ("--methods", "", f"more rows beside {', '.join(DEFAULT_ROWS)} (comma list, e.g. "
                          "cover_joint,joint_split,random_prefix)"))
    return ap


if __name__ == "__main__":
    main()
