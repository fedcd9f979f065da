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
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from trace_core.advantages import ESTIMATORS, centred, per_node
from trace_core.allocation import allocate_prefixes
from trace_core.allocators import (ALLOCATORS, Allocator, Budget, LeafLedger,
                                   PrefixSet, RootPool, Trace, _uniform_groups, bare_prefixes)
from trace_core.calibration import Term, estimate, tree_terms
from trace_core.posterior import PromptPosterior
from trace_core.simulator import SimConfig
from trace_core.stats import mean_interval, paired_gain, verdict
from trace_core.tree import backup, root_to_leaf_paths
from trace_rl.config import TrainConfig

PLAIN, RETRY, HOMONYM, ANSWER = range(4)
TURN_TYPES = ("plain", "retry", "homonym", "answer")
NO_HAZARD, ALIAS, NEAR_DUP = 0, 1, 2
N_ACTIONS = 3

INIT_PROBS = np.array([
    [0.70, 0.25, 0.05],  # plain: correct query, sloppy query, answer now
    [0.50, 0.45, 0.05],  # retry: alias query, repeat verbatim, answer now
    [0.50, 0.45, 0.05],  # homonym: verify, take first match, answer now
    [0.75, 0.20, 0.05],  # answer: answer, search again, answer another entity
])
"""The starting policy (the same for every method and seed): on the default chain items it
succeeds about half the time, as the bootstrapped tiny policy does on synth_chain (issue 19 asks
for 0.3-0.7)."""

TOKENS_PER_TURN = SimConfig().tokens_per_turn
"""Generated tokens charged per turn (thought + action), as in trace_core.simulator."""

REPLAY_STEPS = 4
"""Steps of nodes the learned predictor fits on (HeadConfig.replay_steps)."""

FALSE_CUE = 0.1
"""Chance that a hazard-free hop shows a hazard's cue (a hyphenated or near-duplicate name)."""


# ----------------------------------------------------------------------------- the items


def parse_hops(text: str) -> dict[int, float]:
    """"2:0.35,3:0.40,4:0.25" -> {2: 0.35, 3: 0.4, 4: 0.25}; the weights must sum to 1."""
    out: dict[int, float] = {}
    try:
        for part in text.split(","):
            h, w = part.split(":")
            out[int(h)] = float(w)
    except ValueError as exc:
        raise ValueError(f"--hops {text!r}: expected 'H:weight,...' such as '2:0.35,3:0.40,4:0.25'") from exc
    if not out or min(out) < 1 or min(out.values()) < 0 or not np.isclose(sum(out.values()), 1.0):
        raise ValueError(f"--hops {text!r}: hop counts must be >= 1 and weights >= 0 summing to 1")
    return out


@dataclass(frozen=True)
class ChainParams:
    """The generator's parameters (the names of the real family's config)."""

    hops: str = "2:0.35,3:0.40,4:0.25"
    hazard_a: float = 1.0
    hazard_b: float = 2.0
    alias_share: float = 0.5
    cue_rate: float = 0.5
    structure: str = "chain"

    def __post_init__(self) -> None:
        parse_hops(self.hops)
        if self.structure not in ("chain", "arith"):
            raise ValueError(f"--structure {self.structure!r}: choose chain or arith")
        if self.hazard_a <= 0 or self.hazard_b <= 0:
            raise ValueError(f"--hazard-a {self.hazard_a}, --hazard-b {self.hazard_b}: must be > 0")
        for name in ("alias_share", "cue_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: must lie in [0, 1]")


@dataclass(frozen=True)
class Items:
    """A set of items as arrays (J = the largest hop count + 1 columns, padded hazard-free)."""

    hops: np.ndarray  # [I] H
    hazard: np.ndarray  # [I, J] NO_HAZARD, ALIAS, NEAR_DUP per hop
    first_wrong: np.ndarray  # [I, J] at a homonym hop: the first match is the wrong copy (hidden)
    cues: np.ndarray  # [I, 2] shown alias cues, shown homonym cues
    ids: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.hops)

    @property
    def cap(self) -> np.ndarray:
        """[I] turn cap H + 3."""
        return self.hops + 3

    def take(self, idx: np.ndarray) -> Items:
        return Items(self.hops[idx], self.hazard[idx], self.first_wrong[idx], self.cues[idx],
                     tuple(self.ids[i] for i in idx))


