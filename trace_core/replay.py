"""Offline counterfactual allocation: what would allocator X have found on the trees a run
already paid for? (``trace replay``)

The stored trees of a step are the environment. Per prompt i the run kept n_i bare rollouts
(independent draws of V(x_i)) with their outcomes and the prefixes on them; per prefix H the
Stage 2 score p it had and the outcomes of the continuations started at H (draws of V(H)).
A replay re-runs Stage 1 and Stage 2 of any allocator (``trace_core.allocators``) at the same leaf
budget on the same prompts, drawing the outcomes it asks for from posteriors fitted to those
stored outcomes, and counts contrastive groups (trees holding a success and a failure) by Monte
Carlo.

The estimator (each replicate, per prompt):

* V_i ~ Beta(kappa_0 v_i + s_i, kappa_0 (1 - v_i) + f_i): v_i the prompt's Stage 1 score, s_i
  and f_i its stored draws of V(x_i) (bare rollouts and continuations from the root), kappa_0
  fitted by moments to the whole run (the disagreeing pairs among each prompt's draws against
  2 v (1 - v), as ``trace_core.calibration`` does for depth 0). So a prompt seen twice, both
  failed, still has a chance to succeed, and its score tells how likely. **Never-sampled
  prompts** (candidates the run filtered, m_i = 0, stored as k = 0 allocation rows) get the
  prior alone: their outcomes are what the scores and the fitted kappa_0 predict.
* Each bare rollout the allocator asks for ends in y ~ Bernoulli(V_i) and follows a stored bare
  rollout of the prompt that ended in y, drawn uniformly: its prefixes, their Stage 2 scores and
  their continuation outcomes become this rollout's. **Never-sampled paths**: a replay cannot see
  prefixes that no stored rollout went through. When no stored rollout of the prompt ended in y
  the rollout has no prefix (it can only be branched from the root), and extra rollouts beyond
  the stored ones repeat stored paths. Both make tree allocators' Stage 2 look less diverse than
  on fresh rollouts: the replay under-states what more branching on new paths would find.
* A continuation from prefix H draws its outcome from W_H ~ Beta(kappa V_i + y + c_H,
  kappa (1 - V_i) + 1 - y + f_H): the prefix's value scatters around the prompt's with
  concentration kappa (per depth, by moments from the stored continuations' flip rates; see
  ``fit_environment``), updated by the outcome y of the stored rollout through H and by the
  c_H / f_H stored continuations from H. A run with no continuations (grpo, prompt_only) cannot
  identify kappa; it is then taken as ``DEFAULT_KAPPA`` and the replay says so.
* A prefix the run never scored (a run without Stage 2) takes its prompt's Stage 1 score as p.

The expected number of contrastive groups per step is the replicates' mean (its Monte Carlo
standard error is reported); over steps the mean per step comes with a 95% interval over steps
(``trace_core.stats.mean_interval``). Validated against the simulator's exact process in
``tests/test_replay.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from trace_core.allocators import Allocator, Budget, PrefixSet, RootPool, root_prefix
from trace_core.stats import mean_interval
from trace_core.tree import TreeBatch

DEFAULT_KAPPA = 4.0
"""Concentration of a prefix's value around its prompt's when no continuation was stored."""


StepInput = tuple[TreeBatch, np.ndarray]
"""One stored step as a replay reads it: its trees (``level`` 0 for the bare rollouts, >= 1 for
continuations; a never-sampled candidate is a tree of its root alone) and per row the score its
allocation had (a root's Stage 1 score, a prefix's Stage 2 score, NaN where none). Every tree
needs a root score."""


@dataclass(frozen=True)
class PromptIndex:
    """What a replay reads of one stored tree: the root's score, each bare rollout's outcome
    and prefix rows (root side first), the outcomes of the continuations started at the root."""

    predicted: float
    bare: list[tuple[float, list[int]]]
    root_continuations: tuple[float, ...]

    def root_counts(self) -> tuple[float, float]:
        """(successes, failures) among the draws of V(x_i): bare rollouts and root continuations."""
        draws = [r for r, _ in self.bare] + list(self.root_continuations)
        s = float(sum(draws))
        return s, len(draws) - s


@dataclass(frozen=True)
class StepIndex:
    """A step's prompts and, per prefix row, its depth, score and continuation outcomes."""

    prompts: list[PromptIndex]
    depth: np.ndarray
    predicted: np.ndarray
    continuations: dict[int, tuple[float, ...]]


