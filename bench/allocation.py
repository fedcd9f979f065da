"""Allocation benchmark: every allocator at equal leaf budget on the simulator.

    python -m bench.allocation [--steps S] [--seed 0] [--roots 128] [--multiplier 2] [--pool 512] [--explore X]

Per step, all methods see the same candidate pool (common random numbers); each method that reads
predictions owns a HashedNgramPredictor that learns online from its own trees. Printed: the table
(each figure with its ratio to the oracle's), the predictors' held-out scores and the last line
``TRACE effective ratio: <x>x GRPO, <y>x oracle``. Definitions: docs/algorithm.md, "Allocation
benchmark (bench/allocation.py): definitions".
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from bench import add_options, markdown
from bench.allocation_trees import Grower, Totals
from trace_core.allocators import (ALLOCATORS, AllocatorConfig, Allocator, Budget, LeafLedger, PrefixSet,
                                   RootPool, allocate_per_tree)
from trace_core.predictor import HashedNgramPredictor, HeadConfig, Predictor, auc, brier, ece
from trace_core.simulator import Prompt, SimConfig, Simulator, render
from trace_core.waves import root_waves

METHODS = ("grpo", "dapo", "prompt_only", "random_prefix", "trace", "oracle")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run."""

    steps: int = 150  # per method
    seed: int = 0  # the dataset, the pools, every method's sampling and the predictors
    roots: int = 128  # M; every method spends M (1 + N) leaves a step
    multiplier: int = 2  # N
    dataset_size: int = 2000
    pool_size: int = 512  # candidate prompts drawn per step, without replacement
    eval_prompts: int = 400  # held-out rollouts for the predictors' scores
    methods: tuple[str, ...] = METHODS  # names in trace_core.allocators.ALLOCATORS
    allocator: AllocatorConfig = AllocatorConfig(
        group_size=8, tree_group=4, min_per_root=2, max_per_root=None, exploration=0.003,
        branch_from_root=True, joint_split=False)
    """Not ``TrainConfig``'s on purpose: a pool of 512 and M = 128 afford groups of 8 and trees of 4;
    this process is stationary, so exploration only costs (docs/results.md, "Why the defaults are
    what they are")."""
    head: HeadConfig = HeadConfig()
    sim: SimConfig = SimConfig()

    def __post_init__(self) -> None:
        unknown = set(self.methods) - set(ALLOCATORS)
        if unknown:
            raise ValueError(f"BenchConfig.methods: unknown {sorted(unknown)}; choose from {sorted(ALLOCATORS)}")
        if self.pool_size > self.dataset_size:
            raise ValueError("BenchConfig: pool_size must be <= dataset_size")
        if self.steps < 1:
            raise ValueError("BenchConfig.steps must be >= 1")

    @property
    def budget(self) -> Budget:
        return Budget(self.roots, self.multiplier)


