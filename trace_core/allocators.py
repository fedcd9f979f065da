"""Rollout-budget allocators behind one interface: TRACE and the baselines of DESIGN.md section 1.

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
* ``oracle``: TRACE's two stages on the true V, without exploration (simulation only).

Departure from the paper: the exploration rule (trace_core.allocation.explore) is this project's
addition; DESIGN.md does not say how the paper avoids starving prompts the predictor calls certain.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from trace_core.allocation import allocate_joint, allocate_prefixes, allocate_roots, explore


@dataclass(frozen=True)
class Budget:
    """The per-step sampling budget, in leaves (complete trajectories)."""

    roots: int
    """M: bare rollouts at the root for tree methods."""
    multiplier: int
    """N: continuations per bare rollout, spent inside the trees."""

    def __post_init__(self) -> None:
        if self.roots < 2 or self.multiplier < 0:
            raise ValueError(f"Budget: roots must be >= 2 and multiplier >= 0, got {self.roots}, {self.multiplier}")

    @property
    def total(self) -> int:
        """Leaves per step, the same for every method: M + M N."""
        return self.roots * (1 + self.multiplier)


@dataclass(frozen=True)
class RootPool:
    """The candidate prompts of one step."""

    predicted: np.ndarray  # [P] V~(x_i)
    staleness: np.ndarray  # [P] steps since the prompt was last sampled
    true_value: np.ndarray | None = None  # [P] V(x_i), known only in simulation
    correlation: float = 0.0
    """rho of rollout outcomes given a root's prediction (``trace_core.calibration``); 0 = the
    paper's independent Bernoulli(v) rollouts."""

    def __post_init__(self) -> None:
        if self.predicted.ndim != 1 or self.staleness.shape != self.predicted.shape:
            raise ValueError("RootPool: predicted and staleness must be 1-D arrays of equal length")
        if not 0.0 <= self.correlation < 1.0:
            raise ValueError(f"RootPool: correlation must be in [0, 1), got {self.correlation}")
        if self.true_value is not None and self.true_value.shape != self.predicted.shape:
            raise ValueError("RootPool: true_value must match predicted in length")

    @property
    def size(self) -> int:
        return self.predicted.shape[0]


