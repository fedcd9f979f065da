"""Rollout-budget allocators behind one interface: TRACE and the baselines of docs/algorithm.md.

Every allocator answers two questions, so the same objects drive the simulator (bench/allocation.py)
and, later, real rollouts in the pipeline:

1. Root stage. Given a candidate pool (predicted V~(x_i), steps since each prompt was last sampled,
   and, for the oracle only, the true V(x_i)), how many bare rollouts m_i each prompt gets.
   ``refill`` lets a method ask for another wave after seeing outcomes (DAPO).
2. Prefix stage, per tree. Given the tree's non-leaf prefixes on its bare rollouts (observed
   outcome r of the rollout through each, V~ of each, true V for the oracle) and a leaf budget,
   how many continuations K each prefix gets.

Equal cost (the ledger): every method spends the same number of leaves (trajectories) per step,
``Budget.total = M + M N``; bare rollouts and continuations are both leaves. Tree methods spend
M at the root and m_i N continuations in tree i (so M N in all); flat methods (grpo, dapo,
prompt_only) spend all M (1 + N) at the root. A tree with no non-leaf prefix (every bare rollout
ended on its first turn) cannot branch; the driver then spends its continuation budget as more
bare rollouts of the same prompt, so the ledger still balances (``LeafLedger`` checks it).

Methods (the registry ``ALLOCATORS`` maps a name to a factory taking ``AllocatorConfig``):

* ``grpo``: n rollouts for each of total / n prompts drawn uniformly; no prefix stage.
* ``dapo``: dynamic sampling: groups of n in waves; a group whose outcomes are all 0 or all 1 is
  dropped from the training batch; waves of fresh prompts refill the missing mixed groups until
  the batch target is met or the leaf budget is spent (so DAPO may spend less than the budget,
  never more). Every generated trajectory is counted.
* ``prompt_only`` (PCL-like): Stage 1 (``allocate_roots`` on explored predictions) with the whole
  budget at the root; no Stage 2.
* ``random_prefix`` (Tree-GRPO/TreePO-like): TRACE's root/prefix budget split, but roots uniform
  (``tree_group`` bare rollouts for each of M / tree_group prompts) and each continuation's branch
  point drawn uniformly from the tree's non-leaf prefixes.
* ``trace``: Stage 1 ``allocate_roots`` on explored predictions with budget M, then Stage 2
  ``allocate_prefixes`` on predicted prefix values with budget m_i N per active prompt. The
  root itself (the depth-0 prefix) is one of the candidates when the tree's bare rollouts agree
  (``AllocatorConfig.branch_from_root``; ``root_prefix``).
  With ``AllocatorConfig.joint_split`` the M N continuation leaves are instead split across the
  step between prefixes and prompts not yet rolled out (``allocate_joint``).
* ``trace_cover``: TRACE with a coverage-aware Stage 1 (``trace_core.coverage.allocate_cover``):
  a prompt is valued by its whole tree (bare rollouts and the m_i N continuations), one bare
  rollout is allowed when N >= 1, and no fewer prompts are activated than GRPO's groups at the
  same leaf budget unless the predictor puts them outside [eps, 1 - eps]; Stage 2 as ``trace``.
* ``oracle``: TRACE's two stages on the true V, without exploration (simulation only).

The inputs (``Budget``, ``RootPool``, ``PrefixSet``, ``AllocatorConfig``, ``LeafLedger``) are
declared in ``trace_core.allocator_inputs`` and importable from here.

Departure from the paper: the exploration rule (trace_core.allocation.explore) is this project's
addition; the paper does not say how the paper avoids starving prompts the predictor calls certain.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

import numpy as np

from trace_core.allocation import allocate_joint, allocate_prefixes, allocate_roots, explore
from trace_core.allocator_inputs import (AllocatorConfig, Budget, LeafLedger,  # noqa: F401 (re-exported)
                                         PrefixSet, RootPool)
from trace_core.coverage import allocate_cover


class Allocator(ABC):
    """Base: a flat method with no refill and no prefix stage. Subclasses override the stages."""

    name = "base"
    uses_predictor = False
    simulation_only = False
    """Whether the method needs what only a simulation knows (the true V)."""
    """Whether the method reads ``RootPool.predicted`` / ``PrefixSet.predicted``."""

    def __init__(self, config: AllocatorConfig):
        self.config = config

    def root_leaves(self, budget: Budget) -> int:
        """Leaves the root stage may spend (the rest, if any, goes to the prefix stage)."""
        return budget.total

    @abstractmethod
    def allocate_roots(self, pool: RootPool, leaves: int, rng: np.random.Generator) -> np.ndarray:
        """[P] bare rollouts per candidate prompt; sums to at most ``leaves``."""

    def refill(
        self, pool: RootPool, counts: np.ndarray, mixed: np.ndarray, leaves: int, rng: np.random.Generator
    ) -> np.ndarray | None:
        """Another wave after outcomes are known: [P] extra counts, or None to stop.

        ``counts`` [P] rollouts so far, ``mixed`` [P] whether a prompt's rollouts hold both outcomes,
        ``leaves`` what the root stage may still spend."""
        return None

    def tree_leaves(self, bare: int, budget: Budget) -> int:
        """Continuation leaves for a tree with ``bare`` bare rollouts."""
        return 0

    @property
    def branches_from_root(self) -> bool:
        """Whether the prefix stage wants the root of a tree whose bare rollouts agree among its
        prefixes (``root_prefix`` builds that entry; see ``AllocatorConfig.branch_from_root``)."""
        return False

    def allocate_prefixes(self, prefixes: PrefixSet, leaves: int, rng: np.random.Generator) -> np.ndarray:
        """[K] continuations per prefix of a non-empty set; sums to ``leaves``."""
        raise NotImplementedError(f"{self.name} has no prefix stage")

    @property
    def splits_jointly(self) -> bool:
        """Whether the continuation budget is split across the step (``allocate_joint``) rather
        than per tree (``tree_leaves`` + ``allocate_prefixes``)."""
        return False

    def allocate_joint(self, prefixes: PrefixSet, fresh: RootPool, leaves: int,
                       rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """([P'] bare rollouts per fresh prompt, [K] continuations per prefix of the whole step),
        together spending ``leaves`` (``AllocatorConfig.joint_split``)."""
        raise NotImplementedError(f"{self.name} has no joint split")


def _uniform_groups(pool_size: int, group: int, leaves: int, rng: np.random.Generator) -> np.ndarray:
    """``group`` rollouts for each of leaves // group prompts drawn without replacement; a remainder
    of at least 2 becomes one smaller group, so the whole budget is spent when possible."""
    n_full, rest = divmod(leaves, group)
    sizes = [group] * n_full + ([rest] if rest >= 2 else [])
    if len(sizes) > pool_size:
        raise ValueError(f"pool of {pool_size} prompts is too small for {len(sizes)} groups; enlarge the pool")
    counts = np.zeros(pool_size, dtype=np.int64)
    counts[rng.choice(pool_size, size=len(sizes), replace=False)] = sizes
    return counts


class Grpo(Allocator):
    name = "grpo"

    def allocate_roots(self, pool: RootPool, leaves: int, rng: np.random.Generator) -> np.ndarray:
        return _uniform_groups(pool.size, self.config.group_size, leaves, rng)


class Dapo(Allocator):
    """Dynamic sampling. Waves draw fresh prompts for the mixed groups still missing."""

    name = "dapo"

    def __init__(self, config: AllocatorConfig):
        super().__init__(config)
        self._target = 0

    def allocate_roots(self, pool: RootPool, leaves: int, rng: np.random.Generator) -> np.ndarray:
        n = self.config.group_size
        self._target = self.config.dapo_batch_groups or max(1, leaves // n // 2)
        return self._wave(np.zeros(pool.size, dtype=bool), self._target, leaves, rng)

    def refill(
        self, pool: RootPool, counts: np.ndarray, mixed: np.ndarray, leaves: int, rng: np.random.Generator
    ) -> np.ndarray | None:
        # The configured target when given: a pipeline task may refill with a fresh allocator
        # object that never ran this step's first wave.
        missing = (self.config.dapo_batch_groups or self._target) - int(mixed.sum())
        if missing <= 0 or leaves < 2:
            return None
        extra = self._wave(counts > 0, missing, leaves, rng)
        return extra if extra.sum() else None

    def _wave(self, used: np.ndarray, groups: int, leaves: int, rng: np.random.Generator) -> np.ndarray:
        n = self.config.group_size
        free = np.flatnonzero(~used)
        wave = _uniform_groups(free.size, n, min(groups * n, leaves), rng)
        counts = np.zeros(used.size, dtype=np.int64)
        counts[free] = wave
        return counts


class PromptOnly(Allocator):
    """PCL-like: Stage 1 with the predictor over the whole budget."""

    name = "prompt_only"
    uses_predictor = True

    def allocate_roots(self, pool: RootPool, leaves: int, rng: np.random.Generator) -> np.ndarray:
        v = explore(pool.predicted, pool.staleness, strength=self.config.exploration)
        return allocate_roots(v, leaves, min_per_root=self.config.min_per_root,
                              max_per_root=self.config.max_per_root, correlation=pool.correlation)


class Trace(Allocator):
    """Stage 1 on V~ (explored) with budget M, Stage 2 on V~ with budget m_i N per tree."""

    name = "trace"
    uses_predictor = True

    def root_leaves(self, budget: Budget) -> int:
        return budget.roots

    def root_values(self, pool: RootPool) -> np.ndarray:
        return explore(pool.predicted, pool.staleness, strength=self.config.exploration)

    def prefix_values(self, prefixes: PrefixSet) -> np.ndarray:
        return prefixes.predicted

    def correlations(self, pool: RootPool | PrefixSet) -> float | np.ndarray:
        """rho the solvers read (the estimate the pipeline measured; 0 if none)."""
        if isinstance(pool, RootPool):
            return pool.correlation
        return 0.0 if pool.correlation is None else pool.correlation

    def allocate_roots(self, pool: RootPool, leaves: int, rng: np.random.Generator) -> np.ndarray:
        return allocate_roots(self.root_values(pool), leaves, min_per_root=self.config.min_per_root,
                              max_per_root=self.config.max_per_root,
                              correlation=self.correlations(pool))

    def tree_leaves(self, bare: int, budget: Budget) -> int:
        return bare * budget.multiplier

    @property
    def branches_from_root(self) -> bool:
        return self.config.branch_from_root

    def allocate_prefixes(self, prefixes: PrefixSet, leaves: int, rng: np.random.Generator) -> np.ndarray:
        return allocate_prefixes(self.prefix_values(prefixes), prefixes.observed, leaves,
                                 max_per_prefix=self.config.max_per_prefix,
                                 correlation=self.correlations(prefixes), seen=prefixes.seen)

    @property
    def splits_jointly(self) -> bool:
        return self.config.joint_split

    def allocate_joint(self, prefixes: PrefixSet, fresh: RootPool, leaves: int,
                       rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return allocate_joint(self.root_values(fresh), self.prefix_values(prefixes),
                              prefixes.observed, leaves, min_per_root=self.config.min_per_root,
                              max_per_root=self.config.max_per_root,
                              max_per_prefix=self.config.max_per_prefix,
                              root_correlation=self.correlations(fresh),
                              prefix_correlation=self.correlations(prefixes), seen=prefixes.seen)


class TraceCover(Trace):
    """Coverage-aware Stage 1 (``trace_core.coverage``): each prompt valued by its whole tree
    (m bare rollouts and the m N continuations Stage 2 adds, with the roots' rho), one bare
    rollout allowed when N >= 1, and at least as many active prompts as GRPO's groups at the
    same leaf budget among those predicted in [eps, 1 - eps]. Stage 2 is TRACE's."""

    name = "trace_cover"

    def coverage_floor(self, v: np.ndarray, budget: Budget) -> int:
        """GRPO's prompt count at the leaf budget, less the prompts predicted near 0 or 1."""
        eps = self.config.cover_eps
        eligible = int(np.count_nonzero((v >= eps) & (v <= 1.0 - eps)))
        return min(budget.total // self.config.group_size, eligible)

    def allocate_roots(self, pool: RootPool, leaves: int, rng: np.random.Generator) -> np.ndarray:
        n = self.config.multiplier
        if n is None:
            raise ValueError("trace_cover: AllocatorConfig.multiplier (N) is required")
        v = self.root_values(pool)
        return allocate_cover(v, leaves, multiplier=n,
                              min_active=self.coverage_floor(v, Budget(max(leaves, 2), n)),
                              min_per_root=self.config.min_per_root,
                              max_per_root=self.config.max_per_root,
                              correlation=self.correlations(pool))


class Oracle(Trace):
    """TRACE's stages on the true V (no exploration: the truth needs none)."""

    name = "oracle"
    uses_predictor = False
    simulation_only = True

    def root_values(self, pool: RootPool) -> np.ndarray:
        if pool.true_value is None:
            raise ValueError("oracle: RootPool.true_value is required")
        return pool.true_value

    def prefix_values(self, prefixes: PrefixSet) -> np.ndarray:
        if prefixes.true_value is None:
            raise ValueError("oracle: PrefixSet.true_value is required")
        return prefixes.true_value

    def correlations(self, pool: RootPool | PrefixSet) -> float:
        return 0.0  # the true V makes outcomes independent draws: nothing to correct


class RandomPrefix(Allocator):
    """Tree-GRPO/TreePO-like: uniform roots, uniformly random branch points, TRACE's budget split."""

    name = "random_prefix"

    def root_leaves(self, budget: Budget) -> int:
        return budget.roots

    def allocate_roots(self, pool: RootPool, leaves: int, rng: np.random.Generator) -> np.ndarray:
        return _uniform_groups(pool.size, self.config.tree_group, leaves, rng)

    def tree_leaves(self, bare: int, budget: Budget) -> int:
        return bare * budget.multiplier

    def allocate_prefixes(self, prefixes: PrefixSet, leaves: int, rng: np.random.Generator) -> np.ndarray:
        if prefixes.size == 0:
            raise ValueError("random_prefix: a tree with no prefixes cannot branch")
        return np.bincount(rng.integers(0, prefixes.size, size=leaves), minlength=prefixes.size).astype(np.int64)


def root_prefix(bare_outcomes: Sequence[float]) -> float | None:
    """The observed outcome the root enters Stage 2 with: the shared outcome of a tree's bare
    rollouts when they all agree, else None (the root's group is already mixed; more rollouts
    from it cannot make it mixed, so it is not offered)."""
    outcomes = {float(r) for r in bare_outcomes}
    if not outcomes <= {0.0, 1.0}:
        raise ValueError(f"bare rollout outcomes must be 0 or 1, got {sorted(outcomes)}")
    return outcomes.pop() if len(outcomes) == 1 else None


def allocate_per_tree(allocator: Allocator, tree: np.ndarray, prefixes: PrefixSet,
                      depth: np.ndarray, bare: np.ndarray, budget: Budget,
                      rng: np.random.Generator) -> np.ndarray:
    """[K] continuations per Stage 2 candidate of a step (``TreeBatch.candidates``: ``tree`` [K]
    each one's tree, ``depth`` [K] its depth, ``bare`` [K] its tree's bare rollouts m_i), tree by
    tree in the order the trees first appear (no cross-prompt waiting): tree i spends
    ``allocator.tree_leaves(m_i, budget)``, all on its root when the root is its only candidate
    (no prefix to branch from)."""
    k = np.zeros(len(tree), dtype=np.int64)
    trees, first = np.unique(tree, return_index=True)
    for t, i in zip(trees, first):
        idx = np.flatnonzero(tree == t)
        leaves = allocator.tree_leaves(int(bare[i]), budget)
        if leaves <= 0:
            continue
        if len(idx) == 1 and depth[i] == 0:  # the root alone
            k[idx] = leaves
            continue
        k[idx] = allocator.allocate_prefixes(prefixes.subset(idx), leaves, rng)
    return k


ALLOCATORS: dict[str, Callable[[AllocatorConfig], Allocator]] = {
    cls.name: cls for cls in (Grpo, Dapo, PromptOnly, RandomPrefix, Trace, TraceCover, Oracle)
}
"""The one registry at the config edge: method name -> factory."""


def make_allocator(name: str, config: AllocatorConfig) -> Allocator:
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator {name!r}; choose one of {sorted(ALLOCATORS)}")
    return ALLOCATORS[name](config)