def make_items(n: int, params: ChainParams, rng: np.random.Generator, prefix: str) -> Items:
    """``n`` items from the generator; ids ``<prefix>-<k>``."""
    ids = tuple(f"{prefix}-{k}" for k in range(n))
    if params.structure == "arith":
        return Items(np.ones(n, np.int64), np.full((n, 2), NO_HAZARD).astype(np.int64)
                     + np.array([[NEAR_DUP, 0]]), np.ones((n, 2), bool), np.zeros((n, 2), np.int64), ids)
    dist = parse_hops(params.hops)
    hops = rng.choice(np.array(list(dist)), size=n, p=np.array(list(dist.values())))  # [n]
    width = int(max(dist)) + 1
    rate = rng.beta(params.hazard_a, params.hazard_b, size=n)  # [n]
    on = (rng.random((n, width)) < rate[:, None]) & (np.arange(width)[None, :] < hops[:, None])
    kind = np.where(rng.random((n, width)) < params.alias_share, ALIAS, NEAR_DUP)
    hazard = np.where(on, kind, NO_HAZARD).astype(np.int64)
    first_wrong = rng.random((n, width)) < 0.5
    real = np.arange(width)[None, :] < hops[:, None]
    cues = np.zeros((n, 2), np.int64)
    for c, kind_ in enumerate((ALIAS, NEAR_DUP)):
        shown = (hazard == kind_) & (rng.random((n, width)) < params.cue_rate)
        false = real & (hazard == NO_HAZARD) & (rng.random((n, width)) < FALSE_CUE)
        cues[:, c] = (shown | false).sum(axis=1)
    return Items(hops.astype(np.int64), hazard, first_wrong, cues, ids)


# ----------------------------------------------------------------------------- the dynamics


@dataclass(frozen=True)
class Dynamics:
    """Per item, state (hop j, retry flag s) -> turn type and, per action, where it leads.

    Arrays [I, J, 2(, A)]; the derailed flag d is carried separately (d' = d | derails)."""

    typ: np.ndarray  # [I, J, S] turn type
    ends: np.ndarray  # [I, J, S, A] the action ends the episode
    pays: np.ndarray  # [I, J, S, A] the ending action succeeds unless derailed
    next_j: np.ndarray  # [I, J, S, A]
    next_s: np.ndarray  # [I, J, S, A]
    derails: np.ndarray  # [I, J, S, A]
    cap: np.ndarray  # [I]


def dynamics(items: Items) -> Dynamics:
    n, width = items.hazard.shape
    j = np.arange(width)[None, :, None]  # [1, J, 1]
    s = np.arange(2)[None, None, :]  # [1, 1, S]
    hz = items.hazard[:, :, None]  # [I, J, 1]
    at_answer = j >= items.hops[:, None, None]  # [I, J, 1]
    typ = np.where(at_answer, ANSWER, np.where((hz == ALIAS) & (s == 1), RETRY,
                                               np.where(hz == NEAR_DUP, HOMONYM, PLAIN)))
    typ = np.broadcast_to(typ, (n, width, 2)).astype(np.int64)
    shape = (n, width, 2, N_ACTIONS)
    ends = np.zeros(shape, bool)
    pays = np.zeros(shape, bool)
    next_j = np.broadcast_to(j[..., None], shape).copy()
    next_s = np.broadcast_to(s[..., None], shape).copy()
    derails = np.zeros(shape, bool)
    ends[..., 2] = True  # every type's third action ends the episode without the answer
    ans = typ == ANSWER
    ends[..., 0] |= ans
    pays[..., 0] = ans
    step = np.minimum(j + 1, width - 1)  # [1, J, 1]
    plain, retry, homo = typ == PLAIN, typ == RETRY, typ == HOMONYM
    alias_fails = plain & (hz == ALIAS)  # the verbatim query at an alias hop returns nothing
    next_j[..., 0] = np.where((plain & ~alias_fails) | retry | homo, step, next_j[..., 0])
    next_s[..., 0] = np.where(alias_fails, 1, np.where(retry | homo | plain, 0, next_s[..., 0]))
    next_j[..., 1] = np.where(homo, step, next_j[..., 1])
    next_s[..., 1] = np.where(homo, 0, next_s[..., 1])
    derails[..., 1] = homo & items.first_wrong[:, :, None]
    return Dynamics(typ, ends, pays, next_j, next_s, derails, items.cap)


