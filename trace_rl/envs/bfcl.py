"""Function calling on BFCL v4 (../shared/data/function_calling/bfcl), plus a generic adapter that
turns any OpenAI-style tool list and Python callables into an environment.

Single-turn categories (simple_python, multiple, parallel, parallel_multiple and their live_*
versions) are graded by an AST/structural match against ``possible_answer``, with BFCL's rules,
re-implemented here:

* the call count must match; parallel calls match in any order (an exact bipartite matching,
  where BFCL matches greedily: a strict improvement that only differs when one call could match
  several expected ones);
* the function name must match (a dotted name may be written with ``_`` for ``.``, as
  OpenAI-style names cannot hold dots, unless that spelling names another listed function);
* required parameters present, no parameter outside the schema or the possible answer, and every
  possible-answer parameter present unless ``""`` is among its acceptable values (optional);
* types per the schema: ``float`` accepts an int, ``tuple`` a list, ``any`` means string, a bool
  is never an int; a value of the possible answer's own type is accepted as a variable reference
  and then compared exactly; arrays are type-checked one level deep;
* values: one of the acceptable values; strings compared after BFCL's standardisation (drop
  spaces and ``,./-_*^``, lower case, ``'`` -> ``"``), also inside lists and dicts; dicts key by
  key (missing keys allowed when ``""`` is acceptable for them); lists of dicts element-wise.

Irrelevance categories (irrelevance, live_irrelevance): correct when the answer holds no call
(an answer that does not parse as calls counts as no call, as in BFCL). live_relevance: correct
when at least one call parses.

**Answer representation (single turn).** One turn, ending with ``<answer>`` holding the calls:
a JSON list of ``{"name": ..., "arguments": {...}}`` (``[]`` for no call), or BFCL's Python
syntax ``[f(a=1), g(b='x')]``. The prediction file of ``trace score`` may give ``calls`` as that
list directly.

**Multi-turn (multi_turn_base).** The item's user turns arrive one by one: the agent makes
``<tool_call>`` turns, executed on the bfcl-eval package's simulated backends (file system,
messaging, trading, travel, ...), ends each user turn by calling the extra tool
``next_request()`` (its observation is the next user message), and ends the episode with
``<answer>`` after the last one (an answer always ends an episode in the ReAct loop). The family is
stateful: the state at a prefix is the initial configuration plus a replay of the stored tool
calls (``restore``); backends are seeded, so a replay reproduces the live state exactly. Grading (``verify_final``) re-executes the
calls made in each user turn, and the ground truth's, on fresh backends and applies bfcl-eval's
own ``state_checker`` and ``response_checker`` after each turn (BFCL's multi-turn checker, minus
its module-global instance cache). For ``trace score`` a multi-turn prediction gives ``calls`` as
a list with one list of calls per user turn.

bfcl-eval pins numpy 1.26 and pulls in API clients, so it is installed with
``pip install --no-deps bfcl-eval==2026.3.23``: the backends need only the standard library and
mpmath. Single-turn grading does not need it.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import jsonschema

from trace_rl.envs.base import Action, Environment, TaskItem, ToolError, Verdict, parse_expression
from trace_rl.envs.datadir import default_data_dir
from trace_rl.envs.io import load_jsonl, row_field, split_path
from trace_rl.envs.prompt import system_prompt

FAMILY = "bfcl"
BFCL_DIR = Path("function_calling") / "bfcl"
SINGLE_TURN = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple",
               "live_multiple", "live_parallel", "live_parallel_multiple")
IRRELEVANCE = ("irrelevance", "live_irrelevance", "live_relevance")
MULTI_TURN = ("multi_turn_base",)
CATEGORIES = SINGLE_TURN + IRRELEVANCE + MULTI_TURN
BFCL_EVAL_HINT = "pip install --no-deps bfcl-eval==2026.3.23"


# ---- schemas: BFCL function docs -> OpenAI function format ----

_TYPE_TO_JSON = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def _retype(schema: Mapping[str, Any], types: Mapping[str, str | None]) -> dict[str, Any]:
    """``schema`` with each ``type`` renamed by ``types`` (None: no type), recursively."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "type":
            mapped = types.get(value, value)
            if mapped is not None:
                out["type"] = mapped
        elif key == "properties" and isinstance(value, Mapping):
            out["properties"] = {k: _retype(v, types) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, Mapping):
            out[key] = _retype(value, types)
        else:
            out[key] = copy.deepcopy(value)
    return out


