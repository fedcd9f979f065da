"""Single-turn grading: BFCL's AST/structural match of calls against ``possible_answer``, the
graders per category kind, and the schema contradictions that make an item unpassable."""

from __future__ import annotations

import copy
import re
from typing import Any, Callable, Mapping, Sequence

from trace_rl.envs.base import TaskItem, Verdict
from trace_rl.envs.bfcl.calls import CallParseError, parse_calls
from trace_rl.envs.bfcl.constants import SINGLE_TURN

# ---- the AST/structural match ----

_PY_TYPES: dict[str, type] = {"string": str, "integer": int, "float": float, "boolean": bool,
                              "array": list, "tuple": list, "dict": dict, "any": str}
_STD = re.compile(r"[ ,./\-_*^]")


def standardize(text: str) -> str:
    """BFCL's string standardisation."""
    return _STD.sub("", text).lower().replace("'", '"')


def _std(value: Any) -> Any:
    return standardize(value) if isinstance(value, str) else value


def _same(value: Any) -> Any:
    return value


Standardise = Callable[[Any], Any]
MATCH_MODES: dict[str, Standardise] = {"bfcl": _std, "exact": _same}
"""How values are compared: ``bfcl`` standardises strings as BFCL does (spaces and ``,./-_*^``
dropped, lower case), so an upper-cased password or ``(5+6)^3`` for ``(5+6)*3`` pass; ``exact``
compares every value as given (the ``exact`` metric, or the reward with ``match="exact"``)."""


def _answer_type(options: Sequence[Any]) -> type | None:
    """Type of the first non-optional acceptable value (the type a variable would carry)."""
    for o in options:
        if o != "":
            return type(o)
    return None


def _type_ok(value: Any, spec: Mapping[str, Any], options: Sequence[Any]) -> tuple[bool, bool]:
    """(type acceptable, value is a variable reference compared exactly)."""
    want = _PY_TYPES.get(spec.get("type", "any"), str)
    alt = _answer_type(options)
    variable = alt is not None and alt is not want
    if type(value) is want:
        if spec.get("type") in ("array", "tuple") and "items" in spec:
            item_spec = spec["items"]
            item_want = _PY_TYPES.get(item_spec.get("type", "any"), str)
            # one level deep, against any list among the acceptable values (BFCL's rule)
            for opt in options:
                if isinstance(opt, list) and all(
                        type(v) is item_want or (_answer_type(opt) is not None
                                                 and type(v) is _answer_type(opt))
                        for v in value):
                    return True, variable
            return not any(isinstance(o, list) for o in options), variable
        return True, variable
    if alt is not None and type(value) is alt:
        return True, True
    return False, False


def _as_list(options: Any) -> list[Any]:
    return options if isinstance(options, list) else [options]


def _dict_ok(value: Mapping[str, Any], options: Sequence[Any], std: Standardise = _std) -> bool:
    for opt in options:
        if not isinstance(opt, Mapping):
            continue
        if any(k not in opt or std(v) not in [std(o) for o in _as_list(opt[k])]
               for k, v in value.items()):
            continue
        if all(k in value or "" in _as_list(acceptable) for k, acceptable in opt.items()):
            return True
    return False


def _value_ok(value: Any, spec: Mapping[str, Any], options: Sequence[Any], variable: bool,
              std: Standardise = _std) -> bool:
    kind = spec.get("type", "any")
    if not variable:
        if kind == "dict":
            return _dict_ok(value, options, std)
        item_kind = (spec.get("items") or {}).get("type")
        if kind in ("array", "tuple") and item_kind == "dict":
            return any(isinstance(opt, list) and len(opt) == len(value)
                       and all(isinstance(v, Mapping) and _dict_ok(v, [o], std)
                               for v, o in zip(value, opt))
                       for opt in options)
        if kind in ("string", "any"):
            return std(value) in [std(o) for o in options if isinstance(o, str)]
        if kind in ("array", "tuple"):
            return [std(v) for v in value] in [[std(o) for o in opt] for opt in options
                                                if isinstance(opt, list)]
    return value in options