class MethodRun:
    """One allocator's state across steps: its predictor, staleness, sampling stream and totals."""

    def __init__(self, name: str, config: BenchConfig, sim: Simulator, index: int):
        self.name = name
        self.config = config
        self.sim = sim
        self.allocator: Allocator = ALLOCATORS[name](config.allocator)
        self.predictor: Predictor | None = (HashedNgramPredictor(head=config.head)
                                            if self.allocator.uses_predictor else None)
        self.rng = np.random.default_rng([config.seed, 1 + index])
        self.last_sampled = np.full(config.dataset_size, -1, dtype=np.int64)
        self.first_offered = np.full(config.dataset_size, -1, dtype=np.int64)
        self.totals = Totals()

    def predict(self, histories: list[str]) -> np.ndarray:
        if self.predictor is None:
            return np.full(len(histories), 0.5)
        return self.predictor.predict(histories)

    def step(self, step: int, pool_idx: np.ndarray, prompts: list[Prompt]) -> None:
        start = time.perf_counter()
        budget = self.config.budget
        alloc = self.allocator
        ledger = LeafLedger(budget.total)
        pool_prompts = [prompts[i] for i in pool_idx]
        offered = self.first_offered[pool_idx]
        self.first_offered[pool_idx] = np.where(offered >= 0, offered, step)
        last = self.last_sampled[pool_idx]
        pool = RootPool(predicted=self.predict([p.text for p in pool_prompts]),
                        # Steps since last rolled out, or since first offered (tasks.roots.staleness)
                        staleness=np.where(last >= 0, step - last,
                                           step - self.first_offered[pool_idx]).astype(np.float64),
                        true_value=np.array([self.sim.true_value(p) for p in pool_prompts]))
        grower = Grower()

        def roll(opened: list[int], trees: list[int]):  # trace_core.waves.root_waves
            for j in opened:
                grower.new_tree(pool_prompts[j])
            grower.roll(self.sim, grower.trees.roots[trees], 0, self.rng)
            return grower.trees

        counts, order = root_waves(alloc, pool, budget, self.rng, roll, ledger, self.name)
        if any(alloc.tree_leaves(int(counts[j]), budget) for j in order):  # Stage 2, tree by tree
            rows, observed = grower.trees.candidates(alloc.branches_from_root)
            tree, depth = grower.trees.tree_of_row[rows], grower.trees.depth[rows]
            bare = counts[order][tree]
            at = [grower.history(n) for n in rows]
            prefixes = PrefixSet(predicted=self.predict([render(*a) for a in at]), observed=observed,
                                 seen=np.where(depth == 0, bare, 1),
                                 true_value=np.array([self.sim.true_value(*a) for a in at]))
            k = allocate_per_tree(alloc, tree, prefixes, depth, bare, budget, self.rng)
            ledger.spend(int(k.sum()), f"{self.name} prefix stage")
            grower.roll(self.sim, np.repeat(rows, k), 1, self.rng)
        self.totals.add(grower.trees, grower.tokens)
        self.last_sampled[pool_idx[order]] = step
        if self.predictor is not None:  # fitted on this step's internal nodes' backed-up values
            value, n_leaves = grower.trees.backup()
            internal = np.flatnonzero(~grower.trees.is_leaf)
            self.predictor.fit([render(*grower.history(r)) for r in internal], value[internal],
                               n_leaves[internal].astype(np.float64))
        self.totals.seconds += time.perf_counter() - start


def evaluate_predictor(predictor: Predictor, sim: Simulator, prompts: list[Prompt], n: int,
                       rng: np.random.Generator) -> dict[str, float]:
    """Held-out check: every non-terminal prefix (root included) of one fresh rollout per prompt,
    scored against the rollout's outcome and the exact V, beside the held-out base rate's scores."""
    histories, outcome, truth = [], [], []
    for i in rng.choice(len(prompts), size=n, replace=False):
        p = prompts[i]
        r = sim.rollout(p, (), rng)
        for t in range(len(r.turns)):  # turns[:t] for t < len is non-terminal
            prefix = r.turns[:t]
            histories.append(render(p, prefix))
            outcome.append(float(r.reward))
            truth.append(sim.true_value(p, prefix))
    y, v = np.asarray(outcome), np.asarray(truth)
    pred = predictor.predict(histories)
    const = np.full_like(y, y.mean())
    return {"examples": float(len(y)), "brier": brier(pred, y), "brier_constant": brier(const, y),
            "mse_true_v": brier(pred, v), "mse_true_v_constant": brier(const, v), "ece": ece(pred, y),
            "auc": auc(pred, y)}


@dataclass
class BenchResult:
    figures: dict[str, dict[str, float]]
    predictor: dict[str, dict[str, float]]
    seconds: dict[str, float]


