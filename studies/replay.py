"""Replay validation: ``trace_core.replay`` on simulated runs against the simulator's exact
process (the figure and numbers in docs/viewer.md, "Validation on the simulator"; the same check as
tests/test_replay.py).

    python -m studies.replay [--runs 4] [--out docs/viewer/replay_validation.png]

A simulated run stores, per step, a pool of prompts with Stage 1 scores (the true V plus noise),
STORED_BARE bare rollouts each and one continuation from every prefix on them. The truth for an
allocator is the mean number of contrastive groups when it allocates on the same prompts and
scores and its rollouts come from the simulator itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.allocation import BenchConfig
from trace_core.allocators import Budget, PrefixSet, RootPool, make_allocator, root_prefix
from trace_core.replay import replay_run
from trace_core.tree import TreeBatch
from trace_core.simulator import SimConfig, Simulator

KNOBS = BenchConfig().allocator  # the simulation's allocator knobs, as bench.allocation's

STEPS, POOL, STORED_BARE = 6, 16, 4
BUDGET = Budget(roots=16, multiplier=1)
NOISE = 0.15  # the "predictor": the true V plus this much Gaussian noise


def noisy(v: float, rng: np.random.Generator) -> float:
    return float(np.clip(v + rng.normal(0, NOISE), 0.01, 0.99))


def prefixes(turns: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Non-leaf prefixes (depth >= 1) of a rollout: every history before its last turn."""
    return [turns[:t] for t in range(1, len(turns))]


def logged_steps(sim: Simulator, rng: np.random.Generator):
    """What a run stores: per step a pool of prompts with Stage 1 scores, STORED_BARE bare
    rollouts each, and one continuation from every prefix on them (with its Stage 2 score); the
    trees as ``trace_core.replay.StepInput`` (a ``TreeBatch`` and each row's score)."""
    steps = []
    for _ in range(STEPS):
        prompts = sim.sample_prompts(POOL, rng)
        v = [noisy(sim.true_value(p), rng) for p in prompts]
        bare, conts = [], []  # (tree, length, reward); (tree, bare rollout, depth, score, reward)
        for k, prompt in enumerate(prompts):
            for _ in range(STORED_BARE):
                ro = sim.rollout(prompt, (), rng)
                for h in prefixes(ro.turns):
                    score = noisy(sim.true_value(prompt, h), rng)
                    conts.append((len(bare), len(h), score,
                                  float(sim.rollout(prompt, h, rng).reward)))
                bare.append((k, len(ro.turns), float(ro.reward)))
        trees = TreeBatch.empty().with_new_trees(len(prompts))
        trees, grown = trees.grow(trees.roots[[k for k, _, _ in bare]], [n for _, n, _ in bare],
                                  [r for _, _, r in bare], level=0)
        start = grown.leaf - np.array([n for _, n, _ in bare]) + 1  # each bare rollout's first row
        at = np.array([start[b] + d - 1 for b, d, _, _ in conts], np.int64)
        score = np.full(trees.num_rows, np.nan)
        score[trees.roots] = v
        score[at] = [s for _, _, s, _ in conts]
        trees, placed = trees.grow(at, np.ones(len(conts), np.int64),
                                   [r for _, _, _, r in conts], level=1)
        steps.append((prompts, v, (trees, placed.place(score, np.full(len(conts), np.nan)))))
    return steps


def truth(sim: Simulator, name: str, prompts, v, rng: np.random.Generator, reps: int) -> float:
    """Expected contrastive groups when the allocator runs on the simulator itself."""
    allocator = make_allocator(name, KNOBS)
    pool = RootPool(predicted=np.asarray(v), staleness=np.zeros(len(v)))
    total = 0
    for _ in range(reps):
        m = allocator.allocate_roots(pool, allocator.root_leaves(BUDGET), rng)
        for i in np.flatnonzero(m):
            prompt = prompts[i]
            bare = [sim.rollout(prompt, (), rng) for _ in range(int(m[i]))]
            outcomes = [float(r.reward) for r in bare]
            extra = allocator.tree_leaves(int(m[i]), BUDGET)
            if extra:
                cands = [(h, float(r.reward)) for r in bare for h in prefixes(r.turns)]
                shared = root_prefix(outcomes)
                if not cands or (allocator.branches_from_root and shared is not None):
                    cands.append(((), shared))
                ok = [c for c in cands if c[1] is not None]
                if len(cands) == 1 and cands[0][0] == ():
                    k = [extra]
                    ok = cands
                else:
                    k = allocator.allocate_prefixes(PrefixSet(
                        predicted=np.array([noisy(sim.true_value(prompt, h), rng) for h, _ in ok]),
                        observed=np.array([y for _, y in ok])), extra, rng)
                for (h, _), kk in zip(ok, k):
                    outcomes += [float(sim.rollout(prompt, h, rng).reward) for _ in range(int(kk))]
            total += 0 < sum(outcomes) < len(outcomes)
    return total / reps


def validate(sim: Simulator, runs: list, names: list[str], replicates: int = 100
             ) -> dict[str, tuple[list[float], list[float]]]:
    """Per allocator: (replay estimates, truths) of the groups summed over each run's steps."""
    out = {}
    for name in names:
        est, tru = [], []
        for logged in runs:
            _, [rep] = replay_run([t for _, _, t in logged], [make_allocator(name, KNOBS)], BUDGET,
                                  seed=1, replicates=replicates)
            est.append(sum(s.groups for s in rep.steps))
            tru.append(sum(truth(sim, name, prompts, v, np.random.default_rng(2), reps=replicates)
                           for prompts, v, _ in logged))
        out[name] = (est, tru)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--out", default="docs/viewer/replay_validation.png")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sim = Simulator(SimConfig())
    runs = [logged_steps(sim, np.random.default_rng(seed)) for seed in range(args.runs)]
    result = validate(sim, runs, ["trace", "grpo", "prompt_only"])
    fig, ax = plt.subplots(figsize=(4.6, 4.2))
    top = max(max(e + t) for e, t in result.values()) * 1.1
    ax.plot([0, top], [0, top], color="#999", lw=1, ls="--")
    for name, (est, tru) in result.items():
        ax.scatter(tru, est, label=name, s=30)
        print(f"| {name} | {' / '.join(f'{e:.1f} vs {t:.1f}' for e, t in zip(est, tru))} | "
              f"{sum(est):.1f} vs {sum(tru):.1f} ({100 * (sum(est) / sum(tru) - 1):+.1f} %) |")
    ax.set_xlabel(f"truth: groups over {STEPS} steps (simulator)")
    ax.set_ylabel("replay estimate from stored trees")
    ax.set_title("trace replay against the exact process", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