def to_json_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A BFCL parameter schema in JSON Schema terms (``dict`` -> ``object``, ``float`` ->
    ``number``, ``tuple`` -> ``array``, ``any`` -> no type), recursively."""
    return _retype(schema, _TYPE_TO_JSON)


def openai_tool(doc: Mapping[str, Any]) -> dict[str, Any]:
    """One BFCL function doc as an OpenAI tool: ``{"type": "function", "function": {...}}``."""
    params = to_json_schema(doc.get("parameters") or {"type": "dict", "properties": {}})
    return {"type": "function", "function": {"name": doc["name"],
                                             "description": doc.get("description", ""),
                                             "parameters": params}}


# ---- calls: parsing an answer ----

class CallParseError(ValueError):
    """An answer that cannot be read as a list of calls."""


def _literal(node: ast.AST) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError as exc:
        raise CallParseError(f"argument {ast.unparse(node)!r} is not a literal") from exc


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise CallParseError(f"{ast.unparse(node)!r} is not a function name")


def parse_python_call(text: str) -> tuple[str, list[Any], dict[str, Any]]:
    """``f(1, b='x')`` -> ("f", [1], {"b": "x"}); only literal arguments."""
    try:
        node = parse_expression(text.strip()).body
    except SyntaxError as exc:
        raise CallParseError(f"not a Python call: {text!r:.80}") from exc
    if not isinstance(node, ast.Call):
        raise CallParseError(f"not a Python call: {text!r:.80}")
    kwargs = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise CallParseError("**kwargs are not allowed in a call")
        kwargs[kw.arg] = _literal(kw.value)
    return _dotted(node.func), [_literal(a) for a in node.args], kwargs


def _call_dict(obj: Any) -> dict[str, Any]:
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
        raise CallParseError(f"a call must be an object with a string 'name', got {obj!r:.80}")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI's wire format keeps arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise CallParseError(f"arguments of {obj['name']} are not JSON") from exc
    if not isinstance(args, Mapping):
        raise CallParseError(f"arguments of {obj['name']} must be an object")
    extra = set(obj) - {"name", "arguments"}
    if extra:
        raise CallParseError(f"unexpected keys {sorted(extra)} in a call")
    return {"name": obj["name"], "arguments": dict(args)}


def parse_calls(answer: Any) -> list[dict[str, Any]]:
    """The calls in a final answer: a list of ``{"name", "arguments"}`` (or one such object), as
    Python objects or JSON text, or BFCL's Python syntax ``[f(a=1), g(b=2)]``. Empty -> []."""
    if answer is None:
        return []
    if isinstance(answer, Mapping):
        return [_call_dict(answer)]
    if isinstance(answer, (list, tuple)):
        return [_call_dict(c) for c in answer]
    text = str(answer).strip()
    if text.startswith("```"):
        text = re.sub(r"^```\w*\s*|\s*```$", "", text)
    if not text:
        return []
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        pass
    else:  # a JSON number, string or null is no call list (and re-parsing it would never end)
        if not isinstance(parsed, (Mapping, list)):
            raise CallParseError(f"a JSON {type(parsed).__name__} is not a call list: {text!r:.80}")
        return parse_calls(parsed)
    try:
        node = parse_expression(text).body
    except SyntaxError as exc:
        raise CallParseError(f"neither JSON calls nor Python calls: {text!r:.80}") from exc
    nodes = node.elts if isinstance(node, (ast.List, ast.Tuple)) else [node]
    calls = []
    for n in nodes:
        name, args, kwargs = parse_python_call(ast.unparse(n))
        if args:
            raise CallParseError(f"{name}: use keyword arguments")
        calls.append({"name": name, "arguments": kwargs})
    return calls


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


# ---- multi-turn: bfcl-eval's executable backends ----

def _bfcl_eval() -> Any:
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
        cfg = _bfcl_eval()
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


# ---- loading ----

def _render_messages(messages: Iterable[Mapping[str, Any]]) -> str:
    parts = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"message content must be a string, got {type(content).__name__}")
        parts.append(content if role == "user" else f"[{role}] {content}")
    return "\n".join(parts)


def category_of(path: Path) -> str:
    stem = path.stem
    return stem.split("_v4_", 1)[1] if "_v4_" in stem else stem


def _multi_turn_docs(bfcl_dir: Path, classes: Sequence[str], excluded: Sequence[str]) -> list[dict]:
    cfg = _bfcl_eval()
    docs = []
    for c in classes:
        path = bfcl_dir / "multi_turn_func_doc" / cfg.MULTI_TURN_FUNC_DOC_FILE_MAPPING[c]
        docs += [d for d in load_jsonl(path, dict) if d["name"] not in excluded]
    return docs


