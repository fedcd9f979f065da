"""This project against TRL's ``GRPOTrainer`` (docs/results.md, "Against TRL": the shared
settings and what is reported): ``trl_grpo`` (TRL at its defaults, on the multi-turn task through
its ``rollout_func``: ``trace_rl.integrations.trl``), ``grpo`` (the train flow with ``allocator=grpo``) and
``trace`` (the default allocator), from the same bootstrapped tiny policy and held-out items.

    python -m bench.peers                  # 3 seeds (about 40 min on 2 loaded cores)
    python -m bench.peers --quick          # one seed, two steps (the test)

Each (method, seed) is recorded when its run ends, and the same command skips what is recorded; a
TRL run that was stopped (killed, or its session ended) goes on from its last RL step (``run_trl``).

Needs TRL: ``pip install -e .[peers] -c requirements/cpu-constraints.txt``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from bench import RECORDS, add_options, markdown
from bench.learning import (Structure, _policy_and_base, _start_accuracy, invocation, quick, run_jobs,
                            run_options)
from bench.learning_report import (accuracy_at, final_accuracy, paired_tests, reach_ratio, run_log,
                                   token_budget, tokens_to_reach)
from bench.learning_runs import RunResult, _eval, check_signatures, eval_plan, parse_seeds, run_one, signature

METHODS = ("trl_grpo", "grpo", "trace")
RESUME = "bench_peers_state.json"  # beside each TRL checkpoint: what run_trl needs to go on


def run_trl(seed: int, base: dict[str, Any], policy: str, workdir: Path, eval_steps: Sequence[int],
            start_accuracy: float, **ev: Any) -> RunResult:
    """One seed of TRL's ``GRPOTrainer`` on the family (``trace_rl.integrations.trl``), its
    checkpoints at ``eval_steps`` evaluated exactly as ``run_one`` evaluates the train flow's.

    Resumable: after every RL step TRL saves a checkpoint (weights, optimiser, RNG) and this run's
    own state beside it (``RESUME``: the wall so far, each step's time and tokens, the rollout
    counters, the evaluation checkpoints); a run started again on the same settings goes on from
    the newest such checkpoint, sampling as the uninterrupted run would (on BFCL a TRL seed takes
    about three hours, longer than a working session). Seconds spent saving are not counted, nor
    the work lost after the last checkpoint; each resumption's set-up is, and ``extra["resumed"]``
    says how many there were."""
    import torch
    from transformers import TrainerCallback

    from tasks import runtime
    from trace_rl.config import config_from_mapping
    from trace_rl.engines.lifecycle import close_all
    from trace_rl.integrations.trl import Rollouts, grpo_trainer

    # TRL samples on its own weights for hours: the engines the start's evaluation and earlier
    # runs left warm would sit idle beside it (~3 GB each with vLLM; two TRL seeds beside theirs
    # outgrew 24 GiB, and the kernel killed one). The evaluations after training start one again.
    close_all()
    method = "trl_grpo"
    config = {**base, "allocator": "grpo", "seed": seed, "policy": policy,
              "run_name": f"peers-{method}-s{seed}"}
    cfg = config_from_mapping(config, "bench.peers")
    out_dir = workdir / f"{method}-s{seed}"
    key = f"{cfg.config_hash}@{','.join(map(str, eval_steps))}"  # the run id's hash: same computation
    checkpoint, kept = _resumable(out_dir, key)
    t0 = time.perf_counter() - kept.get("wall", 0.0)
    rollouts = Rollouts(cfg, policy, runtime.env_for(cfg), runtime.items_for(cfg, cfg.train_split, policy),
                        seed)
    if kept:
        rollouts.restore(kept["rollouts"])
    iters, batch = cfg.ppo_epochs, cfg.leaf_budget
    saved: dict[int, str] = {int(k): v for k, v in kept.get("saved", {}).items()}
    at_step: list[dict[str, float]] = kept.get("at_step", [])
    resumed = kept.get("resumed", -1) + 1
    aside = [0.0]  # seconds spent saving checkpoints (for the evaluation, to resume): not TRL's work
    pending = [0.0]

    class _Steps(TrainerCallback):
        def on_step_end(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            pending[0] = time.perf_counter()
            if state.global_step % iters:
                return
            step = state.global_step // iters - 1
            at_step.append({"t": time.perf_counter() - t0 - aside[0],
                            "tokens": float(rollouts.generated_tokens),
                            "threads": torch.get_num_threads()})
            if step in eval_steps:
                path = out_dir / f"step-{step}"
                trainer.model.save_pretrained(path)
                trainer.processing_class.save_pretrained(path)
                saved[step] = str(path)
            aside[0] += time.perf_counter() - pending[0]
            pending[0] = time.perf_counter()

        def on_save(self, targs: Any, state: Any, control: Any, **kw: Any) -> None:
            aside[0] += time.perf_counter() - pending[0]
            own = {"key": key, "global_step": state.global_step, "resumed": resumed,
                   "wall": time.perf_counter() - t0 - aside[0], "at_step": at_step,
                   "saved": saved, "rollouts": rollouts.counters()}
            path = out_dir / f"checkpoint-{state.global_step}" / RESUME
            path.with_suffix(".tmp").write_text(json.dumps(own))
            path.with_suffix(".tmp").replace(path)  # a checkpoint without it is not resumed from

    trainer = grpo_trainer(cfg, policy, rollouts, out_dir, callbacks=[_Steps()], save_every=iters)
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    wall = time.perf_counter() - t0 - aside[0]
    if len(at_step) != cfg.steps:
        raise RuntimeError(f"TRL ran {len(at_step)} RL steps, expected {cfg.steps}")
    history = [h for h in trainer.state.log_history if "loss" in h or "reward" in h]
    acc = [start_accuracy] + [_eval(config, saved[s], **ev) for s in eval_steps]
    for done in out_dir.glob("checkpoint-*"):  # evaluated: the weights it used stay under step-*
        shutil.rmtree(done, ignore_errors=True)
    steps_t = np.diff([0.0] + [a["t"] for a in at_step])
    return RunResult(method=method, seed=seed, eval_steps=[-1, *eval_steps], accuracy=acc,
                     effective_ratio=[], leaves=[float(batch)] * cfg.steps,
                     generated_tokens=float(rollouts.generated_tokens), tool_calls=float("nan"),
                     wall_s=wall,
                     extra={"step_s": [float(x) for x in steps_t],
                            "eval_wall_s": [0.0, *(at_step[s]["t"] for s in eval_steps)],
                            "rollout_s": rollouts.rollout_s,
                            "reward_mismatches": rollouts.reward_mismatches,
                            "torch_threads": max(a["threads"] for a in at_step), "trl_log": history[-3:],
                            "resumed": resumed},
                     eval_tokens=[0.0, *(at_step[s]["tokens"] for s in eval_steps)])


def _resumable(out_dir: Path, key: str) -> tuple[Path | None, dict[str, Any]]:
    """The newest TRL checkpoint under ``out_dir`` that holds this run's state (same settings:
    ``key``), and that state; ``(None, {})`` where there is none (a new run)."""
    for ckpt in sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]),
                       reverse=True):
        f = ckpt / RESUME
        if f.exists() and (own := json.loads(f.read_text())).get("key") == key:
            return ckpt, own
    return None, {}


def run_peer(method: str, seed: int, base: dict[str, Any], policy: str, workdir: Path,
             eval_steps: Sequence[int], **ev: Any) -> RunResult:
    """``run_trl``, else ``bench.learning_runs.run_one`` with the wall time at each evaluation (the
    flow's set-up, its wall less its steps' seconds, counted before the first step)."""
    if method == "trl_grpo":
        return run_trl(seed, base, policy, workdir, eval_steps, **ev)
    r = run_one(method, seed, base, policy, workdir, eval_steps, **ev)
    step_s = [float(x) for x in r.extra["per_step"]["time/step_s"]]
    setup = max(0.0, r.wall_s - float(np.nansum(step_s)))
    cum = setup + np.cumsum(np.nan_to_num(step_s))
    r.extra.update(step_s=step_s, eval_wall_s=[0.0, *(float(cum[s]) for s in eval_steps)])
    return r


def _warm_prefect() -> float:
    """Start this process's Prefect server with a no-op flow, so that the one-time start is not
    charged to the first timed run; its seconds."""
    from prefect import flow

    @flow(name="peers-warm-up")
    def warm_up() -> int:
        return 0

    t0 = time.perf_counter()
    warm_up()
    return time.perf_counter() - t0


def summarise(results: list[RunResult], steps: int) -> dict[str, dict[str, Any]]:
    budget = token_budget(results)
    wall_budget = min(r.extra["eval_wall_s"][-1] for r in results)
    table: dict[str, dict[str, Any]] = {}
    for m in dict.fromkeys(r.method for r in results):
        rs = [r for r in results if r.method == m]
        table[m] = {"seeds": [r.seed for r in rs],
                    "final": [r.accuracy[-1] for r in rs],
                    "at_tokens": [accuracy_at(r, budget) for r in rs],
                    "at_wall": [accuracy_at(r, wall_budget, "eval_wall_s") for r in rs],
                    "tokens": [r.generated_tokens for r in rs],
                    "wall_per_step": [r.wall_s / steps for r in rs],
                    "tokens_per_s": [r.generated_tokens / r.wall_s for r in rs]}
    return {"budget_tokens": budget, "budget_wall_s": wall_budget, "methods": table}


def parity(results: list[RunResult], ours: str = "grpo", ref: str = "trl_grpo") -> dict[str, Any]:
    """``ours`` minus ``ref`` in points at equal generated tokens (``budget_tokens``: the smaller
    total of the two), per seed both ran (``bench.learning_report.paired_tests``)."""
    pair = [r for r in results if r.method in (ours, ref)]
    return {**paired_tests(pair, method=ours)[ref], "budget_tokens": token_budget(pair)}


def _ratio(table: dict[str, Any], ours: str, ref: str, key: str) -> float:
    """Geometric mean over paired seeds of ours / ref."""
    a = dict(zip(table[ours]["seeds"], table[ours][key]))
    b = dict(zip(table[ref]["seeds"], table[ref][key]))
    r = [a[s] / b[s] for s in sorted(set(a) & set(b))]
    return float(np.exp(np.mean(np.log(r)))) if r else float("nan")


def ms(values: Sequence[float], scale: float = 1.0) -> str:
    """Mean ± sample SD over seeds (finite values only), as the tables print it."""
    v = np.asarray(values, dtype=float) * scale
    v = v[np.isfinite(v)]
    return (f"{v.mean():.1f} ± {v.std(ddof=1):.1f}" if v.size > 1 else f"{v.mean():.1f}") if v.size else "n/a"


def summary_table(s: dict[str, Any]) -> str:
    """``summarise``'s table as docs/results.md shows it (``bench.tables``)."""
    head = ["method", "final %", f"at {s['budget_tokens'] / 1000:.1f}k tokens %",
            f"at {s['budget_wall_s']:.0f} s %", "gen. tokens", "wall s/step", "tokens/s"]
    return markdown(head, [[m, ms(row["final"], 100), ms(row["at_tokens"], 100),
                            ms(row["at_wall"], 100), f"{np.mean(row['tokens']):.0f}",
                            ms(row["wall_per_step"]), ms(row["tokens_per_s"])]
                           for m, row in s["methods"].items()])