def softmax(theta: np.ndarray) -> np.ndarray:
    z = np.exp(theta - theta.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


@dataclass(frozen=True)
class Exact:
    """The exact solution for a policy on a set of items."""

    value: np.ndarray  # [T + 1, I, J, S, D] V at turn t of state (j, s, d); 0 at and past the cap
    grad: np.ndarray  # [I, types, A] d V(start) / d theta per item

    @property
    def start(self) -> np.ndarray:
        """[I] expected return from the prompt."""
        return self.value[0, :, 0, 0, 0]


def exact(dyn: Dynamics, theta: np.ndarray, grad: bool = True) -> Exact:
    """Expected return of every state and (with ``grad``) the gradient of each item's return, by
    a backward pass (values) and a forward pass (state occupancies): grad[type, b] = sum over
    states of that type, occupancy * pi(b) (Q(b) - V)."""
    n, width = dyn.typ.shape[:2]
    horizon = int(dyn.cap.max())
    pi = softmax(theta)[dyn.typ]  # [I, J, S, A]
    d = np.arange(2)[None, None, None, :, None]  # [1, 1, 1, D, 1]
    nd = d | dyn.derails[:, :, :, None, :]  # [I, J, S, D, A]
    reward = (dyn.pays[:, :, :, None, :] & (d == 0)).astype(np.float64)  # [I, J, S, D, A]
    ends = dyn.ends[:, :, :, None, :]
    flat_next = (((np.arange(n)[:, None, None, None, None] * width + dyn.next_j[:, :, :, None, :]) * 2
                  + dyn.next_s[:, :, :, None, :]) * 2 + nd)  # [I, J, S, D, A] index into [I, J, S, D]
    value = np.zeros((horizon + 1, n, width, 2, 2))
    q_all = np.zeros((horizon, n, width, 2, 2, N_ACTIONS))
    for t in range(horizon - 1, -1, -1):
        live = (t < dyn.cap)[:, None, None, None, None]
        q = np.where(ends, reward, value[t + 1].reshape(-1)[flat_next]) * live
        q_all[t] = q
        value[t] = (pi[:, :, :, None, :] * q).sum(axis=-1)
    if not grad:
        return Exact(value, np.zeros((n, len(TURN_TYPES), N_ACTIONS)))
    occ = np.zeros((n, width, 2, 2))
    occ[:, 0, 0, 0] = 1.0
    contrib = np.zeros((n, width, 2, N_ACTIONS))  # summed over turns and the derailed flag
    for t in range(horizon):
        w = occ[..., None] * pi[:, :, :, None, :]  # [I, J, S, D, A] P(state, action)
        contrib += (w * (q_all[t] - value[t][..., None])).sum(axis=3)
        occ = np.bincount(flat_next.reshape(-1), weights=np.where(ends, 0.0, w).reshape(-1),
                          minlength=n * width * 4).reshape(n, width, 2, 2)
    slot = (np.arange(n)[:, None, None] * len(TURN_TYPES) + dyn.typ)[..., None] * N_ACTIONS \
        + np.arange(N_ACTIONS)  # [I, J, S, A] index into [I, types, A]
    g = np.bincount(slot.reshape(-1), weights=contrib.reshape(-1),
                    minlength=n * len(TURN_TYPES) * N_ACTIONS)
    return Exact(value, g.reshape(n, len(TURN_TYPES), N_ACTIONS))


# ----------------------------------------------------------------------------- sampling


@dataclass
class Batch:
    """Rollouts from given start states: per rollout its new turns and outcome."""

    typ: np.ndarray  # [R, T] turn type of each new turn (-1 past the end)
    action: np.ndarray  # [R, T]
    state: np.ndarray  # [R, T, 4] (j, s, d, t) after each new turn
    length: np.ndarray  # [R] new turns
    reward: np.ndarray  # [R] 0 or 1


def sample(dyn: Dynamics, theta: np.ndarray, item: np.ndarray, start: np.ndarray,
           rng: np.random.Generator) -> Batch:
    """Roll out from states ``start`` [R, 4] = (j, s, d, t) of items ``item`` [R] to the end."""
    r_count = len(item)
    horizon = int(dyn.cap.max())
    probs = softmax(theta)
    cdf = np.cumsum(probs, axis=1)  # [types, A]
    out = Batch(np.full((r_count, horizon), -1), np.full((r_count, horizon), -1),
                np.zeros((r_count, horizon, 4), np.int64), np.zeros(r_count, np.int64),
                np.zeros(r_count))
    j, s, d, t = (start[:, k].astype(np.int64).copy() for k in range(4))
    alive = t < dyn.cap[item]
    if not alive.all():
        raise ValueError("sample: a start state is at or past its item's turn cap")
    k = 0
    while alive.any():
        idx = np.flatnonzero(alive)
        ii, jj, ss = item[idx], j[idx], s[idx]
        ty = dyn.typ[ii, jj, ss]
        a = (rng.random(len(idx))[:, None] > cdf[ty]).sum(axis=1)  # [n] inverse-cdf draw
        a = np.minimum(a, N_ACTIONS - 1)
        ends = dyn.ends[ii, jj, ss, a]
        d[idx] |= dyn.derails[ii, jj, ss, a]
        out.reward[idx] = np.where(ends & dyn.pays[ii, jj, ss, a] & (d[idx] == 0), 1.0, 0.0)
        j[idx], s[idx] = dyn.next_j[ii, jj, ss, a], dyn.next_s[ii, jj, ss, a]
        t[idx] += 1
        out.typ[idx, k], out.action[idx, k] = ty, a
        out.state[idx, k] = np.stack([j[idx], s[idx], d[idx], t[idx]], axis=1)
        out.length[idx] += 1
        alive[idx] = ~ends & (t[idx] < dyn.cap[ii])
        k += 1
    return out


# ----------------------------------------------------------------------------- trees


@dataclass
class SimTree:
    """One prompt's rollout tree (node 0 the root; parent < child) with each node's state."""

    item: int  # index into the train pool
    parent: list[int] = field(default_factory=lambda: [-1])
    state: list[tuple[int, int, int, int]] = field(default_factory=lambda: [(0, 0, 0, 0)])
    typ: list[int] = field(default_factory=lambda: [-1])  # the turn that led to the node
    action: list[int] = field(default_factory=lambda: [-1])
    firsts: list[int] = field(default_factory=lambda: [0])  # first matches taken on the path
    level: list[int] = field(default_factory=lambda: [0])  # 0 bare rollouts, 1 continuations
    reward: list[float] = field(default_factory=lambda: [np.nan])
    bare_leaves: list[int] = field(default_factory=list)
    root_successes: float = 0.0  # outcomes of rollouts started at the root (unbiased draws)
    root_rollouts: int = 0
    turns: int = 0  # generated turns

    def add(self, at: int, batch: Batch, r: int, bare: bool) -> None:
        node = at
        for k in range(int(batch.length[r])):
            self.parent.append(node)
            self.state.append(tuple(int(x) for x in batch.state[r, k]))
            ty, a = int(batch.typ[r, k]), int(batch.action[r, k])
            self.typ.append(ty)
            self.action.append(a)
            self.firsts.append(self.firsts[node] + int(ty == HOMONYM and a == 1))
            self.level.append(0 if bare else 1)
            self.reward.append(np.nan)
            node = len(self.parent) - 1
        self.reward[node] = float(batch.reward[r])
        self.turns += int(batch.length[r])
        if bare:
            self.bare_leaves.append(node)
        if at == 0:
            self.root_successes += float(batch.reward[r])
            self.root_rollouts += 1

    def prefixes(self, from_root: bool) -> tuple[list[int], np.ndarray]:
        """Stage 2's candidates (``trace_core.allocators.bare_prefixes``)."""
        return bare_prefixes(self.parent, self.reward, self.bare_leaves, from_root)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.parent, np.int64), np.asarray(self.reward, np.float64)