def index_step(step: StepInput) -> StepIndex:
    """Read a stored step once: bare rollouts from the level-0 leaves, a continuation's outcome
    from the leaf its chain ends on (``TreeBatch.leaf_below``), started where its level rises."""
    trees, predicted = step
    predicted = np.asarray(predicted, np.float64)
    v = predicted[trees.roots]
    if np.any(~np.isfinite(v)):
        raise ValueError(f"tree {int(np.flatnonzero(~np.isfinite(v))[0])} of a replayed step "
                         "has no Stage 1 score")
    up = np.maximum(trees.up, 0)
    start = np.flatnonzero((trees.up >= 0) & (trees.level > trees.level[up]))
    outcome = trees.reward[trees.leaf_below()[start]]
    continuations: dict[int, list[float]] = {}
    for at, y in zip(trees.up[start[np.isfinite(outcome)]], outcome[np.isfinite(outcome)]):
        continuations.setdefault(int(at), []).append(float(y))
    leaves = trees.leaves
    paths = trees.paths()
    bare: list[list[tuple[float, list[int]]]] = [[] for _ in range(len(trees))]
    for leaf, path in zip(leaves, paths):
        if trees.level[leaf] == 0 and trees.depth[leaf] > 0:
            bare[trees.tree_of_row[leaf]].append(
                (float(trees.reward[leaf]), path[1:trees.depth[leaf]].tolist()))
    prompts = [PromptIndex(float(v[k]), bare[k], tuple(continuations.get(int(root), ())))
               for k, root in enumerate(trees.roots)]
    return StepIndex(prompts, trees.depth, predicted,
                 {row: tuple(ys) for row, ys in continuations.items()})


@dataclass(frozen=True)
class Environment:
    """What the replay draws from, fitted to all stored trees of a run."""

    root_kappa: float
    """Concentration of a prompt's V around its Stage 1 score v: V ~ Beta(kappa v, kappa (1 - v))
    before its stored draws are seen."""
    kappa: dict[int, float] = field(default_factory=dict)
    """Concentration of V(H) around V(x) per depth (``DEFAULT_KAPPA`` where missing)."""
    identified: bool = True
    """False when no stored continuation identified kappa."""

    def kappa_at(self, depth: int) -> float:
        if depth in self.kappa:
            return self.kappa[depth]
        return self.kappa[max(self.kappa)] if self.kappa else DEFAULT_KAPPA

    def posterior(self, predicted: float, successes: float, failures: float) -> tuple[float, float]:
        """Beta parameters of V(x) given a prompt's score and its stored draws."""
        v = min(max(predicted, 1e-3), 1 - 1e-3)
        return self.root_kappa * v + successes, self.root_kappa * (1 - v) + failures


def _concentration(observed: float, expected: float) -> float:
    """kappa from the share of disagreements observed over those expected of independent draws
    (ratio = kappa / (kappa + 1), i.e. 1 - rho), clipped to [0.01, 0.99]."""
    ratio = float(np.clip(observed / expected, 0.01, 0.99)) if expected > 0 else 0.99
    return ratio / (1 - ratio)


def fit_environment(steps: Sequence[StepInput]) -> Environment:
    """kappa_0 of the prompts' prior (disagreeing pairs among each prompt's stored draws against
    2 v (1 - v)), and kappa per depth from the continuations: P(continuation != y) =
    kappa / (kappa + 1) (1 - q), q = y V + (1 - y)(1 - V) with V the prompt's posterior mean, so
    kappa / (kappa + 1) is the observed number of flips over the sum of (1 - q)."""
    read = [index_step(step) for step in steps]
    return _fit(read)


