"""Types shared by engines, environments and the ReAct loop.

A trajectory is kept as token ids per segment so that a continuation from any stored turn-level
prefix re-feeds exactly the same tokens (and hits vLLM's prefix cache):

    prompt_ids | turn_1.gen_ids | turn_1.obs_ids | turn_2.gen_ids | ... | turn_T.gen_ids

``gen_ids`` are sampled by the policy and trained on; ``obs_ids`` hold the chat-template glue and
the tool's observation and are masked out of the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

# an environment's vocabulary, re-exported here
from trace_rl.envs.base import Action, Verdict  # noqa: F401


@dataclass(frozen=True)
class SamplingSettings:
    """How one request is sampled."""

    max_tokens: int = 128
    """Cap on generated tokens for one turn."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass kept."""
    stop: tuple[str, ...] = ()
    """Strings that end the turn; the stop string is kept in the output text and tokens."""
    seed: int | None = None
    """Per-request seed, for reproducible sampling where the engine supports it."""


@dataclass(frozen=True)
class GenRequest:
    """Sample ``n`` continuations of a token prefix."""

    prompt_ids: tuple[int, ...]
    n: int
    sampling: SamplingSettings
    affinity: str = ""
    """Requests with the same affinity (the rollout loop: the item, i.e. its tree) go to the same
    engine of a pool (``trace_rl.cluster.pool``), whose prefix cache holds their shared prefix;
    a single engine ignores it."""


@dataclass
class Completion:
    """One sampled continuation."""

    token_ids: list[int]
    logprobs: list[float]  # [len(token_ids)] log-prob of each sampled token under the engine
    text: str
    finish_reason: str  # "stop" | "length"


class Engine(Protocol):
    """A rollout engine. Start-up is paid once per process; weights reload without a restart."""

    name: str

    @property
    def tokenizer(self) -> Any: ...

    def generate(self, requests: Sequence[GenRequest]) -> list[list[Completion]]:
        """Return, per request, ``request.n`` completions."""
        ...

    def load_weights(self, model_dir: str) -> float:
        """Load new policy weights from a saved HF model directory; return seconds taken."""
        ...

    def close(self) -> None: ...


@dataclass
class Ledger:
    """What one rollout (or a sum of rollouts) cost."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    tool_calls: int = 0
    wall_seconds: float = 0.0
    trajectories: int = 0

    def __iadd__(self, other: "Ledger") -> "Ledger":
        self.prompt_tokens += other.prompt_tokens
        self.generated_tokens += other.generated_tokens
        self.tool_calls += other.tool_calls
        self.wall_seconds += other.wall_seconds
        self.trajectories += other.trajectories
        return self


@dataclass
class Turn:
    """One ReAct turn: the policy's text (thought + action) and the observation that followed."""

    gen_ids: list[int]
    gen_logprobs: list[float]
    text: str
    action: Action
    obs_text: str | None  # None on the final turn
    obs_ids: list[int]  # template glue + observation tokens; [] on the final turn
    tool_called: bool = False
    error: bool = False  # the action did not parse, named an unknown tool, or the tool failed


@dataclass
class Episode:
    """A rollout: the prompt, its turns, and the reward once finished."""

    item_id: str
    prompt_ids: list[int]
    turns: list[Turn]
    done: bool = False
    reward: float | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    ledger: Ledger = field(default_factory=Ledger)
    prefix_turns: int = 0  # how many leading turns were replayed from a stored prefix

    def token_ids(self, upto_turn: int | None = None) -> list[int]:
        """The exact token sequence of the prefix holding the first ``upto_turn`` turns."""
        turns = self.turns if upto_turn is None else self.turns[:upto_turn]
        ids = list(self.prompt_ids)
        for t in turns:
            ids += t.gen_ids
            ids += t.obs_ids
        return ids