def run_bench(config: BenchConfig) -> BenchResult:
    sim = Simulator(config.sim)
    prompts = sim.sample_prompts(config.dataset_size, np.random.default_rng([config.seed, 0]))
    runs = [MethodRun(name, config, sim, i) for i, name in enumerate(config.methods)]
    pool_rng = np.random.default_rng([config.seed, 10_000])
    for step in range(config.steps):
        pool_idx = pool_rng.choice(config.dataset_size, size=config.pool_size, replace=False)
        for run in runs:
            run.step(step, pool_idx, prompts)
    predictor_stats = {}
    for run in runs:
        if run.predictor is not None:
            eval_rng = np.random.default_rng([config.seed, 20_000])  # the same held-out rollouts for every predictor
            predictor_stats[run.name] = evaluate_predictor(run.predictor, sim, prompts, config.eval_prompts, eval_rng)
    return BenchResult(figures={run.name: run.totals.figures() for run in runs}, predictor=predictor_stats,
                       seconds={run.name: run.totals.seconds for run in runs})


COLUMNS = (("effective_ratio", "eff. ratio", ".3f"),
           ("effective_ratio_late", "eff. ratio, 2nd half", ".3f"),
           ("mixed_anchor_share", "mixed anchors", ".3f"),
           ("contrast_per_100_leaves", "contrast/100 leaves", ".1f"),
           ("tokens_per_step", "tokens/step", ".0f"))


def format_table(result: BenchResult) -> str:
    """A markdown table: per method its roots and leaves per step and each of ``COLUMNS`` with,
    where the oracle ran, its ratio to the oracle's."""
    oracle = result.figures.get("oracle")
    head = ["method", "roots/step", "leaves/step",
            *(h for _, label, _ in COLUMNS for h in ((label, "x oracle") if oracle else (label,)))]
    rows = []
    for name, fig in result.figures.items():
        rows.append([name, f"{fig['roots_per_step']:.1f}", f"{fig['leaves_per_step']:.0f}"])
        for key, _, fmt in COLUMNS:
            rows[-1].append(format(fig[key], fmt))
            if oracle:
                rows[-1].append(f"{fig[key] / oracle[key]:.2f}" if oracle[key] else "n/a")
    return markdown(head, rows)


def format_predictor(result: BenchResult) -> str:
    return "\n".join(f"predictor ({name}): Brier {s['brier']:.4f} vs constant {s['brier_constant']:.4f}; "
                     f"MSE to true V {s['mse_true_v']:.4f} vs constant {s['mse_true_v_constant']:.4f}; "
                     f"ECE {s['ece']:.3f}; AUC {s['auc']:.3f} ({s['examples']:.0f} held-out prefixes)"
                     for name, s in result.predictor.items())


def headline(result: BenchResult) -> str:
    trace, fig = result.figures["trace"]["effective_ratio"], result.figures
    return (f"TRACE effective ratio: {trace / fig['grpo']['effective_ratio']:.2f}x GRPO, "
            f"{trace / fig['oracle']['effective_ratio']:.2f}x oracle")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.allocation", description=__doc__.split("\n\n")[0])
    d = BenchConfig()
    add_options(parser, ("--steps", d.steps, "training steps per method"),
                ("--seed", d.seed, "seed of the whole run"), ("--roots", d.roots, "root budget M"),
                ("--multiplier", d.multiplier, "continuation multiplier N"),
                ("--pool", d.pool_size, "candidate prompts per step"),
                ("--explore", d.allocator.exploration, "exploration strength (trace, prompt_only)"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the predictor's small matmuls: extra threads only contend
    config = BenchConfig(steps=args.steps, seed=args.seed, roots=args.roots, multiplier=args.multiplier,
                         pool_size=args.pool, allocator=replace(d.allocator, exploration=args.explore))
    print(f"allocation bench: steps={config.steps} seed={config.seed} M={config.roots} N={config.multiplier} "
          f"leaves/step={config.budget.total} pool={config.pool_size} dataset={config.dataset_size} "
          f"explore={config.allocator.exploration}")
    result = run_bench(config)
    print(format_table(result))
    print(format_predictor(result))
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in result.seconds.items()))
    print(headline(result))


if __name__ == "__main__":
    main()
