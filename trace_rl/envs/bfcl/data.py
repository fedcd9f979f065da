"""Loading BFCL v4 category files and function-calling files of one's own into ``TaskItem``s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from trace_rl.envs.base import TaskItem
from trace_rl.envs.bfcl.backends import bfcl_eval_backends
from trace_rl.envs.bfcl.calls import CallParseError, from_json_schema, parse_calls
from trace_rl.envs.bfcl.constants import BFCL_DIR, CATEGORIES, FAMILY, IRRELEVANCE, MULTI_TURN
from trace_rl.envs.bfcl.grader import FILE_CATEGORY
from trace_rl.envs.io import load_jsonl, row_field

# ---- loading ----

def render_messages(messages: Iterable[Mapping[str, Any]]) -> str:
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
    cfg = bfcl_eval_backends()
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
        return TaskItem(id=item_id, family=FAMILY, question=render_messages(turns[0]),
                        gold=answers.get(item_id), meta=meta)

    return load_jsonl(path, parse_row, limit)



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


# ---- the data directory ----

def data_files(data_dir: Path | None) -> list[tuple[Path, str]]:
    """(path under the data directory, split) of every category's question file and, where it
    has one, its possible answers (``BFCLEnv.load``, ``load_bfcl_file``); given ``data_dir``,
    also the function docs its multi-turn rows name."""
    pairs = []
    for category in CATEGORIES:
        name = f"BFCL_v4_{category}.json"
        pairs.append((BFCL_DIR / name, category))
        if category not in IRRELEVANCE:
            pairs.append((BFCL_DIR / "possible_answer" / name, category))
    return pairs + (_doc_files(data_dir) if data_dir is not None else [])


def _doc_files(data_dir: Path) -> list[tuple[Path, str]]:
    """The function docs that the multi-turn rows name (``involved_classes``), read from the
    question file as ``load_bfcl_file`` reads them; none when the file or bfcl-eval (which maps
    a class to its doc file) is missing: the question file is then reported, or loading says
    what to install."""
    try:
        mapping = bfcl_eval_backends().MULTI_TURN_FUNC_DOC_FILE_MAPPING
    except ImportError:
        return []
    pairs = []
    for category in MULTI_TURN:
        question = data_dir / BFCL_DIR / f"BFCL_v4_{category}.json"
        if not question.is_file():
            continue
        with question.open(encoding="utf-8") as fh:
            classes = {c for line in fh if line.strip()
                       for c in json.loads(line).get("involved_classes", [])}
        pairs += [(BFCL_DIR / "multi_turn_func_doc" / mapping[c], category)
                  for c in sorted(classes) if c in mapping]
    return pairs