def closing(results: list[RunResult], table: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The closing line (this project's GRPO against TRL's) and its figures."""
    p = parity(results)
    g = p["gain"]
    wall, rate = (_ratio(table, "grpo", "trl_grpo", k) for k in ("wall_per_step", "tokens_per_s"))
    return (f"vs TRL GRPOTrainer: wall per step {wall:.2f}x, tokens/s {rate:.2f}x, GRPO parity "
            f"{g.mean:+.1f} points (95% CI {g.low:+.1f}, {g.high:+.1f})",
            {"parity": p, "wall_ratio": wall, "rate_ratio": rate})


def against_trl(results: list[RunResult], table: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Each method other than the two GRPOs against TRL's: its difference at equal tokens and its
    tokens to TRL's final accuracy (per seed, over TRL's own first crossing of it), as lines and
    figures; nothing without both GRPOs."""
    lines: list[str] = []
    out: dict[str, Any] = {}
    if "grpo" not in table or "trl_grpo" not in table:
        return lines, out
    ref = {r.seed: r for r in results if r.method == "trl_grpo"}
    for other in [m for m in table if m not in ("grpo", "trl_grpo")]:
        q = out[f"parity_{other}"] = parity(results, other, "trl_grpo")
        lines.append(f"{other} minus trl_grpo at equal tokens: {q['gain'].mean:+.1f} points "
                     f"(95% CI {q['gain'].low:+.1f}, {q['gain'].high:+.1f}; seeds {q['seeds']})")
        runs = [r for r in results if r.method == other and r.seed in ref]
        mine, trl = [run_log(r, final_of=1) for r in runs], [run_log(ref[r.seed], final_of=1) for r in runs]
        out[f"tokens_to_trl_final_{other}"] = [tokens_to_reach(lg, final_accuracy(t))
                                               for lg, t in zip(mine, trl)]
        if mine:
            ratio, lo, hi, never = reach_ratio(mine, trl)
            x = [f"{v:.2f}x" if np.isfinite(v) else "never" for v in (ratio, lo, hi)]
            lines.append(f"{other} tokens to trl_grpo's final / trl_grpo's: median {x[0]} (95% CI "
                         f"{x[1]}, {x[2]}; {never} of {len(mine)} seeds never reach it)")
            out[f"reach_ratio_{other}"] = {"median": ratio, "lo": lo, "hi": hi, "never": never}
    return lines, out


def report(results: list[RunResult], steps: int, start: float) -> dict[str, Any]:
    s = summarise(results, steps)
    t = s["methods"]
    print(f"start accuracy {100 * start:.1f}%; mean ± SD over seeds\n{summary_table(s)}")
    if "grpo" not in t or "trl_grpo" not in t:
        return {"summary": s}
    lines, out = against_trl(results, t)
    print("\n".join(lines))
    line, figures = closing(results, t)
    print(line)
    return {"summary": s, **out, **figures}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_options(ap)  # bench.learning's: the family, policy, seeds, steps, leaves, evaluation
    ap.set_defaults(steps=10, eval_items=100, eval_samples=2, multiplier=1, workdir="bench_runs/peers")
    add_options(ap, ("--methods", ",".join(METHODS), "of trl_grpo, grpo, trace"),
                ("--group-size", 4, "rollouts per prompt (grpo, TRL: M (1 + N) / group-size prompts a step)"),
                ("--records", "", "records folder (default results/peers, with --policy "
                                  "results/peers_<family>; with --quick <workdir>/records)"))
    return ap


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    try:
        from trl import __version__ as version
    except ImportError:
        raise SystemExit("bench.peers needs TRL (not installed): pip install -e .[peers] "
                         "-c requirements/cpu-constraints.txt") from None
    args = _parser().parse_args(argv)
    quick(args, root_budget=8, multiplier=1)
    workdir = Path(args.workdir)
    results = Path(args.records or (workdir / "records" if args.quick else
                                    RECORDS / (f"peers_{args.family}" if args.policy else "peers")))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if set(methods) - set(METHODS):
        raise SystemExit(f"--methods: unknown {sorted(set(methods) - set(METHODS))}; of {METHODS}")
    seeds = parse_seeds(args.seeds or "3")
    policy, base, skip = _policy_and_base(args, workdir)
    base["group_size"] = args.group_size
    eval_steps, ev = eval_plan(args, skip)
    sig = signature({**base, "bench": "peers"}, eval_steps, ev, policy)
    check_signatures(results, sig)
    start = _start_accuracy(base, policy, workdir, sig, ev, results)
    meta = {"trl": version, "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
            "settings": invocation(args, policy)}
    st = Structure("peers", base, sig, start, workdir, results, tuple(methods), matched=False,
                   runner=run_peer, notes=meta)
    warm_s = _warm_prefect() if any(m in ("grpo", "trace") for m in methods) else 0.0
    t_all = time.perf_counter()
    # one run at a time (the timings are the benchmark), each seed's order rotated: load drifts
    run_jobs([("peers", m, s) for i, s in enumerate(seeds)
              for m in methods[i % len(methods):] + methods[:i % len(methods)]],
             {"peers": st}, 1, policy, eval_steps, ev)
    print(f"bench.peers: {args.family} d={args.difficulty}, {args.steps} steps x "
          f"{base['root_budget'] * (1 + base['multiplier'])} rollouts (group {args.group_size}), "
          f"{args.eval_items} held-out items x {args.eval_samples}; seeds {seeds}; TRL {version}; "
          f"{meta['machine']}; this invocation {time.perf_counter() - t_all:.0f} s (Prefect's "
          f"one-time start {warm_s:.0f} s not counted)")
    return report(st.recorded(), args.steps, start)


if __name__ == "__main__":
    from trace_rl.engines import entry_point

    entry_point(main)