def roll_into(trees: list[SimTree], where: list[tuple[int, int, bool]], dyn: Dynamics,
              theta: np.ndarray, rng: np.random.Generator) -> None:
    """Sample one rollout per (tree index, node, bare) in ``where``, in one batch."""
    if not where:
        return
    item = np.array([trees[k].item for k, _, _ in where])
    start = np.array([trees[k].state[n] for k, n, _ in where], np.int64)
    batch = sample(dyn, theta, item, start, rng)
    for r, (k, node, bare) in enumerate(where):
        trees[k].add(node, batch, r, bare)


# ----------------------------------------------------------------------------- predictors


def features(items: Items, item: np.ndarray, state: np.ndarray, firsts: np.ndarray) -> np.ndarray:
    """[B, F] visible features of histories: the item's shown cues and hop count, and the
    prefix's progress (turn, hops found, retry flag, first matches taken, at the answer)."""
    hops = items.hops[item]
    j, s, t = state[:, 0], state[:, 1], state[:, 3]
    onehot = (hops[:, None] == np.arange(1, 6)[None, :]).astype(np.float64)  # [B, 5]
    cues = items.cues[item].astype(np.float64)  # [B, 2]
    cols = [np.ones(len(item)), cues[:, 0], cues[:, 1], t / 4.0, (hops - j) / 2.0, s,
            firsts.astype(np.float64), (j >= hops).astype(np.float64), (items.cap[item] - t) / 4.0,
            (t == 0).astype(np.float64)]
    return np.column_stack([onehot] + cols)


class LogisticPredictor:
    """Weighted logistic regression on ``features``, fit by Newton steps on a replay window."""

    def __init__(self, ridge: float = 1e-2, newton_steps: int = 4):
        self.w: np.ndarray | None = None
        self.ridge = ridge
        self.newton_steps = newton_steps
        self.replay: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def predict(self, x: np.ndarray) -> np.ndarray:
        if self.w is None:
            return np.full(len(x), 0.5)
        return 1.0 / (1.0 + np.exp(-np.clip(x @ self.w, -30, 30)))

    def fit(self, x: np.ndarray, y: np.ndarray, weight: np.ndarray) -> None:
        self.replay = (self.replay + [(x, y, weight)])[-REPLAY_STEPS:]
        xs = np.concatenate([r[0] for r in self.replay])
        ys = np.concatenate([r[1] for r in self.replay])
        ws = np.concatenate([r[2] for r in self.replay])
        ws = ws / ws.mean()
        w = np.zeros(xs.shape[1]) if self.w is None else self.w
        for _ in range(self.newton_steps):
            p = 1.0 / (1.0 + np.exp(-np.clip(xs @ w, -30, 30)))
            g = xs.T @ (ws * (p - ys)) / len(ys) + self.ridge * w
            h = (xs * (ws * p * (1 - p))[:, None]).T @ xs / len(ys) + self.ridge * np.eye(len(w))
            w = w - np.linalg.solve(h, g)
        self.w = w