def load_bfcl_file(path: str | Path, limit: int | None = None) -> list[TaskItem]:
    """Items of one BFCL question file; the possible answers come from the ``possible_answer/``
    file of the same name when the category has them. Ids are BFCL's own ``id``."""
    path = Path(path)
    category = category_of(path)
    if category not in CATEGORIES:
        raise ValueError(f"{path}: unknown BFCL category {category!r}; known: {', '.join(CATEGORIES)}")
    answers: dict[str, Any] = {}
    if category not in IRRELEVANCE:
        answer_path = path.parent / "possible_answer" / path.name
        for row in load_jsonl(answer_path, lambda r: (row_field(r, "id", str),
                                                      row_field(r, "ground_truth", list))):
            answers[row[0]] = row[1]
    bfcl_dir = path.parent

    def parse_row(row: dict[str, Any]) -> TaskItem:
        item_id = row_field(row, "id", str)
        turns = row_field(row, "question", list)
        if category not in IRRELEVANCE and item_id not in answers:
            raise ValueError(f"id {item_id!r} has no possible answer in possible_answer/{path.name}")
        meta: dict[str, Any] = {"category": category, "turns": turns}
        if category in MULTI_TURN:
            classes = row_field(row, "involved_classes", list)
            meta.update(involved_classes=classes,
                        initial_config=row_field(row, "initial_config", dict),
                        functions=_multi_turn_docs(bfcl_dir, classes,
                                                   row.get("excluded_function") or []))
        else:
            if len(turns) != 1:
                raise ValueError(f"single-turn item {item_id!r} has {len(turns)} turns")
            meta["functions"] = row_field(row, "function", list)
        return TaskItem(id=item_id, family=FAMILY, question=_render_messages(turns[0]),
                        gold=answers.get(item_id), meta=meta)

    return load_jsonl(path, parse_row, limit)


_JSON_TO_BFCL = {"object": "dict", "number": "float"}


def from_json_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON Schema in BFCL's terms (``object`` -> ``dict``, ``number`` -> ``float``),
    recursively: the inverse of ``to_json_schema`` for the types both know."""
    return _retype(schema, _JSON_TO_BFCL)


def _file_tool(tool: Any, where: str) -> dict[str, Any]:
    """A tool of a function-calling file (OpenAI ``{"type": "function", "function": {...}}`` or a
    bare ``{name, description, parameters}``) as a BFCL function doc."""
    if not isinstance(tool, Mapping):
        raise ValueError(f"{where} must be an object, got {type(tool).__name__}")
    fn = tool.get("function", tool)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where} needs a string 'name' (or 'function': {{'name': ...}})")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise ValueError(f"{where}.parameters must be an object (a JSON Schema)")
    return {"name": fn["name"], "description": str(fn.get("description", "")),
            "parameters": from_json_schema(params)}


def _fncall_row(row: dict[str, Any]) -> TaskItem:
    """One row of a function-calling file: ``id``, ``tools``, ``request`` (or ``question``) and
    ``expected`` (one call or a list of calls ``{"name", "arguments"}``; ``[]`` = no call)."""
    item_id = str(row_field(row, "id", (str, int)))
    tools = row_field(row, "tools", list)
    if not tools:
        raise ValueError("field 'tools' is empty")
    docs = [_file_tool(t, f"tools[{k}]") for k, t in enumerate(tools)]
    request = row_field(row, "request" if "request" in row else "question", str)
    expected = row_field(row, "expected", (list, dict))
    try:
        calls = parse_calls(expected)
    except CallParseError as exc:
        raise ValueError(f"field 'expected': {exc}") from None
    names = {d["name"] for d in docs}
    for k, c in enumerate(calls):
        if c["name"] not in names:
            raise ValueError(f"expected[{k}]: function {c['name']!r} is not among the tools "
                             f"({', '.join(sorted(names))})")
    gold = [{c["name"]: {p: [v] for p, v in c["arguments"].items()}} for c in calls]
    return TaskItem(id=item_id, family=FAMILY, question=request, gold=gold,
                    meta={"category": FILE_CATEGORY, "turns": [[{"role": "user",
                                                                 "content": request}]],
                          "functions": docs})


def load_fncall_file(path: str | Path, limit: int | None = None) -> list[TaskItem]:
    """Items of a function-calling file of one's own (JSONL, ``_fncall_row``), graded by the
    same AST match as BFCL's single-turn categories (each expected value is the one acceptable
    value; an argument the expected call does not give must be left out)."""
    return load_jsonl(path, _fncall_row, limit)


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
            return _render_messages(state.user_turns[state.turn])
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
