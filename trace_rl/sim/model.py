"""The chain model: items, their deterministic dynamics, the exact return and gradient of the
tabular policy, and sampling from it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trace_core.simulator import SimConfig

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
succeeds about half the time, as the bootstrapped tiny policy does on synth_chain (a useful start
is 0.3-0.7)."""

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