def _fit(steps: Sequence[StepIndex]) -> Environment:
    trees = [(t, step) for step in steps for t in step.prompts if t.bare]
    if not trees:
        raise ValueError("no stored tree with a bare rollout to replay")
    # Roots: disagreeing pairs among a prompt's stored draws, s f / C(n, 2), against 2 v (1 - v).
    pairs = [(s * f / (0.5 * (s + f) * (s + f - 1)), 2 * t.predicted * (1 - t.predicted))
             for t, _ in trees for s, f in [t.root_counts()] if s + f >= 2]
    env = Environment(root_kappa=_concentration(sum(p[0] for p in pairs), sum(p[1] for p in pairs)))
    flips: dict[int, float] = {}
    expected: dict[int, float] = {}
    for t, step in trees:
        a, b = env.posterior(t.predicted, *t.root_counts())
        v = a / (a + b)
        for reward, prefixes in t.bare:
            q = v if reward >= 0.5 else 1 - v
            for h in prefixes:
                d = int(step.depth[h])
                for c in step.continuations.get(h, ()):
                    flips[d] = flips.get(d, 0.0) + float((c >= 0.5) != (reward >= 0.5))
                    expected[d] = expected.get(d, 0.0) + (1 - q)
    kappa = {d: _concentration(flips[d], e) for d, e in expected.items() if e > 0}
    return Environment(root_kappa=env.root_kappa, kappa=kappa, identified=bool(kappa))


@dataclass(frozen=True)
class StepReplay:
    """One allocator on one step."""

    groups: float
    """Expected contrastive groups (trees with a success and a failure)."""
    groups_se: float
    """Monte Carlo standard error of ``groups``."""
    active: float
    """Expected trees (prompts with at least one rollout)."""
    leaves: float
    """Expected leaves spent."""

    @property
    def effective_ratio(self) -> float:
        return self.groups / self.active if self.active else 0.0


def replay_step(step: StepInput | StepIndex, allocator: Allocator, budget: Budget,
                env: Environment, rng: np.random.Generator, replicates: int = 200) -> StepReplay:
    """Expected contrastive groups, trees and leaves of ``allocator`` on one step's prompts."""
    read = step if isinstance(step, StepIndex) else index_step(step)
    trees = read.prompts
    if allocator.name == "dapo":
        raise ValueError("dapo cannot be replayed: its refill waves draw fresh prompts, which "
                         "stored trees do not have")
    pool = RootPool(predicted=np.array([t.predicted for t in trees], np.float64),
                    staleness=np.zeros(len(trees)))
    posteriors = [env.posterior(t.predicted, *t.root_counts()) for t in trees]
    groups = np.zeros(replicates)
    active = np.zeros(replicates)
    leaves = np.zeros(replicates)
    for rep in range(replicates):
        try:
            m = allocator.allocate_roots(pool, allocator.root_leaves(budget), rng)
        except ValueError as exc:
            raise ValueError(f"{allocator.name} cannot allocate {budget.total} leaves over "
                             f"the {len(trees)} stored candidates of a step ({exc}); a run stores "
                             f"its filtered candidates as k = 0 allocation rows; "
                             f"older runs only the prompts they rolled out") from exc
        for j in np.flatnonzero(m):
            mixed, spent = _replay_tree(read, trees[j], posteriors[j], int(m[j]), allocator,
                                        budget, env, rng)
            groups[rep] += mixed
            active[rep] += 1
            leaves[rep] += spent
    return StepReplay(groups=float(groups.mean()),
                      groups_se=float(groups.std(ddof=1) / np.sqrt(replicates)) if replicates > 1 else 0.0,
                      active=float(active.mean()), leaves=float(leaves.mean()))


