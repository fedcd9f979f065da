"""A synthetic multi-turn task process whose true prefix value V(H) is known exactly.

Why: docs/algorithm.md defines V(H) = P(r = 1 | H, policy). On real tasks V is unknown, so the
allocators (trace_core.allocators) and the shared predictor (trace_core.predictor) are measured
here, against the exact V, before they touch an LLM.

The process is a hidden Markov chain over an agent's latent progress, one step per ReAct turn:

    latent state  open (O) --a--> solved (S, terminal, r = 1)
                  open (O) --b--> doomed (D)        doomed (D) --rho--> open (O)
                  otherwise the state is kept; after ``max_turns`` turns without S, r = 0.

Each prompt has its own (a, b, rho), set by a difficulty level, a topic and per-prompt noise.
Every non-terminal turn emits an observation token that reflects the new state, noisily:
"search" for O and "deadend" for D, each swapped with probability ``obs_noise``; reaching S
emits "found" and ends the episode. A history H is the prompt plus the tokens so far, so the
exact V(H) is the forward (filtering) posterior over {O, D} times the per-state success
probability with the turns that remain:

    V_O(R) = a + b V_D(R-1) + (1 - a - b) V_O(R-1),   V_D(R) = rho V_O(R-1) + (1 - rho) V_D(R-1),
    V(H)   = P(O | H) V_O(T - t) + P(D | H) V_D(T - t),   V_O(0) = V_D(0) = 0.

A continuation from H draws its latent state from P(. | H) and runs on, so the success rate of
continuations from H is exactly V(H) (the same quantity a real environment restored by replay
would give, averaged over what the history does not reveal).

The text rendering carries learnable but incomplete signal: a prompt id, its topic and a shown
difficulty level that is right only most of the time; per-prompt noise on (a, b) is not shown.

Departure from the paper: the paper's tasks are real (QA, math, function calling); this is a toy
process for measuring allocation, with a fixed token cost per generated turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

SEARCH = "search"
DEADEND = "deadend"
FOUND = "found"
TURN_TOKENS = (SEARCH, DEADEND, FOUND)


@dataclass(frozen=True)
class SimConfig:
    """World parameters of the synthetic process (shared by every prompt)."""

    max_turns: int = 6
    """Turn cap T: an episode that has not reached "solved" after T turns fails."""
    n_topics: int = 8
    """Number of topics; a topic scales the per-turn solve rate."""
    topic_spread: float = 0.5
    """Topic k multiplies the solve rate by exp(topic_spread * (2k / (n_topics - 1) - 1))."""
    level_probs: tuple[float, ...] = (0.34, 0.08, 0.09, 0.08, 0.41)
    """Difficulty mix: probability of each level, easiest first (the pool's composition)."""
    level_solve: tuple[float, ...] = (0.85, 0.30, 0.15, 0.06, 0.002)
    """Per-turn probability of O -> S at each level, before topic and prompt noise."""
    level_deadend: tuple[float, ...] = (0.03, 0.10, 0.15, 0.20, 0.30)
    """Per-turn probability of O -> D at each level, before prompt noise."""
    recover: float = 0.15
    """Per-turn probability of D -> O."""
    prompt_noise: float = 0.35
    """Std of the log-normal per-prompt factor on the solve and dead-end rates (not shown in text)."""
    level_shown_correct: float = 0.75
    """Probability that the rendered level tag is the true level (else a neighbouring level)."""
    obs_noise: float = 0.15
    """Probability that a "search"/"deadend" token shows the other state."""
    tokens_per_turn: int = 64
    """Simulated generated tokens per turn (thought + action), for the token ledger."""
    prompt_tokens: int = 128
    """Simulated tokens of a rendered prompt (read, not generated; reported separately)."""

    def __post_init__(self) -> None:
        n = len(self.level_probs)
        if n == 0 or len(self.level_solve) != n or len(self.level_deadend) != n:
            raise ValueError("SimConfig: level_probs, level_solve, level_deadend must have equal, non-zero length")
        if not np.isclose(sum(self.level_probs), 1.0) or min(self.level_probs) < 0:
            raise ValueError(f"SimConfig.level_probs must be a distribution, got {self.level_probs}")
        if self.max_turns < 1:
            raise ValueError(f"SimConfig.max_turns must be >= 1, got {self.max_turns}")
        if self.n_topics < 2:
            raise ValueError(f"SimConfig.n_topics must be >= 2, got {self.n_topics}")
        for name in ("recover", "obs_noise", "level_shown_correct"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SimConfig.{name} must lie in [0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.obs_noise < 0.5:
            raise ValueError(f"SimConfig.obs_noise must lie in [0, 0.5) so tokens carry signal, got {self.obs_noise}")


@dataclass(frozen=True)
class Prompt:
    """One task instance. ``solve``/``deadend``/``recover`` are the hidden per-turn rates."""

    uid: int
    topic: int
    level: int
    shown_level: int
    solve: float
    deadend: float
    recover: float

    @property
    def text(self) -> str:
        """The prompt as the predictor sees it (the depth-0 history)."""
        return f"q{self.uid} topic{self.topic} level{self.shown_level}"


@dataclass(frozen=True)
class Rollout:
    """The turns one rollout generated after its prefix, and its outcome."""

    turns: tuple[str, ...]
    reward: int
    tokens: int  # generated tokens of these turns only (the prefix is re-used, not re-generated)


def render(prompt: Prompt, prefix: tuple[str, ...]) -> str:
    """History text of ``prompt`` after the turns ``prefix``: "q3 topic1 level2 | search | deadend"."""
    return " | ".join((prompt.text, *prefix))


class Simulator:
    """Samples prompts and rollouts; gives the exact V of any prefix. Randomness is passed in."""

    def __init__(self, config: SimConfig = SimConfig()):
        self.config = config
        self._next_uid = 0

    def sample_prompts(self, n: int, rng: np.random.Generator) -> list[Prompt]:
        """Draw ``n`` new prompts (fresh uids) from the difficulty mix."""
        if n < 0:
            raise ValueError(f"sample_prompts: n must be >= 0, got {n}")
        c = self.config
        n_levels = len(c.level_probs)
        levels = rng.choice(n_levels, size=n, p=np.asarray(c.level_probs))  # [n]
        topics = rng.integers(0, c.n_topics, size=n)  # [n]
        noise = rng.lognormal(0.0, c.prompt_noise, size=(n, 2))  # [n, 2]
        # A wrong tag is off by one level, so the tag is informative but not exact.
        shift = np.where(rng.random(n) < 0.5, -1, 1)
        wrong = rng.random(n) >= c.level_shown_correct
        shown = np.clip(levels + np.where(wrong, shift, 0), 0, n_levels - 1)
        prompts = []
        for i in range(n):
            topic_factor = np.exp(c.topic_spread * (2.0 * topics[i] / (c.n_topics - 1) - 1.0))
            solve = min(c.level_solve[levels[i]] * topic_factor * noise[i, 0], 0.95)
            deadend = min(c.level_deadend[levels[i]] * noise[i, 1], 0.95 - solve)
            prompts.append(
                Prompt(
                    uid=self._next_uid + i,
                    topic=int(topics[i]),
                    level=int(levels[i]),
                    shown_level=int(shown[i]),
                    solve=float(solve),
                    deadend=float(deadend),
                    recover=c.recover,
                )
            )
        self._next_uid += n
        return prompts

    # ---- exact values -------------------------------------------------------------------------

    def state_values(self, prompt: Prompt) -> np.ndarray:
        """[T + 1, 2] success probability from O (col 0) and D (col 1) with R turns left (row R)."""
        return _state_values(prompt.solve, prompt.deadend, prompt.recover, self.config.max_turns)

    def belief(self, prompt: Prompt, prefix: tuple[str, ...]) -> np.ndarray:
        """[2] posterior P(O | H), P(D | H) after the non-terminal turns ``prefix`` (forward filter)."""
        self._check_prefix(prefix)
        eps = self.config.obs_noise
        a, b, rho = prompt.solve, prompt.deadend, prompt.recover
        bel = np.array([1.0, 0.0])  # the prompt starts open
        for tok in prefix:
            stay_open = bel[0] * (1.0 - a - b) + bel[1] * rho  # joint with "not solved"
            to_doom = bel[0] * b + bel[1] * (1.0 - rho)
            like = (1.0 - eps, eps) if tok == SEARCH else (eps, 1.0 - eps)  # P(tok | O), P(tok | D)
            bel = np.array([stay_open * like[0], to_doom * like[1]])
            bel = bel / bel.sum()
        return bel

    def true_value(self, prompt: Prompt, prefix: tuple[str, ...] = ()) -> float:
        """Exact V(H) = P(r = 1 | prompt, prefix) for a non-terminal prefix."""
        bel = self.belief(prompt, prefix)
        remaining = self.config.max_turns - len(prefix)
        return float(bel @ self.state_values(prompt)[remaining])

    # ---- sampling -----------------------------------------------------------------------------

    def rollout(self, prompt: Prompt, prefix: tuple[str, ...], rng: np.random.Generator) -> Rollout:
        """Continue from ``prefix`` to termination: latent state drawn from P(. | H), then the chain."""
        c = self.config
        bel = self.belief(prompt, prefix)
        doomed = rng.random() < bel[1]
        turns: list[str] = []
        reward = 0
        for _ in range(c.max_turns - len(prefix)):
            u = rng.random()
            if doomed:
                doomed = u >= prompt.recover
            elif u < prompt.solve:
                turns.append(FOUND)
                reward = 1
                break
            else:
                doomed = u < prompt.solve + prompt.deadend
            shown_doomed = doomed != (rng.random() < c.obs_noise)
            turns.append(DEADEND if shown_doomed else SEARCH)
        return Rollout(turns=tuple(turns), reward=reward, tokens=len(turns) * c.tokens_per_turn)

    def _check_prefix(self, prefix: tuple[str, ...]) -> None:
        if len(prefix) >= self.config.max_turns:
            raise ValueError(
                f"prefix has {len(prefix)} turns; a non-terminal prefix has fewer than max_turns={self.config.max_turns}"
            )
        for tok in prefix:
            if tok not in (SEARCH, DEADEND):
                raise ValueError(f"prefix token {tok!r} is not a non-terminal turn ({SEARCH!r} or {DEADEND!r})")


@lru_cache(maxsize=65536)
def _state_values(a: float, b: float, rho: float, max_turns: int) -> np.ndarray:
    values = np.zeros((max_turns + 1, 2))  # [T + 1, 2]
    for r in range(1, max_turns + 1):
        v_open, v_doom = values[r - 1]
        values[r, 0] = a + b * v_doom + (1.0 - a - b) * v_open
        values[r, 1] = rho * v_open + (1.0 - rho) * v_doom
    values.setflags(write=False)
    return values
