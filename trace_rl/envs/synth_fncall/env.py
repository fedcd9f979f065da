"""``synth_fncall``: function calling against JSON tool schemas, graded on the final state.

A small home-automation API (lights, thermostats, door locks, speaker volume, reminders) with
typed arguments (string enums, bounded integers, booleans, free strings). Reminders are kept
as a text -> hour map, so the final state does not depend on call order. A task lists d requests
in words ("Turn on the kitchen light. Set the office to 21 degrees."); the agent makes the calls
and then answers (any text, e.g. "done"). Every call is validated against its schema before it
touches the state (bad arguments raise ``ToolError`` and change nothing), which keeps restore-by-
replay exact. The family is stateful: ``restore`` re-runs the stored calls in order.

Difficulty d (1..5): d requests per task, ``min(d + 1, 5)`` functions listed in the prompt (the
unused ones are distractors). Reward: 1 when the final state equals the gold state exactly
(``verify_final``); a call with a wrong value, the wrong function or a missing argument leaves a
different state and scores 0. Call order does not matter, as in BFCL's state-based checking.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Callable, Mapping

from trace_rl.envs.base import Action, TaskItem, ToolError, Verdict
from trace_rl.envs.synthetic import SynthConfig, SyntheticEnv, check_arguments, function_tool, need

ROOMS = ["kitchen", "bedroom", "office", "hall", "garden", "bath"]
DOORS = ["front", "back", "garage"]
CHORES = ["call mom", "buy milk", "water plants", "pay rent", "feed cat"]
FUNCTIONS = [
    function_tool("set_light", "Switch a room's light.",
                  {"room": {"type": "string", "enum": ROOMS}, "on": {"type": "boolean"}}),
    function_tool("set_temperature", "Set a room's thermostat.",
                  {"room": {"type": "string", "enum": ROOMS},
                   "celsius": {"type": "integer", "minimum": 16, "maximum": 28}}),
    function_tool("lock_door", "Lock or unlock a door.",
                  {"door": {"type": "string", "enum": DOORS}, "locked": {"type": "boolean"}}),
    function_tool("set_volume", "Set a room's speaker volume.",
                  {"room": {"type": "string", "enum": ROOMS},
                   "level": {"type": "integer", "minimum": 0, "maximum": 10}}),
    function_tool("add_reminder", "Add a reminder.",
                  {"text": {"type": "string"},
                   "hour": {"type": "integer", "minimum": 0, "maximum": 23}}),
]
_BY_NAME = {f["function"]["name"]: f for f in FUNCTIONS}


def _apply(state: dict[str, Any], name: str, a: Mapping[str, Any]) -> str:
    """Mutate ``state`` with an already-validated call; return the observation."""
    if name == "set_light":
        state["light"][a["room"]] = a["on"]
        return f"{a['room']} light {'on' if a['on'] else 'off'}"
    if name == "set_temperature":
        state["temp"][a["room"]] = a["celsius"]
        return f"{a['room']} set to {a['celsius']}"
    if name == "lock_door":
        state["lock"][a["door"]] = a["locked"]
        return f"{a['door']} door {'locked' if a['locked'] else 'unlocked'}"
    if name == "set_volume":
        state["volume"][a["room"]] = a["level"]
        return f"{a['room']} volume {a['level']}"
    state["reminders"][a["text"]] = a["hour"]
    return f"reminder added: {a['text']} at {a['hour']}"


def _initial_state(rng: random.Random) -> dict[str, Any]:
    return {"light": {r: rng.random() < 0.5 for r in ROOMS},
            "temp": {r: rng.randint(16, 28) for r in ROOMS},
            "lock": {d: rng.random() < 0.5 for d in DOORS},
            "volume": {r: rng.randint(0, 10) for r in ROOMS},
            "reminders": {}}


def _light(rng: random.Random, state: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    room = rng.choice(ROOMS)
    on = not state["light"][room]
    return f"Turn {'on' if on else 'off'} the {room} light.", {"room": room, "on": on}, room


def _temperature(rng: random.Random, state: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    room, celsius = rng.choice(ROOMS), rng.randint(16, 28)
    return f"Set the {room} to {celsius} degrees.", {"room": room, "celsius": celsius}, room


def _lock(rng: random.Random, state: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    door = rng.choice(DOORS)
    locked = not state["lock"][door]
    return f"{'Lock' if locked else 'Unlock'} the {door} door.", {"door": door, "locked": locked}, door


def _volume(rng: random.Random, state: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    room, level = rng.choice(ROOMS), rng.randint(0, 10)
    return f"Set the {room} volume to {level}.", {"room": room, "level": level}, room


def _reminder(rng: random.Random, state: dict[str, Any]) -> tuple[str, dict[str, Any], str]:
    text, hour = rng.choice(CHORES), rng.randint(0, 23)
    return f"Remind me to {text} at {hour}.", {"text": text, "hour": hour}, text


REQUESTS: dict[str, Callable[[random.Random, dict[str, Any]], tuple[str, dict[str, Any], str]]] = {
    "set_light": _light, "set_temperature": _temperature, "lock_door": _lock,
    "set_volume": _volume, "add_reminder": _reminder}
"""Per function: draw (request sentence, gold arguments, the state key it sets)."""


def _request(rng: random.Random, fn: str, state: dict[str, Any],
             used: set[tuple[str, str]]) -> tuple[str, dict[str, Any]] | None:
    """A request that changes ``state`` and sets a key no earlier request of the task set (so no
    call is overwritten); None when 20 draws found none."""
    for _ in range(20):
        sentence, args, key = REQUESTS[fn](rng, state)
        probe = copy.deepcopy(state)
        _apply(probe, fn, args)
        if (fn, key) not in used and probe != state:
            used.add((fn, key))
            return sentence, args
    return None


class SynthFncall(SyntheticEnv):
    family = "synth_fncall"
    stateful = True
    instructions = "Do what the user asks by calling the functions, then answer done."

    def __init__(self, config: SynthConfig | None = None):
        super().__init__(config)
        self.calls = self.config.difficulty
        self.functions = FUNCTIONS[: min(self.config.difficulty + 1, len(FUNCTIONS))]
        self.max_turns = self.calls + 3

    def make_item(self, rng: random.Random, item_id: str) -> TaskItem:
        initial = _initial_state(rng)
        state, used = copy.deepcopy(initial), set()
        sentences, calls = [], []
        while len(calls) < self.calls:
            fn = rng.choice(self.functions)["function"]["name"]
            request = _request(rng, fn, state, used)
            if request is None:
                continue
            sentence, args = request
            _apply(state, fn, args)
            sentences.append(sentence)
            calls.append({"name": fn, "arguments": args})
        return TaskItem(id=item_id, family=self.family, question=" ".join(sentences), gold=state,
                        meta={"initial": initial, "calls": calls})

    def check_item(self, item: TaskItem) -> None:
        keys = {"light", "temp", "lock", "volume", "reminders"}
        for what, value in (("gold", item.gold), ("meta.initial", item.meta.get("initial"))):
            need(isinstance(value, dict) and set(value) == keys,
                 f"{what} must be a state with keys {sorted(keys)}")
        calls = item.meta.get("calls")
        need(isinstance(calls, list) and all(isinstance(c, dict) and c.get("name") in _BY_NAME
                                             and isinstance(c.get("arguments"), dict) for c in calls),
             f"meta.calls must be a list of {{name, arguments}} with names in {sorted(_BY_NAME)}")

    def tools(self) -> list[dict[str, Any]]:
        return list(self.functions)

    def reset(self, item: TaskItem) -> dict[str, Any]:
        return copy.deepcopy(dict(item.meta["initial"]))

    def call_tool(self, state: dict[str, Any], name: str, arguments: Mapping[str, Any]) -> str:
        listed = {f["function"]["name"]: f for f in self.functions}
        if name not in listed:
            raise ToolError(f"unknown tool {name!r}; available: {', '.join(listed)}")
        check_arguments(listed[name], arguments)
        return _apply(state, name, arguments)

    def verify(self, item: TaskItem, answer: Any) -> Verdict:
        raise TypeError("synth_fncall grades the final state: call verify_final(item, state, answer)")

    def verify_final(self, item: TaskItem, state: Any, answer: Any) -> Verdict:
        ok = float(state == item.gold)
        return Verdict(reward=ok, metrics={"state_match": ok})

    def expert_actions(self, item: TaskItem) -> list[Action]:
        return [Action(kind="tool", tool=c["name"], arguments=dict(c["arguments"]))
                for c in item.meta["calls"]] + [Action(kind="answer", answer="done")]