# ----------------------------------------------------------------------------- methods


class PrefixOnly(Trace):
    """Ablation: uniform roots (random_prefix's tree_group per prompt), TRACE's Stage 2."""

    name = "prefix_only"

    def allocate_roots(self, pool: RootPool, leaves: int, rng: np.random.Generator) -> np.ndarray:
        return _uniform_groups(pool.size, self.config.tree_group, leaves, rng)


@dataclass(frozen=True)
class Method:
    """One row of the table: an allocator and how the simulator feeds and uses it."""

    name: str
    allocator: str  # a name in ALLOCATORS, or "prefix_only"
    predictor: str = "learned"  # learned, oracle, constant, posterior
    multiplier: int | None = None  # None = the config's N (the leaf budget stays M (1 + N))
    root_only: bool = False  # Stage 2 leaves all go to fresh rollouts from the root
    count_turns_once: bool | None = None
    joint_split: bool | None = None
    flip_gate: float = 0.0  # Stage 2 drops depth >= 1 prefixes whose predicted flip chance is below
    token_budget: bool = False  # Stage 2 spends the tokens of m_i N full rollouts, not m_i N leaves
    role: str = "ablation"  # baseline, trace, plus, ablation


def methods(plus_names: Sequence[str]) -> list[Method]:
    rows = [
        Method("grpo", "grpo", role="baseline"),
        Method("dapo", "dapo", role="baseline"),
        Method("prompt_only", "prompt_only", role="baseline"),
        Method("random_prefix", "random_prefix", role="baseline"),
        Method("trace", "trace", role="trace"),
        Method("root_only", "trace", root_only=True),
        Method("prefix_only", "prefix_only"),
        Method("constant_pred", "trace", predictor="constant"),
        Method("oracle_pred", "oracle", predictor="oracle"),
        Method("N=1", "trace", multiplier=1),
        Method("count_turns_once", "trace", count_turns_once=True),
        Method("joint_split", "trace", joint_split=True),
        Method("prompt_only+post", "prompt_only", predictor="posterior"),
    ]
    plus = {m.name: m for m in PLUS}
    unknown = [p for p in plus_names if p not in plus]
    if unknown:
        raise ValueError(f"--plus: unknown {unknown}; choose from {sorted(plus)}")
    return rows + [plus[p] for p in plus_names]


PLUS = (
    Method("trace+post", "trace", predictor="posterior", role="plus"),
    Method("trace+gate", "trace", flip_gate=0.25, role="plus"),
    Method("trace+tokens", "trace", token_budget=True, role="plus"),
    Method("trace+post+gate", "trace", predictor="posterior", flip_gate=0.25, role="plus"),
    Method("trace+post+tokens", "trace", predictor="posterior", token_budget=True, role="plus"),
    Method("trace+post+root", "trace", predictor="posterior", root_only=True, role="plus"),
)
"""Deliverable 5's candidates (all TRACE's allocator with one or two options)."""


@dataclass(frozen=True)
class SimSettings:
    steps: int = 60
    pool_size: int = 32
    train_items: int = 256
    eval_items: int = 400
    learning_rate: float = 0.01
    strength: float = 4.0
    train: TrainConfig = TrainConfig()

    def __post_init__(self) -> None:
        if self.steps < 1 or self.pool_size < 2 or self.eval_items < 2:
            raise ValueError("need --steps >= 1, --pool-size >= 2, --eval-items >= 2")
        if self.train_items < self.pool_size:
            raise ValueError(f"--train-items {self.train_items} must be >= --pool-size {self.pool_size}")