@dataclass(frozen=True)
class PrefixSet:
    """One tree's non-leaf prefixes on its bare rollouts."""

    predicted: np.ndarray  # [K] V~(H_ijt)
    observed: np.ndarray  # [K] r_ij of the bare rollout through the prefix, in {0, 1}
    true_value: np.ndarray | None = None  # [K] V(H_ijt), known only in simulation
    correlation: np.ndarray | None = None
    """[K] rho of outcomes given each prefix's prediction (by its depth); None = 0 everywhere."""
    seen: np.ndarray | None = None
    """[K] rollouts below each prefix that had its observed outcome (a root offered for
    branching: its bare rollouts); None = 1 everywhere."""

    def __post_init__(self) -> None:
        if self.predicted.ndim != 1 or self.observed.shape != self.predicted.shape:
            raise ValueError("PrefixSet: predicted and observed must be 1-D arrays of equal length")
        for name in ("correlation", "seen"):
            x = getattr(self, name)
            if x is not None and np.shape(x) != self.predicted.shape:
                raise ValueError(f"PrefixSet: {name} must match predicted in length")
        if self.true_value is not None and self.true_value.shape != self.predicted.shape:
            raise ValueError("PrefixSet: true_value must match predicted in length")

    @property
    def size(self) -> int:
        return self.predicted.shape[0]


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """Knobs of all allocators (each reads the ones it needs). No defaults for the knobs a
    training run sets: they come from ``trace_rl.config.TrainConfig.allocator_config`` (or, in a
    simulation, from the benchmark's own config), so no value is declared twice."""

    group_size: int
    """n: rollouts per prompt for grpo and dapo."""
    tree_group: int
    """Bare rollouts per prompt for random_prefix's uniform roots."""
    min_per_root: int
    """Stage 1: an active prompt gets at least this many bare rollouts (one can never be mixed)."""
    max_per_root: int | None
    """Stage 1: cap on bare rollouts per prompt; None = no cap."""
    exploration: float
    """Strength of the exploration rule applied to predictions before Stage 1 (0 disables it)."""
    branch_from_root: bool
    """Stage 2 (trace, oracle): besides the depth >= 1 prefixes, offer the root itself (the
    depth-0 prefix, the prompt) of a tree whose bare rollouts all agree, with the shared outcome as
    its observed outcome. A continuation from the root is one more bare rollout; it competes on
    the same marginal gain q^K (1 - q). Without it, a prompt whose outcome is fixed by its first
    turn can only spend its m_i N continuations on prefixes that repeat their outcome."""
    joint_split: bool
    """trace, oracle: after the bare rollouts, the continuation budget (M N leaves) is split
    across the whole step between continuations of any tree's prefixes and bare rollouts of
    prompts not yet rolled out (``allocate_joint``: each leaf goes where it buys the most
    expected mixed groups), instead of m_i N continuations inside tree i. With independent
    draws (rho 0) a continuation's predicted flip chance usually beats a fresh pair's gain per
    leaf; with the calibrated rho of ``trace_core.calibration`` it often does not."""
    max_per_prefix: int | None = None
    """Stage 2: cap on continuations per prefix; None = no cap."""
    dapo_batch_groups: int | None = None
    """DAPO's target number of mixed groups (its first wave's size); None = half of the groups the
    leaf budget affords, so the other half is left for refills (a full first wave would make DAPO
    exactly GRPO at equal leaf budget)."""

    def __post_init__(self) -> None:
        if self.group_size < 2 or self.tree_group < 2 or self.min_per_root < 2:
            raise ValueError("AllocatorConfig: group_size, tree_group and min_per_root must be >= 2")
        if self.exploration < 0:
            raise ValueError(f"AllocatorConfig.exploration must be >= 0, got {self.exploration}")


class LeafLedger:
    """Counts leaves spent in one step against the budget; overspending is an error."""

    def __init__(self, budget: int):
        self.budget = budget
        self.spent = 0

    @property
    def left(self) -> int:
        return self.budget - self.spent

    def spend(self, leaves: int, what: str) -> None:
        if leaves < 0 or leaves > self.left:
            raise ValueError(f"ledger: {what} asks for {leaves} leaves but {self.left} of {self.budget} are left")
        self.spent += leaves


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


def bare_prefixes(parent: Sequence[int], reward: Sequence[float], bare_leaves: Sequence[int],
                  from_root: bool = False) -> tuple[list[int], np.ndarray]:
    """A tree's Stage 2 candidates: (node ids, observed outcome [K]) of the non-leaf prefixes at
    depth >= 1 on its bare rollouts (leaves ``bare_leaves``; node 0 is the root, ``parent[i]``
    the parent of node i), each with the outcome of the bare rollout through it, leaf first; with
    ``from_root``, also the root (node 0) when there is some prefix and the bare outcomes all
    agree (``root_prefix``), as the pipeline's tasks/prefixes.py offers it."""
    nodes, observed = [], []
    for leaf in bare_leaves:
        node = parent[leaf]
        while node > 0:
            nodes.append(int(node))
            observed.append(float(reward[leaf]))
            node = parent[node]
    if nodes and from_root:
        shared = root_prefix([reward[leaf] for leaf in bare_leaves])
        if shared is not None:
            nodes.append(0)
            observed.append(shared)
    return nodes, np.asarray(observed, dtype=np.float64)


ALLOCATORS: dict[str, Callable[[AllocatorConfig], Allocator]] = {
    cls.name: cls for cls in (Grpo, Dapo, PromptOnly, RandomPrefix, Trace, Oracle)
}
"""The one registry at the config edge: method name -> factory."""


def make_allocator(name: str, config: AllocatorConfig) -> Allocator:
    if name not in ALLOCATORS:
        raise ValueError(f"unknown allocator {name!r}; choose one of {sorted(ALLOCATORS)}")
    return ALLOCATORS[name](config)
