"""BFCL function docs as OpenAI tools and JSON schemas, and an answer parsed into calls (JSON or
BFCL's Python syntax)."""

from __future__ import annotations

import ast
import copy
import json
import re
from typing import Any, Mapping

from trace_rl.envs.base import parse_expression

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


_JSON_TO_BFCL = {"object": "dict", "number": "float"}


def from_json_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON Schema in BFCL's terms (``object`` -> ``dict``, ``number`` -> ``float``),
    recursively: the inverse of ``to_json_schema`` for the types both know."""
    return _retype(schema, _JSON_TO_BFCL)