def _options(spec: Mapping[str, Any], options: Sequence[Any]) -> Sequence[Any]:
    # Departure: an empty list of acceptable values for an array parameter (live_simple_106-63-0,
    # live_simple_112-68-0) is read as "the empty array"; BFCL's checker rejects every answer.
    if not options and spec.get("type") in ("array", "tuple"):
        return [[]]
    return options


def match_call(doc: Mapping[str, Any], arguments: Mapping[str, Any],
               expected: Mapping[str, Sequence[Any]], std: Standardise = _std) -> str | None:
    """None when ``arguments`` match one acceptable call of ``doc``, else why not."""
    params = doc.get("parameters") or {}
    props: Mapping[str, Any] = params.get("properties") or {}
    for p in params.get("required") or []:
        if p not in arguments:
            return f"missing required parameter {p!r}"
    for p, value in arguments.items():
        if p not in props or p not in expected:
            return f"unexpected parameter {p!r}"
        spec = props[p]
        options = _options(spec, expected[p])
        if spec.get("type") == "float" and type(value) is int:
            value = float(value)
        ok, variable = _type_ok(value, spec, options)
        if not ok:
            return f"parameter {p!r}: wrong type {type(value).__name__} for {spec.get('type')}"
        if not _value_ok(value, spec, options, variable, std):
            return f"parameter {p!r}: {value!r:.60} is not among {options!r:.120}"
    for p, options in expected.items():
        if p not in arguments and "" not in _options(props.get(p, {}), options):
            return f"missing parameter {p!r} (not optional in the possible answer)"
    return None


def _resolve(name: str, docs: Mapping[str, Mapping[str, Any]]) -> str | None:
    if name in docs:
        return name
    dotted = [d for d in docs if "." in d and d.replace(".", "_") == name]
    return dotted[0] if len(dotted) == 1 else None


def match_calls(docs: Sequence[Mapping[str, Any]], calls: Sequence[Mapping[str, Any]],
                ground_truth: Sequence[Mapping[str, Mapping[str, Sequence[Any]]]],
                std: Standardise = _std) -> str | None:
    """None when ``calls`` match ``ground_truth`` one to one in some order, else why not."""
    if len(calls) != len(ground_truth):
        return f"wrong number of calls: {len(calls)}, expected {len(ground_truth)}"
    by_name = {d["name"]: d for d in docs}
    names = [_resolve(c["name"], by_name) for c in calls]
    ok = [[names[i] == next(iter(gt)) and match_call(by_name[names[i]], calls[i]["arguments"],
                                                      next(iter(gt.values())), std) is None
           for gt in ground_truth] for i in range(len(calls))]
    owner: dict[int, int] = {}  # expected index -> call index

    def augment(i: int, seen: set[int]) -> bool:  # Kuhn's augmenting path
        for j in range(len(ground_truth)):
            if ok[i][j] and j not in seen:
                seen.add(j)
                if j not in owner or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    for i in range(len(calls)):
        if not augment(i, set()):
            c = calls[i]
            if names[i] is None:
                return f"call {i}: unknown function {c['name']!r}"
            reasons = [match_call(by_name[names[i]], c["arguments"], next(iter(gt.values())), std)
                       for gt in ground_truth if next(iter(gt)) == names[i]]
            return f"call {i} ({c['name']}): " + ("; ".join(r for r in reasons if r)
                                                  or "no expected call of that function left")
    return None


def _first(options: Sequence[Any]) -> Any:
    for o in options:
        if o != "":
            return copy.deepcopy(o)
    raise ValueError("no non-optional acceptable value")


