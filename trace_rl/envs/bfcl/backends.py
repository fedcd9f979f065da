"""Multi-turn: bfcl-eval's executable backends (file system, messaging, trading, ...), the
ground-truth replay and BFCL's state and response checkers."""

from __future__ import annotations

import copy
import importlib
import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from trace_rl.envs.base import TaskItem, Verdict
from trace_rl.envs.bfcl.calls import parse_python_call
from trace_rl.envs.bfcl.constants import BFCL_EVAL_HINT

# ---- multi-turn: bfcl-eval's executable backends ----

def bfcl_eval_backends() -> Any:
    try:
        return importlib.import_module("bfcl_eval.constants.executable_backend_config")
    except ImportError as exc:
        raise ImportError(f"BFCL multi-turn needs the bfcl-eval package: {BFCL_EVAL_HINT}") from exc


def _format_result(result: Any) -> str:
    """A backend's return value as text, as BFCL's executor renders it."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            return str(result)
    return str(result)


@dataclass
class Backends:
    """Live instances of the item's backend classes and their public methods."""

    instances: dict[str, Any]
    methods: dict[str, Callable[..., Any]]

    @classmethod
    def fresh(cls, item: TaskItem) -> "Backends":
        cfg = bfcl_eval_backends()
        instances, methods = {}, {}
        allowed = {d["name"] for d in item.meta["functions"]}
        for name in item.meta["involved_classes"]:
            module = importlib.import_module(cfg.CLASS_FILE_PATH_MAPPING[name])
            instance = getattr(module, name)()
            if name not in cfg.STATELESS_CLASSES:
                instance._load_scenario(copy.deepcopy(item.meta["initial_config"].get(name, {})),
                                        long_context=False)
            instances[name] = instance
            for mname, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not mname.startswith("_") and mname in allowed:
                    methods[mname] = method
        return cls(instances, methods)

    def execute(self, name: str, arguments: Mapping[str, Any]) -> str:
        """Run one call; errors become BFCL-style error text (they are observations)."""
        method = self.methods.get(name)
        if method is None:
            return f"Error during execution: function {name!r} is not available"
        try:
            # a copy: some backends mutate list arguments, which would rewrite the stored call
            return _format_result(method(**copy.deepcopy(dict(arguments))))
        except Exception as exc:  # the backend's complaint is the agent's observation
            return f"Error during execution: {exc}"

    def public_state(self) -> dict[str, dict[str, Any]]:
        """Deep copy of each instance's public attributes (what BFCL's state check compares)."""
        return {n: copy.deepcopy({k: v for k, v in vars(i).items() if not k.startswith("_")})
                for n, i in self.instances.items()}


def gt_call(item_functions: Mapping[str, Mapping[str, Any]], text: str) -> dict[str, Any]:
    """A ground-truth call string (``sort('a.pdf')``) as ``{"name", "arguments"}``, with
    positional arguments named after the schema's parameter order."""
    name, args, kwargs = parse_python_call(text)
    if args:
        doc = item_functions.get(name)
        if doc is None:
            raise ValueError(f"ground-truth call {text!r} names an unknown function")
        order = list((doc.get("parameters") or {}).get("properties") or {})
        if len(args) > len(order):
            raise ValueError(f"ground-truth call {text!r} has too many positional arguments")
        kwargs = {**dict(zip(order, args)), **kwargs}
    return {"name": name, "arguments": kwargs}


def grade_multi_turn(item: TaskItem, turns: Sequence[Sequence[Mapping[str, Any]]]) -> Verdict:
    """BFCL's multi-turn check: after every user turn, the model's backends must equal the
    ground truth's (public attributes) and the model's results so far must contain the ground
    truth's results of that turn; each turn with expected calls needs at least one call."""
    checker = importlib.import_module(
        "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker")
    gt_turns = item.gold
    if len(turns) != len(gt_turns):
        return Verdict(0.0, {"turns_ok": 0.0, "state_match": 0.0})
    model, truth = Backends.fresh(item), Backends.fresh(item)
    docs = {d["name"]: d for d in item.meta["functions"]}
    all_results: list[str] = []
    for k, (calls, expected) in enumerate(zip(turns, gt_turns)):
        all_results += [model.execute(c["name"], c.get("arguments") or {}) for c in calls]
        gt_results = [truth.execute(**gt_call(docs, s)) for s in expected]
        if not expected:
            continue
        if not calls:
            return Verdict(0.0, {"turns_ok": k / len(gt_turns), "state_match": 0.0})
        if not checker.state_checker(model.instances, truth.instances)["valid"]:
            return Verdict(0.0, {"turns_ok": k / len(gt_turns), "state_match": 0.0})
        if not checker.response_checker(all_results, gt_results, k)["valid"]:
            return Verdict(0.0, {"turns_ok": k / len(gt_turns), "state_match": 1.0})
    return Verdict(1.0, {"turns_ok": 1.0, "state_match": 1.0})


@dataclass
class MultiTurnState:
    """A multi-turn episode's state: live backends, the current user turn, the calls per turn."""

    backends: Backends
    user_turns: list[list[Mapping[str, Any]]]
    turn: int = 0
    calls: list[list[dict[str, Any]]] = field(default_factory=lambda: [[]])