class Run:
    """One method on one seed."""

    def __init__(self, method: Method, settings: SimSettings, train: Items, dyn: Dynamics):
        cfg = settings.train
        self.method, self.settings, self.train, self.dyn = method, settings, train, dyn
        joint = cfg.joint_split if method.joint_split is None else method.joint_split
        acfg = replace(cfg.allocator_config, joint_split=joint)
        factory = PrefixOnly if method.allocator == "prefix_only" else ALLOCATORS[method.allocator]
        self.allocator: Allocator = factory(acfg)
        n = cfg.multiplier if method.multiplier is None else method.multiplier
        total = cfg.root_budget * (1 + cfg.multiplier)  # equal leaves whatever N
        if total % (1 + n):
            raise ValueError(f"{method.name}: N = {n} does not divide the leaf budget {total}")
        self.budget = Budget(total // (1 + n), n)
        self.turns_once = cfg.count_turns_once if method.count_turns_once is None else method.count_turns_once
        self.estimator = ESTIMATORS[cfg.advantage]
        self.centre = cfg.centre_advantages
        self.theta = np.log(INIT_PROBS)
        self.adam_m = np.zeros_like(self.theta)
        self.adam_v = np.zeros_like(self.theta)
        self.learned = LogisticPredictor()
        self.posterior = PromptPosterior(settings.strength)
        self.constant = 0.5
        self.terms: list[list[Term]] = []
        self.last_sampled = np.full(train.size, -1)
        self.first_offered = np.full(train.size, -1)
        self.log: dict[str, list[float]] = {k: [] for k in ("tokens", "leaves", "mixed", "active",
                                                             "cosine", "accuracy")}

    # -- predictions ---------------------------------------------------------------------------

    def _node_features(self, tree: SimTree, nodes: list[int]) -> np.ndarray:
        state = np.array([tree.state[n] for n in nodes], np.int64).reshape(-1, 4)
        return features(self.train, np.full(len(nodes), tree.item), state,
                        np.array([tree.firsts[n] for n in nodes]))

    def predict_roots(self, idx: np.ndarray, truth: Exact) -> np.ndarray:
        kind = self.method.predictor
        if kind == "oracle":
            return truth.start[idx]
        if kind == "constant":
            return np.full(len(idx), self.constant)
        x = features(self.train, idx, np.zeros((len(idx), 4), np.int64), np.zeros(len(idx)))
        v = self.learned.predict(x)
        if kind == "posterior":
            v = self.posterior.predict([self.train.ids[i] for i in idx], v)
        return v

    def predict_nodes(self, tree: SimTree, nodes: list[int], truth: Exact) -> np.ndarray:
        kind = self.method.predictor
        if kind == "oracle":
            return np.array([truth.value[t, tree.item, j, s, d] for j, s, d, t in
                             (tree.state[n] for n in nodes)])
        if kind == "constant":
            return np.full(len(nodes), self.constant)
        v = self.learned.predict(self._node_features(tree, nodes))
        if kind == "posterior" and 0 in nodes:
            at = nodes.index(0)
            v[at] = self.predict_roots(np.array([tree.item]), truth)[0]
        return v

    def correlation(self):
        if self.method.predictor == "oracle" or self.settings.train.correlation_window == 0:
            return None
        terms = [t for step in self.terms for t in step]
        return estimate(terms, min_terms=self.settings.train.correlation_min_terms)

    # -- one step ------------------------------------------------------------------------------

    def step(self, step: int, pool_idx: np.ndarray, rng: np.random.Generator,
             truth: Exact) -> tuple[list[SimTree], dict[int, dict[int, float]]]:
        alloc, budget = self.allocator, self.budget
        ledger = LeafLedger(budget.total)
        offered = self.first_offered[pool_idx]
        self.first_offered[pool_idx] = np.where(offered >= 0, offered, step)
        last = self.last_sampled[pool_idx]
        rho = self.correlation()
        predicted_roots = self.predict_roots(pool_idx, truth)
        pool = RootPool(predicted=predicted_roots,
                        staleness=np.where(last >= 0, step - last,
                                           step - self.first_offered[pool_idx]).astype(np.float64),
                        true_value=truth.start[pool_idx],
                        correlation=0.0 if rho is None else rho.at(0))
        trees: dict[int, SimTree] = {}
        root_leaves = alloc.root_leaves(budget)
        counts = alloc.allocate_roots(pool, root_leaves, rng)
        wave = counts
        while wave is not None:
            ledger.spend(int(wave.sum()), f"{self.method.name} root stage")
            where = []
            for j in np.flatnonzero(wave):
                trees.setdefault(int(j), SimTree(int(pool_idx[j])))
            order = list(trees)
            for j in np.flatnonzero(wave):
                where += [(order.index(int(j)), 0, True)] * int(wave[j])
            roll_into([trees[j] for j in order], where, self.dyn, self.theta, rng)
            mixed = np.zeros(pool.size, bool)
            for j, tr in trees.items():
                out = [tr.reward[leaf] for leaf in tr.bare_leaves]
                mixed[j] = 0 < sum(out) < len(out)
            wave = alloc.refill(pool, counts, mixed, root_leaves - int(counts.sum()), rng)
            if wave is not None:
                counts = counts + wave
        order = list(trees)
        tree_list = [trees[j] for j in order]
        predicted: dict[int, dict[int, float]] = {k: {0: float(predicted_roots[j])}
                                                  for k, j in enumerate(order)}
        if alloc.splits_jointly:
            self._joint(tree_list, order, pool, pool_idx, ledger, rho, truth, predicted, rng)
        else:
            where = []
            for k, tr in enumerate(tree_list):
                leaves = alloc.tree_leaves(int(counts[order[k]]), budget)
                if leaves == 0:
                    continue
                if self.method.root_only:
                    ledger.spend(leaves, "root-only continuations")
                    where += [(k, 0, False)] * leaves
                    continue
                nodes, observed = tr.prefixes(alloc.branches_from_root)
                pred = self.predict_nodes(tr, nodes, truth) if nodes else np.zeros(0)
                if self.method.flip_gate > 0 and nodes:
                    flip = np.where(observed == 1, 1 - pred, pred)
                    keep = [i for i, n in enumerate(nodes) if n == 0 or flip[i] >= self.method.flip_gate]
                    nodes, observed, pred = [nodes[i] for i in keep], observed[keep], pred[keep]
                if self.method.token_budget and nodes:
                    leaves = self._token_leaves(tr, nodes, observed, pred, rho, leaves, rng)
                    ledger.budget += leaves - alloc.tree_leaves(int(counts[order[k]]), budget)
                ledger.spend(leaves, f"{self.method.name} prefix stage")
                if not nodes:
                    where += [(k, 0, False)] * leaves
                    continue
                depth = [tr.state[n][3] for n in nodes]
                prefixes = PrefixSet(
                    predicted=pred, observed=observed,
                    true_value=np.array([truth.value[t, tr.item, j, s, d] for j, s, d, t in
                                         (tr.state[n] for n in nodes)]),
                    correlation=None if rho is None else np.array([rho.at(x) for x in depth]),
                    seen=np.array([len(tr.bare_leaves) if n == 0 else 1 for n in nodes], np.int64))
                kk = alloc.allocate_prefixes(prefixes, leaves, rng)
                for n, times, v in zip(nodes, kk, pred):
                    predicted[k][n] = float(v)
                    where += [(k, n, False)] * int(times)
            roll_into(tree_list, where, self.dyn, self.theta, rng)
        return tree_list, predicted

    def _token_leaves(self, tr: SimTree, nodes: list[int], observed: np.ndarray, pred: np.ndarray,
                      rho, leaves: int, rng: np.random.Generator) -> int:
        """Continuation leaves whose expected tokens match those of ``leaves`` full rollouts of
        this prompt (a budget in tokens, not leaves): a continuation from a prefix at turn t is
        taken to cost max(L - t, 1) turns, L the mean length of the prompt's bare rollouts; the
        Stage 2 allocation at ``leaves`` prices the mix, and the leaves are scaled to match."""
        full = tr.turns / len(tr.bare_leaves)
        cost = np.maximum(full - np.array([tr.state[n][3] for n in nodes]), 1.0)
        depth = [tr.state[n][3] for n in nodes]
        k = allocate_prefixes(pred, observed, leaves,
                              correlation=0.0 if rho is None else np.array([rho.at(x) for x in depth]))
        per_leaf = float((k * cost).sum()) / max(int(k.sum()), 1)
        return max(leaves, int(leaves * full / per_leaf))

    def _joint(self, tree_list, order, pool, pool_idx, ledger, rho, truth, predicted, rng) -> None:
        nodes_all, obs_all, pred_all, true_all, depth_all, seen_all, owner = [], [], [], [], [], [], []
        for k, tr in enumerate(tree_list):
            nodes, observed = tr.prefixes(self.allocator.branches_from_root)
            if not nodes:
                continue
            nodes_all += nodes
            obs_all.append(observed)
            pred_all.append(self.predict_nodes(tr, nodes, truth))
            true_all += [truth.value[t, tr.item, j, s, d] for j, s, d, t in (tr.state[n] for n in nodes)]
            depth_all += [tr.state[n][3] for n in nodes]
            seen_all += [len(tr.bare_leaves) if n == 0 else 1 for n in nodes]
            owner += [k] * len(nodes)
        fresh = np.array([j for j in range(pool.size) if j not in set(order)], np.int64)
        leaves = self.budget.total - ledger.spent
        prefixes = PrefixSet(
            predicted=np.concatenate(pred_all) if pred_all else np.zeros(0),
            observed=np.concatenate(obs_all) if obs_all else np.zeros(0),
            true_value=np.asarray(true_all, np.float64),
            correlation=None if rho is None else np.array([rho.at(x) for x in depth_all]),
            seen=np.asarray(seen_all, np.int64))
        fresh_pool = RootPool(predicted=pool.predicted[fresh], staleness=pool.staleness[fresh],
                              true_value=pool.true_value[fresh], correlation=pool.correlation)
        m, kk = self.allocator.allocate_joint(prefixes, fresh_pool, leaves, rng)
        ledger.spend(int(m.sum() + kk.sum()), f"{self.method.name} joint split")
        where = []
        for n, k, times, v in zip(nodes_all, owner, kk, prefixes.predicted):
            predicted[k][n] = float(v)
            where += [(k, n, False)] * int(times)
        for j, times in zip(fresh, m):
            if times:
                tree_list.append(SimTree(int(pool_idx[j])))
                order.append(int(j))
                k = len(tree_list) - 1
                predicted[k] = {0: float(pool.predicted[j])}
                where += [(k, 0, True)] * int(times)
        roll_into(tree_list, where, self.dyn, self.theta, rng)

    # -- learning ------------------------------------------------------------------------------

    def gradient(self, trees: list[SimTree]) -> tuple[np.ndarray, int]:
        """The estimated gradient (token-mean over the batch's path turns) and the number of
        mixed trees."""
        probs = softmax(self.theta)
        g = np.zeros_like(self.theta)
        entries = 0
        mixed = 0
        for tr in trees:
            parent, reward = tr.arrays()
            leaves = reward[~np.isnan(reward)]
            mixed += int(0 < leaves.sum() < len(leaves))
            a = self.estimator(parent, reward)  # [L, D]
            if self.centre:
                a = centred(a)
            if self.turns_once:
                a = per_node(parent, reward, a)
            node = root_to_leaf_paths(parent)[:, 1:]  # [L, D]
            ok = node >= 0
            nodes, adv = node[ok], a[ok]
            typ = np.asarray(tr.typ)[nodes]
            act = np.asarray(tr.action)[nodes]
            entries += len(nodes)
            np.add.at(g, (typ, act), adv)
            np.subtract.at(g, typ, adv[:, None] * probs[typ])
        return g / max(entries, 1), mixed

    def learn(self, trees: list[SimTree], predicted: dict[int, dict[int, float]], step: int,
              pool_grad: np.ndarray) -> None:
        g, mixed = self.gradient(trees)
        denom = np.linalg.norm(g) * np.linalg.norm(pool_grad)
        self.log["cosine"].append(float((g * pool_grad).sum() / denom) if denom > 0 else 0.0)
        self.log["mixed"].append(mixed)
        self.log["active"].append(len(trees))
        self.log["leaves"].append(sum(int(np.sum(~np.isnan(t.arrays()[1]))) for t in trees))
        self.log["tokens"].append(TOKENS_PER_TURN * sum(t.turns for t in trees))
        # Adam (the pipeline's optimiser, no weight decay), ascending the return.
        b1, b2 = 0.9, 0.999
        self.adam_m = b1 * self.adam_m + (1 - b1) * g
        self.adam_v = b2 * self.adam_v + (1 - b2) * g * g
        k = len(self.log["cosine"])
        m_hat, v_hat = self.adam_m / (1 - b1 ** k), self.adam_v / (1 - b2 ** k)
        self.theta = self.theta + self.settings.learning_rate * m_hat / (np.sqrt(v_hat) + 1e-8)
        # The predictors and the rho window learn from this step's trees.
        xs, ys, ws, terms, rewards = [], [], [], [], []
        reads = self.allocator.uses_predictor and self.method.predictor != "oracle"
        for k, tr in enumerate(trees):
            parent, reward = tr.arrays()
            rewards.append(reward[~np.isnan(reward)])
            self.last_sampled[tr.item] = step
            if not reads:
                continue
            value, n_leaves = backup(parent, reward)
            internal = np.flatnonzero(np.isnan(reward))
            xs.append(self._node_features(tr, list(internal)))
            ys.append(value[internal])
            ws.append(n_leaves[internal].astype(np.float64))
            pred = np.full(len(parent), np.nan)
            for n, v in predicted.get(k, {}).items():
                pred[n] = v
            terms += tree_terms(parent, reward, np.asarray(tr.level), pred)
        if reads and self.method.predictor in ("learned", "posterior"):
            self.learned.fit(np.concatenate(xs), np.concatenate(ys), np.concatenate(ws))
        self.constant = float(np.concatenate(rewards).mean())
        if self.method.predictor == "posterior":
            self.posterior.update([self.train.ids[t.item] for t in trees],
                                  np.array([t.root_successes for t in trees]),
                                  np.array([t.root_rollouts for t in trees], np.float64))
        window = self.settings.train.correlation_window
        if window:
            self.terms = (self.terms + [terms])[-window:]


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
    args = ap.parse_args(argv)
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
    wall = time.time() - start
    table, per_seed = summarise(results, rows)
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
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"seeds": seeds, "params": params.__dict__, "table": table,
                       "per_seed": {k: {kk: vv.tolist() for kk, vv in v.items()}
                                    for k, v in per_seed.items()}}, fh, indent=1)
    return {"table": table, "per_seed": per_seed, "best": best, "base": base, "gain": iv}


if __name__ == "__main__":
    main()