def _fill(option: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    # a dict parameter's option maps each key to its acceptable values (one level, as BFCL)
    return {k: _first(v) for k, v in option.items() if any(o != "" for o in v)}


def gold_value(spec: Mapping[str, Any], options: Sequence[Any]) -> Any:
    """The first non-optional acceptable value of a parameter, shaped by its schema."""
    options = _options(spec, options)
    value = _first(options)
    kind, item_kind = spec.get("type"), (spec.get("items") or {}).get("type")
    if kind == "dict" and isinstance(value, Mapping):
        return _fill(value)
    if kind in ("array", "tuple") and item_kind == "dict" and isinstance(value, list):
        return [_fill(v) if isinstance(v, Mapping) else v for v in value]
    return value


def gold_calls(docs: Sequence[Mapping[str, Any]],
               ground_truth: Sequence[Mapping[str, Mapping[str, Sequence[Any]]]]) -> list[dict[str, Any]]:
    """One concrete correct call list for a possible answer: every parameter that the schema
    knows and that is not optional-only gets its first acceptable value."""
    by_name = {d["name"]: d for d in docs}
    calls = []
    for gt in ground_truth:
        for name, expected in gt.items():
            props = (by_name[name].get("parameters") or {}).get("properties") or {}
            calls.append({"name": name, "arguments": {
                p: gold_value(props[p], opts) for p, opts in expected.items()
                if p in props and any(o != "" for o in _options(props[p], opts))}})
    return calls


# ---- graders per category kind (one registry, no if-chains) ----

def _grade_match(item: TaskItem, calls: list[dict[str, Any]] | None,
                 std: Standardise = _std) -> tuple[float, str]:
    if calls is None:
        return 0.0, "answer does not parse as calls"
    why = match_calls(item.meta["functions"], calls, item.gold, std)
    return (1.0, "") if why is None else (0.0, why)


def _grade_no_call(item: TaskItem, calls: list[dict[str, Any]] | None,
                   std: Standardise = _std) -> tuple[float, str]:
    return (1.0, "") if not calls else (0.0, "a call was made where none is relevant")


def _grade_some_call(item: TaskItem, calls: list[dict[str, Any]] | None,
                     std: Standardise = _std) -> tuple[float, str]:
    return (1.0, "") if calls else (0.0, "no call was made where one is relevant")


FILE_CATEGORY = "calls_file"
"""Category of an item from a function-calling file of one's own (``load_fncall_file``)."""
GRADERS: dict[str, Callable[..., tuple[float, str]]] = {
    **{c: _grade_match for c in SINGLE_TURN}, FILE_CATEGORY: _grade_match,
    "irrelevance": _grade_no_call, "live_irrelevance": _grade_no_call,
    "live_relevance": _grade_some_call,
}


def grade_single_turn(item: TaskItem, answer: Any, match: str = "bfcl") -> Verdict:
    """Reward by the ``match`` mode (``MATCH_MODES``); both modes are reported as metrics
    (``ast_match`` with BFCL's standardisation, ``exact`` without)."""
    try:
        calls: list[dict[str, Any]] | None = parse_calls(answer)
    except CallParseError:
        calls = None
    grader = GRADERS[item.meta["category"]]
    ast_ok, _why = grader(item, calls, _std)
    exact, _why = grader(item, calls, _same)
    return Verdict(reward=exact if match == "exact" else ast_ok,
                   metrics={"ast_match": ast_ok, "exact": exact,
                            "parsed": float(calls is not None)})



def answer_contradictions(item: TaskItem) -> list[str]:
    """Where a possible answer contradicts its own schema, so that no answer can pass (BFCL's
    checker fails every model there too): a required parameter that may only be omitted, or a
    non-optional expected parameter that the schema does not have."""
    found = []
    by_name = {d["name"]: d for d in item.meta.get("functions", [])}
    for gt in item.gold or []:
        for name, expected in gt.items():
            params = by_name[name].get("parameters") or {}
            props = params.get("properties") or {}
            for p in params.get("required") or []:
                if p in expected and all(o == "" for o in _options(props.get(p, {}), expected[p])):
                    found.append(f"{name}: required {p!r} may only be omitted")
                elif p not in expected:
                    found.append(f"{name}: required {p!r} has no acceptable value")
            for p, opts in expected.items():
                if p not in props and "" not in opts:
                    found.append(f"{name}: expected {p!r} is not in the schema")
    return found