def _replay_tree(step: StepIndex, tree: PromptIndex, tree_posterior: tuple[float, float], m: int,
                 allocator: Allocator, budget: Budget, env: Environment,
                 rng: np.random.Generator) -> tuple[bool, int]:
    v = float(rng.beta(*tree_posterior))
    ys = (rng.random(m) < v).astype(np.float64)
    outcomes = list(ys)
    extra = allocator.tree_leaves(m, budget)
    if extra > 0:
        by_outcome = {y: [r for r in tree.bare if (r[0] >= 0.5) == bool(y)] for y in (0, 1)}
        keys: list[int] = []  # the stored prefix row per candidate; -1 = the root
        p, obs = [], []
        for y in ys:
            stored = by_outcome[int(y)]
            if not stored:
                continue
            k = int(rng.integers(len(stored)))
            for h in stored[k][1]:
                keys.append(h)
                p.append(step.predicted[h] if np.isfinite(step.predicted[h]) else tree.predicted)
                obs.append(y)
        shared = root_prefix(ys)
        if not keys or (allocator.branches_from_root and shared is not None):
            keys.append(-1)
            p.append(tree.predicted)
            obs.append(float("nan") if shared is None else shared)
        if len(keys) == 1 and keys[0] == -1:
            k_per = np.array([extra])
        else:
            ok = [i for i, o in enumerate(obs) if np.isfinite(o)]
            k_per = np.zeros(len(keys), np.int64)
            k_per[ok] = allocator.allocate_prefixes(
                PrefixSet(predicted=np.clip(np.asarray(p, np.float64)[ok], 0, 1),
                          observed=np.asarray(obs, np.float64)[ok]), extra, rng)
        drawn: dict[int, float] = {}
        for key, y, k in zip(keys, obs, k_per):
            if k <= 0:
                continue
            if key == -1:
                w = v
            else:
                if key not in drawn:
                    kap = env.kappa_at(int(step.depth[key]))
                    conts = step.continuations.get(key, ())
                    c = float(sum(conts))
                    vv = min(max(v, 1e-3), 1 - 1e-3)
                    drawn[key] = rng.beta(kap * vv + y + c,
                                          kap * (1 - vv) + (1 - y) + len(conts) - c)
                w = drawn[key]
            outcomes += list((rng.random(int(k)) < w).astype(np.float64))
    return (0 < sum(outcomes) < len(outcomes)), len(outcomes)


@dataclass(frozen=True)
class Replay:
    """One allocator over a run: per step and overall."""

    allocator: str
    steps: list[StepReplay]

    def overall(self) -> dict[str, float]:
        g = mean_interval([s.groups for s in self.steps]) if len(self.steps) > 1 else None
        e = mean_interval([s.effective_ratio for s in self.steps]) if len(self.steps) > 1 else None
        first = self.steps[0] if self.steps else StepReplay(0, 0, 0, 0)
        return {"groups": g.mean if g else first.groups,
                "groups_low": g.low if g else first.groups - 1.96 * first.groups_se,
                "groups_high": g.high if g else first.groups + 1.96 * first.groups_se,
                "effective_ratio": e.mean if e else first.effective_ratio,
                "effective_ratio_low": e.low if e else float("nan"),
                "effective_ratio_high": e.high if e else float("nan"),
                "leaves": float(np.mean([s.leaves for s in self.steps])) if self.steps else 0.0}


def replay_run(steps: Sequence[StepInput], allocators: Sequence[Allocator],
               budget: Budget, seed: int = 0, replicates: int = 200) -> tuple[Environment, list[Replay]]:
    """Every allocator on every step, at the same budget, with one fitted environment."""
    read = [index_step(step) for step in steps]
    env = _fit(read)
    out = []
    for a_i, allocator in enumerate(allocators):
        rng = np.random.default_rng([seed, a_i])
        out.append(Replay(allocator.name, [replay_step(step, allocator, budget, env, rng,
                                                       replicates) for step in read]))
    return env, out
