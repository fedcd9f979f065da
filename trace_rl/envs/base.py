"""The environment protocol.

An environment is one task family: a loader for its items, tools in the OpenAI function-schema
format, a prompt, a verifier, and a way to rebuild its state at any turn-level prefix by replaying
stored actions. The ReAct loop (``trace_rl.rollout.react``) drives it; nothing here knows about
engines or tokens.
"""

from __future__ import annotations

import abc
import ast
import threading
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence


@dataclass(frozen=True)
class Action:
    """A parsed agent action."""

    kind: Literal["tool", "answer", "invalid"]
    tool: str | None = None
    arguments: Mapping[str, Any] | None = None
    answer: Any = None
    error: str | None = None  # why an "invalid" action did not parse

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "tool": self.tool, "arguments": dict(self.arguments or {}) or None,
                "answer": self.answer, "error": self.error}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Action":
        return cls(kind=d["kind"], tool=d.get("tool"), arguments=d.get("arguments"),
                   answer=d.get("answer"), error=d.get("error"))


@dataclass(frozen=True)
class Verdict:
    """The verifier's word on a final answer: reward in {0, 1} plus reported metrics (EM, F1...)."""

    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)


_PARSE_LOCK = threading.RLock()


def parse_expression(text: str) -> ast.Expression:
    """``ast.parse(text, mode="eval")`` under a process-wide lock.

    The ReAct loop runs tool calls on threads (``trace_rl.rollout.react.run_steps``). CPython 3.11
    keeps the AST converter's recursion depth in interpreter-wide state, so a parse interrupted by
    a thread switch (a garbage collection running a finaliser mid-parse is enough) while another
    thread parses can raise ``SystemError: AST constructor recursion depth mismatch``: a valid
    calculator call then came back as an error observation (1 in ~36,000 calls over four
    learning-benchmark runs). Serialising the parse costs microseconds per call.
    """
    with _PARSE_LOCK:
        return ast.parse(text, mode="eval")


class ToolError(Exception):
    """A tool call that cannot run (bad arguments, unknown tool): becomes an error observation."""


class DatasetError(ValueError):
    """A malformed dataset row; the message names the file and the line."""

    def __init__(self, path: str, line: int, why: str):
        super().__init__(f"{path}:{line}: {why}")
        self.path, self.line, self.why = path, line, why


@dataclass(frozen=True)
class TaskItem:
    """One task instance. ``gold`` and ``meta`` are JSON-serialisable, so an item round-trips
    through DuckDB and Prefect task results."""

    id: str
    family: str
    question: str
    gold: Any
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    """What the environment says after one action."""

    observation: str | None  # None when the episode is over
    done: bool
    tool_called: bool = False
    error: bool = False


class Environment(abc.ABC):
    """One task family. Subclasses implement the abstract methods; ``step`` and ``restore`` have
    the ReAct defaults (a tool call gives an observation, an answer ends the episode)."""

    family: str = ""
    stateful: bool = False
    """True when tool calls mutate the state, so a restore must re-run them in order."""
    max_turns: int = 6
    """Default turn cap for this family."""

    @abc.abstractmethod
    def load(self, split: str, limit: int | None = None) -> list[TaskItem]:
        """Items of a split (``train``/``test`` or a file path, per family)."""

    @abc.abstractmethod
    def tools(self) -> list[dict[str, Any]]:
        """The tool list in the OpenAI function format: ``{"type": "function", "function": {...}}``."""

    @abc.abstractmethod
    def system_prompt(self) -> str:
        """Instructions, including the turn format and the tools."""

    def user_prompt(self, item: TaskItem) -> str:
        return item.question

    def oracle_success(self, item: TaskItem) -> float | None:
        """What the item's hidden structure allows a competent agent, in [0, 1] (a ranking of
        prompts no text predictor is given), or None where the family knows none. Read by
        ``TrainConfig.root_oracle`` (an upper reference for Stage 1's predictor)."""
        return None

    def turn_cap(self, item: TaskItem) -> int | None:
        """This item's own turn cap, or None for the loop's cap alone. The ReAct loop ends an
        episode at the smaller of the two (``synth_chain``: hops + 3)."""
        return None

    @abc.abstractmethod
    def reset(self, item: TaskItem) -> Any:
        """A fresh state for ``item``."""

    @abc.abstractmethod
    def call_tool(self, state: Any, name: str, arguments: Mapping[str, Any]) -> str:
        """Run a tool and return its observation text. Raise ``ToolError`` for an unknown tool
        or bad arguments (the loop turns any exception into an error observation)."""

    @abc.abstractmethod
    def verify(self, item: TaskItem, answer: Any) -> Verdict:
        """Grade a final answer: reward in {0, 1}, plus metrics."""

    def verify_final(self, item: TaskItem, state: Any, answer: Any) -> Verdict:
        """Grade an episode that ended with ``answer`` in ``state`` (what the ReAct loop calls).
        Stateless families grade the answer alone; stateful ones (function calling) override this
        to check the final state as well."""
        return self.verify(item, answer)

    def expert_actions(self, item: TaskItem) -> Sequence[Action]:
        """A gold action sequence for ``item`` (used for SFT traces and tests)."""
        raise NotImplementedError(f"{type(self).__name__} has no expert solver")

    def step(self, state: Any, action: Action) -> StepResult:
        """Apply one action. Exceptions from tools become error observations, never crashes."""
        if action.kind == "answer":
            return StepResult(observation=None, done=True)
        if action.kind == "invalid":
            return StepResult(observation=f"Error: {action.error}", done=False, error=True)
        try:
            obs = self.call_tool(state, action.tool or "", dict(action.arguments or {}))
            return StepResult(observation=obs, done=False, tool_called=True)
        except Exception as exc:  # a tool's failure is the agent's observation, not our crash
            return StepResult(observation=f"Error: {type(exc).__name__}: {exc}", done=False,
                              tool_called=True, error=True)

    def restore(self, item: TaskItem, actions: Sequence[Action],
                observations: Sequence[str | None]) -> Any:
        """Rebuild the state after ``actions``. A stateless family only needs a fresh state (its
        stored observations are reused); a stateful one re-runs each tool call in order."""
        state = self.reset(item)
        if self.stateful:
            for a in actions:
                if a.kind == "tool":
                    self.step(state, a)
        return state
