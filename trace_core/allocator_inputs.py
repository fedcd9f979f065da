"""What the allocators take and spend: the per-step leaf budget (``Budget``), one step's candidate
prompts (``RootPool``), one tree's prefixes (``PrefixSet``), the allocators' knobs
(``AllocatorConfig``) and the count of leaves spent against the budget (``LeafLedger``). The
allocators themselves: ``trace_core.allocators``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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

    @classmethod
    def matched(cls, tokens_per_step: float, tokens_per_leaf: float, group: int) -> Budget:
        """A flat method's budget (N = 0) whose generated tokens per step match
        ``tokens_per_step`` when each leaf (a full rollout) generates ``tokens_per_leaf``: whole
        groups of ``group``, at least one."""
        if not (tokens_per_step > 0 and tokens_per_leaf > 0 and group >= 1):
            raise ValueError(f"Budget.matched: need positive tokens ({tokens_per_step}, "
                             f"{tokens_per_leaf}) and a group >= 1 ({group})")
        return cls(group * max(1, round(tokens_per_step / (group * tokens_per_leaf))), 0)


class _Candidates:
    """What ``RootPool`` and ``PrefixSet`` share: predictions [n] and, in simulation, true values."""

    predicted: np.ndarray
    true_value: np.ndarray | None

    def _check_true_value(self, what: str) -> None:
        if self.true_value is not None and self.true_value.shape != self.predicted.shape:
            raise ValueError(f"{what}: true_value must match predicted in length")

    @property
    def size(self) -> int:
        return self.predicted.shape[0]


@dataclass(frozen=True)
class RootPool(_Candidates):
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
        self._check_true_value("RootPool")


@dataclass(frozen=True)
class PrefixSet(_Candidates):
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
        self._check_true_value("PrefixSet")

    def subset(self, idx: np.ndarray) -> PrefixSet:
        """These prefixes at ``idx`` (positions or a mask), every field kept."""
        pick = lambda x: None if x is None else np.asarray(x)[idx]  # noqa: E731
        return PrefixSet(predicted=self.predicted[idx], observed=self.observed[idx],
                         true_value=pick(self.true_value), correlation=pick(self.correlation),
                         seen=pick(self.seen))


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """Knobs of all allocators (each reads the ones it needs). No defaults for the knobs a
    training run sets: they come from ``trace_rl.config.sections.Allocation.allocator_config``
    (or, in a simulation, from the benchmark's own config), so no value is declared twice."""

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
    multiplier: int | None = None
    """N, continuations per bare rollout: trace_cover values a prompt by its whole tree of m
    bare rollouts and m N continuations (``trace_core.coverage``); None = trace_cover refuses."""
    cover_eps: float = 0.02
    """trace_cover's coverage floor (GRPO's prompt count at the same leaf budget) counts only
    prompts whose explored prediction lies in [cover_eps, 1 - cover_eps]."""
    max_per_prefix: int | None = None
    """Stage 2: cap on continuations per prefix; None = no cap."""
    dapo_batch_groups: int | None = None
    """DAPO's target number of mixed groups (its first wave's size); None = half of the groups the
    leaf budget affords, so the other half is left for refills (a full first wave would make DAPO
    exactly GRPO at equal leaf budget)."""

    def __post_init__(self) -> None:
        if self.group_size < 2 or self.tree_group < 2 or self.min_per_root < 2:
            raise ValueError("AllocatorConfig: group_size, tree_group and min_per_root must be >= 2")
        if not 0.0 <= self.cover_eps < 0.5:
            raise ValueError(f"AllocatorConfig.cover_eps must be in [0, 0.5), got {self.cover_eps}")
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
