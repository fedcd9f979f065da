"""How a step spends its leaf budget in waves of bare rollouts: the outcomes each wave adds per
candidate, DAPO's refill waves, and TRACE's joint split of the rest (docs/algorithm.md,
"trace_core.allocators", and ``AllocatorConfig.joint_split``).

A wave's trees are numbered ``wave * pool_size + candidate``, so a candidate's rollouts of every
wave add up by index. Pure functions of arrays and an ``Allocator``; the pipeline (flows/train.py)
runs the rollouts between them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from trace_core.allocators import Allocator, Budget, LeafLedger, PrefixSet, RootPool, allocate_per_tree
from trace_core.tree import TreeBatch


def outcome_counts(tree_id: Sequence[int], reward: Sequence[float], is_leaf: Sequence[bool],
                   pool_size: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """([P] rollouts, [P] mixed) of one wave: per candidate, its leaves and whether their
    rewards hold both a success and a failure. ``tree_id``, ``reward``, ``is_leaf``: one entry
    per node of the wave ([nodes]; rewards of non-leaves are ignored); candidate = tree_id - offset."""
    leaf = np.asarray(is_leaf, dtype=bool)
    t = np.asarray(tree_id, dtype=np.int64)[leaf] - offset
    if t.size and (t.min() < 0 or t.max() >= pool_size):
        raise ValueError(f"outcome_counts: tree ids {offset + t.min()}..{offset + t.max()} are not "
                         f"in this wave's range {offset}..{offset + pool_size - 1}")
    r = np.asarray(reward, dtype=np.float64)[leaf]
    counts = np.bincount(t, minlength=pool_size).astype(np.int64)  # [P]
    wins = np.bincount(t, weights=r, minlength=pool_size)  # [P]
    return counts, (wins > 0) & (wins < counts)


def refill_wave(allocator: Allocator, pool: RootPool, counts: np.ndarray, mixed: np.ndarray,
                budget: Budget, rng: np.random.Generator) -> np.ndarray | None:
    """The next wave's [P] extra bare rollouts, or None when there is none: the allocator asks
    for no refill (every method but DAPO), or its root stage has spent its leaves. ``counts``
    [P] and ``mixed`` [P]: the candidates' rollouts so far and whether they are mixed."""
    left = allocator.root_leaves(budget) - int(np.sum(counts))
    extra = allocator.refill(pool, counts, mixed, left, rng) if left > 0 else None
    if extra is None or int(np.sum(extra)) == 0:
        return None
    extra = np.asarray(extra, dtype=np.int64)
    if int(extra.sum()) > left:
        raise ValueError(f"refill_wave: {allocator.name} asks for {int(extra.sum())} leaves, "
                         f"{left} are left")
    return extra


def root_waves(allocator: Allocator, pool: RootPool, budget: Budget, rng: np.random.Generator,
               roll: Callable[[list[int], list[int]], TreeBatch], ledger: LeafLedger,
               who: str) -> tuple[np.ndarray, list[int]]:
    """Stage 1 and its refill waves when every wave grows the same trees (the simulators):
    ([P] bare rollouts per candidate, each tree's candidate). ``roll(opened, trees)`` opens a tree
    for each candidate of ``opened`` (new this wave; trees are numbered as opened), hangs one
    bare rollout below the root of each of ``trees`` in that order (``wave[j]`` for candidate j,
    j ascending) and returns the step's trees; a candidate is mixed when its tree's bare
    rollouts hold a success and a failure."""
    tree_of: dict[int, int] = {}  # candidate -> its tree, numbered as opened
    counts = allocator.allocate_roots(pool, allocator.root_leaves(budget), rng)
    wave = counts
    while wave is not None:
        ledger.spend(int(wave.sum()), f"{who} root stage")
        drawn = [int(j) for j in np.flatnonzero(wave)]
        opened = [j for j in drawn if j not in tree_of]
        for j in opened:
            tree_of[j] = len(tree_of)
        bare, wins = roll(opened, [tree_of[j] for j in drawn for _ in range(int(wave[j]))]
                          ).bare_outcomes()
        mixed = np.zeros(pool.size, bool)
        mixed[list(tree_of)] = (wins > 0) & (wins < bare)
        wave = refill_wave(allocator, pool, counts, mixed, budget, rng)
        if wave is not None:
            counts = counts + wave
    return counts, list(tree_of)


def split_jointly(allocator: Allocator, prefixes: PrefixSet, pool: RootPool, counts: np.ndarray,
                  leaves: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """([P] bare rollouts per candidate, [K] continuations per prefix): ``leaves`` split across
    the step between continuations of the prefixes and bare rollouts of the candidates with no
    rollout yet (``counts`` [P] == 0), by ``allocator.allocate_joint``. A prefix observed NaN
    (a root offered with mixed bare rollouts) is no candidate: more rollouts from it cannot make
    its group mixed. Candidates already rolled out get 0."""
    usable = ~np.isnan(prefixes.observed)  # [K]
    part = prefixes.subset(usable)
    fresh = np.flatnonzero(np.asarray(counts) == 0)
    fresh_pool = RootPool(predicted=np.asarray(pool.predicted, np.float64)[fresh],
                          staleness=np.asarray(pool.staleness, np.float64)[fresh],
                          correlation=pool.correlation)
    m_fresh, k_usable = allocator.allocate_joint(part, fresh_pool, leaves, rng)
    k = np.zeros(prefixes.size, dtype=np.int64)
    k[usable] = k_usable
    m = np.zeros(pool.size, dtype=np.int64)
    m[fresh] = m_fresh
    return m, k


def continuations(allocator: Allocator, prefixes: PrefixSet, tree: np.ndarray, depth: np.ndarray,
                  bare: np.ndarray, pool: RootPool, counts: np.ndarray, budget: Budget,
                  rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Stage 2 of a step, whatever the allocator: ([K] continuations per candidate prefix, [P]
    bare rollouts per fresh candidate of ``pool``). ``prefixes`` [K] with ``tree``, ``depth`` and
    ``bare`` [K] (each one's tree, depth and the tree's bare rollouts m_i); ``counts`` [P] the
    candidates' bare rollouts so far. An allocator that splits jointly spends what the root stage
    left of ``budget.total`` across the step (``split_jointly``); any other spends each tree's
    continuation budget on its own prefixes (``allocate_per_tree``) and asks for no fresh roots."""
    if allocator.splits_jointly:
        return split_jointly(allocator, prefixes, pool, counts,
                             budget.total - int(np.sum(counts)), rng)[::-1]
    k = allocate_per_tree(allocator, tree, prefixes, depth, bare, budget, rng)
    return k, np.zeros(pool.size, dtype=np.int64)
