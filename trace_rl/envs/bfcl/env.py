"""The BFCL environment: single-turn categories answered with calls, multi-turn ones played on
the simulated backends."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from trace_rl.envs.base import Action, Environment, TaskItem, ToolError, Verdict
from trace_rl.envs.bfcl.backends import (
    Backends,
    MultiTurnState,
    grade_multi_turn,
    gt_call,
)
from trace_rl.envs.bfcl.calls import CallParseError, openai_tool, parse_calls
from trace_rl.envs.bfcl.constants import BFCL_DIR, CATEGORIES, FAMILY, MULTI_TURN, SINGLE_TURN
from trace_rl.envs.bfcl.data import category_of, load_bfcl_file, load_fncall_file, render_messages
from trace_rl.envs.bfcl.grader import MATCH_MODES, gold_calls, grade_single_turn
from trace_rl.envs.datadir import default_data_dir
from trace_rl.envs.io import split_path
from trace_rl.envs.prompt import system_prompt

# ---- the environments ----

INSTRUCTIONS_SINGLE = (
    "You are given functions (JSON schemas) and a request. Reply in one turn with "
    "<answer>[{\"name\": ..., \"arguments\": {...}}, ...]</answer> holding every call that the "
    "request needs (several calls when it asks for several), or <answer>[]</answer> when no "
    "listed function fits.")
INSTRUCTIONS_MULTI = (
    "You operate the listed tools for a user over several requests. Call tools with "
    "<tool_call>; when a request is done, call next_request to get the next one; after the "
    "last request, reply <answer>done</answer>.")
NEXT_REQUEST = "next_request"
NEXT_REQUEST_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": NEXT_REQUEST, "description": "Finish the current request and receive the user's next "
    "one.", "parameters": {"type": "object", "properties": {}}}}


@dataclass(frozen=True)
class BFCLConfig:
    """How the BFCL family loads and runs."""

    data_dir: Path | None = None
    """Data root holding ``function_calling/bfcl``; None: ``$TRACE_DATA_DIR`` or ../shared/data."""
    match: str = "bfcl"
    """Single-turn reward: ``bfcl`` (BFCL's string standardisation) or ``exact`` (values as
    given: no lower-casing, no dropped characters); both are reported as metrics."""
    max_turns: int = 24
    """Turn cap; a single-turn item ends at its first answer; a multi-turn item's gold solution
    takes one turn per call, one ``next_request`` per later user turn and the answer (at most
    16 in multi_turn_base)."""

    def __post_init__(self) -> None:
        if self.match not in MATCH_MODES:
            raise ValueError(f"BFCLConfig.match={self.match!r}: use one of {sorted(MATCH_MODES)}")


class BFCLEnv(Environment):
    """BFCL v4: single-turn AST match, irrelevance, and stateful multi-turn on bfcl-eval."""

    family = FAMILY
    stateful = True

    def __init__(self, config: BFCLConfig | None = None, **kwargs: Any):
        self.config = config or BFCLConfig(**kwargs)
        self.max_turns = self.config.max_turns
        self.data_dir = Path(self.config.data_dir or default_data_dir())

    def load(self, split: str, limit: int | None = None) -> list[TaskItem]:
        """A category name (``simple_python``, ``live_irrelevance``, ``multi_turn_base``, ...),
        ``single_turn`` (all AST categories), or a question file's path."""
        folder = self.data_dir / BFCL_DIR
        if split == "single_turn":
            return [it for c in SINGLE_TURN for it in self.load(c)][:limit]
        if split in CATEGORIES:
            return load_bfcl_file(folder / f"BFCL_v4_{split}.json", limit)
        path = split_path(FAMILY, split, ("single_turn",) + CATEGORIES)
        if category_of(path) in CATEGORIES:  # a BFCL question file beside possible_answer/
            return load_bfcl_file(path, limit)
        return load_fncall_file(path, limit)

    def tools(self) -> list[dict[str, Any]]:
        return []  # every item brings its own functions; see user_prompt / item_tools

    def item_tools(self, item: TaskItem) -> list[dict[str, Any]]:
        """The item's functions in the OpenAI format (plus ``next_request`` in multi-turn)."""
        tools = [openai_tool(d) for d in item.meta["functions"]]
        return tools + ([NEXT_REQUEST_TOOL] if item.meta["category"] in MULTI_TURN else [])

    def system_prompt(self) -> str:
        return system_prompt(INSTRUCTIONS_SINGLE + " " + INSTRUCTIONS_MULTI.replace(
            "You operate", "In multi-turn tasks you operate"), [])

    def user_prompt(self, item: TaskItem) -> str:
        functions = "\n".join(json.dumps(t["function"], ensure_ascii=False, separators=(",", ":"))
                              for t in self.item_tools(item))
        how = INSTRUCTIONS_MULTI if item.meta["category"] in MULTI_TURN else INSTRUCTIONS_SINGLE
        return f"{how}\nFunctions:\n{functions}\n\nRequest:\n{item.question}"

    def reset(self, item: TaskItem) -> MultiTurnState | None:
        if item.meta["category"] not in MULTI_TURN:
            return None  # single-turn: nothing is executed
        return MultiTurnState(backends=Backends.fresh(item), user_turns=list(item.meta["turns"]))

    def call_tool(self, state: Any, name: str, arguments: Mapping[str, Any]) -> str:
        if state is None:
            raise ToolError("single-turn BFCL executes nothing: write the calls in <answer>")
        if name == NEXT_REQUEST:
            if arguments:
                raise ToolError(f"{NEXT_REQUEST} takes no arguments")
            if state.turn + 1 >= len(state.user_turns):
                return "All requests are done. Reply with <answer>done</answer>."
            state.turn += 1
            state.calls.append([])
            return render_messages(state.user_turns[state.turn])
        if name not in state.backends.methods:
            raise ToolError(f"unknown tool {name!r}")
        state.calls[state.turn].append({"name": name, "arguments": copy.deepcopy(dict(arguments))})
        return state.backends.execute(name, arguments)

    def verify(self, item: TaskItem, answer: Any) -> Verdict:
        """Single turn: ``answer`` holds the calls. Multi-turn: ``answer`` is the list of calls
        per user turn (the ``calls`` of a ``trace score`` prediction)."""
        if item.meta["category"] in MULTI_TURN:
            try:
                turns = answer if isinstance(answer, list) else json.loads(str(answer))
                turns = [parse_calls(t) for t in turns]
            except (CallParseError, json.JSONDecodeError, TypeError):
                return Verdict(0.0, {"turns_ok": 0.0, "state_match": 0.0})
            return grade_multi_turn(item, turns)
        return grade_single_turn(item, answer, self.config.match)

    def verify_final(self, item: TaskItem, state: Any, answer: Any) -> Verdict:
        if item.meta["category"] in MULTI_TURN:
            return grade_multi_turn(item, state.calls)
        return grade_single_turn(item, answer, self.config.match)

    def expert_actions(self, item: TaskItem) -> list[Action]:
        if item.meta["category"] in MULTI_TURN:
            docs = {d["name"]: d for d in item.meta["functions"]}
            actions = []
            for k, turn in enumerate(item.gold):
                if k:
                    actions.append(Action(kind="tool", tool=NEXT_REQUEST, arguments={}))
                actions += [Action(kind="tool", tool=c["name"], arguments=c["arguments"])
                            for c in (gt_call(docs, s) for s in turn)]
            return actions + [Action(kind="answer", answer="done")]
        calls = gold_calls(item.meta["functions"], item.gold) if item.gold is not None else []
        if item.meta["category"] == "live_relevance":
            doc = item.meta["functions"][0]
            calls = [{"name": doc["name"], "arguments": {}}]
        return [Action(kind="answer", answer=json.dumps(calls, ensure_ascii=False))]
