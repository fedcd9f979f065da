"""A generic environment from any OpenAI-style tool list and Python callables."""

from __future__ import annotations

import inspect
import json
from typing import Any, Callable, Mapping, Sequence

import jsonschema

from trace_rl.envs.base import Environment, TaskItem, ToolError, Verdict
from trace_rl.envs.prompt import system_prompt

# ---- generic adapter: any OpenAI-style tool list + Python callables ----

class ToolkitEnv(Environment):
    """An environment from OpenAI-style tools and Python callables.

    ``tools`` are ``{"type": "function", "function": {name, description, parameters}}``; each
    call's arguments are validated against its JSON schema (``jsonschema``) before the callable
    runs with them as keyword arguments; a dict/list result is returned as JSON. ``items`` and
    ``grader(item, answer) -> Verdict`` define the task. The state is a dict the callables may
    receive as ``state=`` when their signature has that parameter; restore replays the calls.
    """

    def __init__(self, family: str, tools: Sequence[Mapping[str, Any]],
                 functions: Mapping[str, Callable[..., Any]], items: Sequence[TaskItem],
                 grader: Callable[[TaskItem, Any], Verdict], instructions: str = "",
                 max_turns: int = 6):
        names = [t["function"]["name"] for t in tools]
        missing = sorted(set(names) - set(functions))
        if missing:
            raise ValueError(f"ToolkitEnv: no callable for tools {missing}")
        for t in tools:
            jsonschema.Draft202012Validator.check_schema(t["function"].get("parameters") or {})
        self.family, self.max_turns = family, max_turns
        self.stateful = any("state" in inspect.signature(f).parameters for f in functions.values())
        self._tools, self._functions = [dict(t) for t in tools], dict(functions)
        self._items, self._grader, self._instructions = list(items), grader, instructions

    def load(self, split: str, limit: int | None = None) -> list[TaskItem]:
        return [it for it in self._items if split in ("all", it.meta.get("split", "all"))][:limit]

    def tools(self) -> list[dict[str, Any]]:
        return self._tools

    def system_prompt(self) -> str:
        return system_prompt(self._instructions, self._tools)

    def reset(self, item: TaskItem) -> dict[str, Any]:
        return {"item": item}

    def call_tool(self, state: Any, name: str, arguments: Mapping[str, Any]) -> str:
        tool = next((t for t in self._tools if t["function"]["name"] == name), None)
        if tool is None:
            raise ToolError(f"unknown tool {name!r}; available: {', '.join(self._functions)}")
        schema = tool["function"].get("parameters") or {"type": "object"}
        try:
            jsonschema.validate(dict(arguments), schema)
        except jsonschema.ValidationError as exc:
            where = "/".join(map(str, exc.absolute_path)) or "arguments"
            raise ToolError(f"{name}: {where}: {exc.message}") from exc
        fn = self._functions[name]
        kwargs = dict(arguments)
        if "state" in inspect.signature(fn).parameters:
            kwargs["state"] = state
        result = fn(**kwargs)
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False,
                                                                 default=str)

    def verify(self, item: TaskItem, answer: Any) -> Verdict:
        return self._grader(item, answer)
