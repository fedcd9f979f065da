"""A fast learning simulator for the mechanism: exact return and gradient of a tabular policy on a
model of the multi-hop chain family, trained with the project's own allocators, backup and
advantage estimators.

    python -m bench.learning_sim --structure chain --seeds 0-19
    python -m bench.learning_sim --structure arith --seeds 0-19      # negative control

Why: bench.learning trains the tiny LM, a few seeds an hour; a 3-point effect needs 20+ paired
seeds. Here a policy is 12 numbers, its expected return and gradient are exact (a dynamic
programme over a small state space), and everything else is the project's code:
``trace_core.allocators`` (every method's allocation), ``trace_core.tree`` (trees, backup),
``trace_core.advantages`` (the configured estimator, ``per_node`` for count_turns_once),
``trace_core.calibration`` (rho from the last steps' trees), ``trace_core.posterior`` (TRACE+),
``trace_core.stats`` (paired intervals). The run's knobs default to ``trace_rl.config.TrainConfig``
(budget, pool, group sizes, exploration, rho window, estimator).

The model (``--structure chain``). An item is an H-hop relation chain (H drawn from ``--hops``);
each hop carries a hazard with the item's rate h ~ Beta(``--hazard-a``, ``--hazard-b``): an alias
with probability ``--alias-share`` (recoverable: the verbatim query fails and a retry costs a turn)
or else a homonym (two near-duplicate names; taking the first match silently derails the chain when
the first match is the wrong copy, a hidden coin fixed in the item). Hazards are fixed in the item,
so they recur each time the prompt does. The turn cap is H + 3 (the answer takes a turn). Each turn
the policy picks one of three actions by a softmax over logits shared across items by turn type:

    plain   (a hop, no known hazard) correct query (advances; at an alias hop it fails and the
                                     next turn is a retry), sloppy query (no progress), answer now (r = 0)
    retry   (an alias query failed)  query the alias (advances), repeat verbatim (no progress), answer now
    homonym (two near-duplicates)    verify (advances), take the first match (advances, derails if
                                     the first match is the wrong copy), answer now
    answer  (all hops found)         answer (r = 1 unless derailed), search again, answer another entity

Transitions are deterministic given the item, so a prefix's state (hop, retry flag, derailed,
turn) fixes its exact value V(H) = P(r = 1 | H), which the oracle reads. Visible text cues (what the
learned predictor may read): H, and per item the count of shown alias cues (hyphenated names) and
shown homonym cues (near-duplicate names); each hazard shows its cue with probability
``--cue-rate`` and a hazard-free hop shows a false one with probability 0.1.

``--structure arith`` (negative control): every item is one homonym hop whose first match is wrong,
then the answer: the first turn decides the outcome and all prompts are alike, so there is nothing
for an allocator to target (the chain options are ignored).

A step, for every method on the same candidate pool (``--pool-size`` prompts of a
``--train-items`` train pool taken in shuffled epochs, so a prompt recurs every
train_items / pool_size steps): the method's allocator spends the leaf budget (M (1 + N) leaves,
M = root_budget), rollouts are sampled from the current policy (from the root or, for Stage 2, from
the stored prefix's state), each tree's advantages come from the configured estimator, and the
estimated gradient sum_paths sum_turns A * grad log pi(turn), averaged over the batch's turns (the
loss's token-mean with one cost per turn), takes one Adam step (AdamW as in the pipeline, no decay).

Reported per method (means over seeds; intervals paired over seeds, ``trace_core.stats``):
mixed groups per step (trees whose leaves hold a success and a failure), the cosine of the
estimated gradient with the exact gradient of the mean return over the train pool, generated
tokens per step (``TOKENS_PER_TURN`` per generated turn; a continuation generates only its new
turns; the prompt is read, not generated), and held-out accuracy = the exact expected return on
``--eval-items`` test items from the same generator, at equal leaves (after the last step) and at
equal generated tokens (each seed's curve of accuracy against cumulative tokens, read by linear
interpolation at the smallest total any method of the run reached).

Predictors: ``learned`` is a weighted logistic regression on the visible features of a history
(the cues above, and for a prefix its turn, hops found, the retry flag and how many first matches
were taken), fit after each step on the backed-up values of the last ``REPLAY_STEPS`` steps'
nodes (weights n_y), as ``HashedNgramPredictor`` is; like hashed n-grams it cannot learn an
item's hidden hazards. ``oracle`` is the exact V. ``constant`` predicts the last step's mean
reward everywhere. ``posterior`` scores roots by ``trace_core.posterior.PromptPosterior`` (counts
from each prompt's rollouts from the root, shrunk to the learned predictor's estimate) and
prefixes by the learned predictor.

Closing line: ``TRACE vs best baseline at equal tokens: <+-d> points (95% CI <lo>, <hi>) over <n>
seeds``, best baseline = the better of GRPO and prompt_only by mean accuracy at equal tokens, TRACE
= the better of faithful TRACE and TRACE+ (named on the line before).

Departures: a tabular policy stands in for the LM, and one action per turn for a turn's tokens;
the PPO clip is not modelled (one gradient step per batch, so every ratio is 1).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Sequence

import numpy as np

from bench.sim.model import INIT_PROBS, TOKENS_PER_TURN, ChainParams, dynamics, exact, make_items
from bench.sim.run import PLUS, Method, Run, SimSettings, methods
from trace_core.stats import paired_gain, verdict
from trace_rl.config import TrainConfig

# ----------------------------------------------------------------------------- a seed


def run_seed(seed: int, rows: list[Method], params: ChainParams, settings: SimSettings) -> dict:
    """Every method on one seed: same train pool, candidate order, test items and sampling seeds."""
    rng = np.random.default_rng([seed, 0])
    train = make_items(settings.train_items, params, rng, "train")
    test = make_items(settings.eval_items, params, rng, "test")
    dyn, dyn_test = dynamics(train), dynamics(test)
    order = np.concatenate([rng.permutation(train.size) for _ in range(
        settings.steps * settings.pool_size // train.size + 1)])
    acc0 = float(exact(dyn_test, np.log(INIT_PROBS), grad=False).start.mean())
    out = {}
    for method in rows:
        run = Run(method, settings, train, dyn)
        for step in range(settings.steps):
            pool_idx = order[step * settings.pool_size:(step + 1) * settings.pool_size]
            truth = exact(dyn, run.theta)
            trees, predicted = run.step(step, pool_idx, np.random.default_rng([seed, 1, step]), truth)
            run.learn(trees, predicted, step, truth.grad.mean(axis=0))
            run.log["accuracy"].append(float(exact(dyn_test, run.theta, grad=False).start.mean()))
        out[method.name] = {"acc0": acc0, **run.log}
    return out


def at_tokens(log: dict, budget: float) -> float:
    """Held-out accuracy when cumulative generated tokens reach ``budget`` (linear in between)."""
    tokens = np.concatenate([[0.0], np.cumsum(log["tokens"])])
    acc = np.concatenate([[log["acc0"]], log["accuracy"]])
    return float(np.interp(budget, tokens, acc))


def summarise(results: list[dict], rows: list[Method]) -> tuple[list[dict], dict]:
    names = [m.name for m in rows]
    budget = [min(float(np.sum(r[n]["tokens"])) for n in names) for r in results]  # per seed
    table = []
    per_seed = {}
    for n in names:
        leaves_acc = np.array([r[n]["accuracy"][-1] for r in results]) * 100
        tok_acc = np.array([at_tokens(r[n], b) for r, b in zip(results, budget)]) * 100
        per_seed[n] = {"leaves": leaves_acc, "tokens": tok_acc}
        table.append({
            "method": n,
            "mixed": float(np.mean([np.mean(r[n]["mixed"]) for r in results])),
            "active": float(np.mean([np.mean(r[n]["active"]) for r in results])),
            "cosine": float(np.mean([np.mean(r[n]["cosine"]) for r in results])),
            "tokens": float(np.mean([np.mean(r[n]["tokens"]) for r in results])),
            "acc_leaves": float(leaves_acc.mean()), "acc_tokens": float(tok_acc.mean()),
        })
    for row in table:
        for key in ("leaves", "tokens"):
            if len(results) >= 2:
                iv = paired_gain(per_seed["grpo"][key], per_seed[row["method"]][key])
                row[f"vs_grpo_{key}"] = (iv.mean, iv.low, iv.high)
    return table, per_seed


def parse_seeds(text: str) -> list[int]:
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError as exc:
        raise ValueError(f"--seeds {text!r}: expected '0-19' or '0,3,5-7'") from exc
    if not out or len(set(out)) != len(out):
        raise ValueError(f"--seeds {text!r}: need distinct seeds")
    return out


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    params = ChainParams(args.hops, args.hazard_a, args.hazard_b, args.alias_share, args.cue_rate,
                         args.structure)
    if args.root_budget < 2:
        raise ValueError(f"--root-budget {args.root_budget}: must be >= 2")
    settings = SimSettings(args.steps, args.pool_size, args.train_items, args.eval_items,
                           args.learning_rate, args.strength,
                           TrainConfig(root_budget=args.root_budget))
    seeds = parse_seeds(args.seeds)
    rows = methods([p for p in args.plus.split(",") if p])
    if args.methods:
        keep = set(args.methods.split(",")) | {"grpo", "prompt_only", "trace"}
        unknown = keep - {m.name for m in rows}
        if unknown:
            raise ValueError(f"--methods: unknown {sorted(unknown)}; choose from {[m.name for m in rows]}")
        rows = [m for m in rows if m.name in keep]
    start = time.time()
    results = [run_seed(s, rows, params, settings) for s in seeds]
    table, per_seed = summarise(results, rows)
    best, base, iv = _report(results, table, per_seed, rows, params, settings, seeds,
                             time.time() - start)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"seeds": seeds, "params": params.__dict__, "table": table,
                       "per_seed": {k: {kk: vv.tolist() for kk, vv in v.items()}
                                    for k, v in per_seed.items()}}, fh, indent=1)
    return {"table": table, "per_seed": per_seed, "best": best, "base": base, "gain": iv}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--structure", default="chain", help="chain, or arith (negative control)")
    ap.add_argument("--hops", default=ChainParams.hops, help="hop-count distribution H:weight,...")
    ap.add_argument("--hazard-a", type=float, default=ChainParams.hazard_a, help="Beta a of the per-item hazard rate")
    ap.add_argument("--hazard-b", type=float, default=ChainParams.hazard_b, help="Beta b of the per-item hazard rate")
    ap.add_argument("--alias-share", type=float, default=ChainParams.alias_share, help="share of hazards that are aliases")
    ap.add_argument("--cue-rate", type=float, default=ChainParams.cue_rate, help="chance a hazard shows its text cue")
    ap.add_argument("--pool-size", type=int, default=TrainConfig.model_fields["pool_size"].default, help="candidate prompts per step")
    ap.add_argument("--train-items", type=int, default=SimSettings.train_items, help="train pool (recurs every train_items / pool_size steps)")
    ap.add_argument("--eval-items", type=int, default=SimSettings.eval_items, help="held-out test items")
    ap.add_argument("--steps", type=int, default=SimSettings.steps)
    ap.add_argument("--root-budget", type=int, default=TrainConfig.model_fields["root_budget"].default,
                    help="M: bare rollouts per step (the leaf budget is M (1 + N))")
    ap.add_argument("--seeds", default="0-19", help="paired seeds, e.g. 0-19")
    ap.add_argument("--learning-rate", type=float, default=SimSettings.learning_rate, help="Adam step size on the logits")
    ap.add_argument("--strength", type=float, default=SimSettings.strength, help="posterior prior weight k (pseudo-rollouts)")
    ap.add_argument("--plus", default=",".join(m.name for m in PLUS), help="TRACE+ candidates to run")
    ap.add_argument("--methods", default="", help="run only these rows (comma list; grpo, "
                    "prompt_only and trace are always run, the closing line needs them)")
    ap.add_argument("--json", default="", help="write the per-seed figures here")
    return ap


def _report(results: list[dict], table: list[dict], per_seed: dict, rows: list[Method],
            params: ChainParams, settings: SimSettings, seeds: list[int], wall: float) -> tuple:
    """Print the settings, the table and the closing lines; (best TRACE row, best baseline,
    its paired gain at equal tokens or None with one seed)."""
    cfg = settings.train
    print(f"structure {params.structure}; hops {params.hops}, hazard Beta({params.hazard_a}, "
          f"{params.hazard_b}), alias share {params.alias_share}, cue rate {params.cue_rate}; "
          f"{settings.train_items} train items, pool {settings.pool_size}, {settings.steps} steps, "
          f"{len(seeds)} seeds, {settings.eval_items} test items")
    print(f"budget {cfg.root_budget * (1 + cfg.multiplier)} leaves/step (M = {cfg.root_budget}, "
          f"N = {cfg.multiplier}), {TOKENS_PER_TURN} tokens per generated turn, estimator "
          f"{cfg.advantage}; start accuracy {100 * results[0]['grpo']['acc0']:.1f}")
    print(f"{'method':<20}{'mixed/step':>11}{'prompts':>8}{'cos':>6}{'tok/step':>9}"
          f"{'acc@leaves':>11}{'acc@tokens':>11}   {'vs GRPO @tokens (95% CI)':<26}")
    for row in table:
        d = row.get("vs_grpo_tokens")
        ci = f"{d[0]:+5.1f} ({d[1]:+.1f}, {d[2]:+.1f})" if d else ""
        print(f"{row['method']:<20}{row['mixed']:>11.2f}{row['active']:>8.1f}{row['cosine']:>6.2f}"
              f"{row['tokens']:>9.0f}{row['acc_leaves']:>11.1f}{row['acc_tokens']:>11.1f}   {ci}")
    means = {r["method"]: r["acc_tokens"] for r in table}
    base = max(("grpo", "prompt_only"), key=lambda n: means[n])
    contenders = ["trace"] + [m.name for m in rows if m.role == "plus"]
    best = max(contenders, key=lambda n: means[n])
    iv = paired_gain(per_seed[base]["tokens"], per_seed[best]["tokens"]) if len(seeds) >= 2 else None
    faithful = (paired_gain(per_seed[base]["tokens"], per_seed["trace"]["tokens"])
                if len(seeds) >= 2 else None)
    print(f"wall time {wall:.0f} s; best baseline {base}; TRACE = {best}"
          + (" (faithful)" if best == "trace" else " (TRACE+)")
          + (f"; faithful TRACE vs {base}: {faithful.mean:+.1f} ({faithful.low:+.1f}, "
             f"{faithful.high:+.1f}), {verdict(faithful.mean, faithful.low, faithful.high)}"
             if faithful else ""))
    if iv is not None:
        print(f"TRACE vs best baseline at equal tokens: {iv.mean:+.1f} points (95% CI "
              f"{iv.low:+.1f}, {iv.high:+.1f}) over {len(seeds)} seeds")
    return best, base, iv


if __name__ == "__main__":
    main()
