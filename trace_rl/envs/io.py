"""Dataset file helpers shared by every task family.

``load_jsonl`` reads one JSON object per line and hands each to a family's ``parse_row``; any
malformed line (bad JSON, not an object, a missing or mistyped field) becomes a ``DatasetError``
that names the file and the 1-based line number, so a broken row is found without a debugger.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, TypeVar

from trace_rl.envs.base import DatasetError, TaskItem

T = TypeVar("T")

_TYPE_NAMES: dict[type, str] = {str: "a string", int: "an integer", float: "a number",
                                bool: "a boolean", list: "a list", dict: "an object"}


def row_field(row: Mapping[str, Any], key: str, typ: type | tuple[type, ...] = object,
          *, default: Any = ...) -> Any:
    """``row[key]`` checked against ``typ``; raises ``ValueError`` saying which field is wrong.

    ``bool`` is not accepted where ``int`` is asked for (JSON ``true`` is not a count). With a
    ``default``, a missing key (or JSON null) gives the default instead of an error.
    """
    if key not in row or row[key] is None:
        if default is not ...:
            return default
        raise ValueError(f"missing field {key!r}")
    value = row[key]
    types = typ if isinstance(typ, tuple) else (typ,)
    is_bool_for_int = isinstance(value, bool) and bool not in types
    if not isinstance(value, types) or is_bool_for_int:
        want = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
        raise ValueError(f"field {key!r} must be {want}, got {type(value).__name__} {value!r:.60}")
    return value


def split_path(family: str, split: str, names: Iterable[str]) -> Path:
    """``split`` read as a data file's path, when it is not one of the family's split ``names``;
    ``ValueError`` listing the valid splits when no such file exists either."""
    path = Path(split)
    if not path.is_file():
        raise ValueError(f"{family} has no split {split!r} and no file of that name; its splits: "
                         f"{', '.join(names)} (or give a data file's path)")
    return path


def text_lines(path: str | Path) -> Iterable[tuple[int, str]]:
    """(1-based line number, line) of a UTF-8 text file. Raises ``FileNotFoundError`` for a
    missing file and ``DatasetError(path, line, why)`` for bytes that are not UTF-8 (a binary
    file, another encoding), which a plain ``open(encoding="utf-8")`` reports without either."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(str(path), lineno, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at "
                                   f"column {exc.start + 1}); is this a binary file?") from None


def check_text_file(path: str | Path) -> int:
    """Check that a data file exists, is UTF-8 text and holds at least one non-blank line;
    return its number of non-blank lines. Errors name the file (and the line)."""
    n = sum(1 for _, line in text_lines(path) if line.strip())
    if n == 0:
        raise DatasetError(str(path), 1, "the file is empty (no non-blank line)")
    return n


def load_jsonl(path: str | Path, parse_row: Callable[[dict[str, Any]], T],
               limit: int | None = None) -> list[T]:
    """Parse a JSON Lines file row by row; blank lines are skipped.

    ``parse_row`` may raise ``KeyError``, ``ValueError`` or ``TypeError`` on a bad row; those (and
    JSON syntax errors, and rows that are not objects) are re-raised as ``DatasetError(path, line,
    why)``. ``limit`` stops after that many parsed rows.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    out: list[T] = []
    for lineno, line in text_lines(path):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            why = f"invalid JSON: {exc.msg} at column {exc.colno}"
            raise DatasetError(str(path), lineno, why) from exc
        if not isinstance(row, dict):
            raise DatasetError(str(path), lineno, f"expected a JSON object, got {type(row).__name__}")
        try:
            out.append(parse_row(row))
        except (KeyError, ValueError, TypeError) as exc:
            why = f"missing field {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
            raise DatasetError(str(path), lineno, why) from exc
    return out


def write_jsonl(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write rows as JSON Lines (UTF-8, one compact object per line); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    return path


def item_to_row(item: TaskItem) -> dict[str, Any]:
    """A ``TaskItem`` as a JSON-ready dict (the inverse of ``item_from_row``)."""
    return {"id": item.id, "family": item.family, "question": item.question, "gold": item.gold,
            "meta": dict(item.meta)}


def item_from_row(row: Mapping[str, Any]) -> TaskItem:
    """Parse a stored ``TaskItem`` row; raises ``ValueError`` naming the bad field."""
    return TaskItem(id=row_field(row, "id", str), family=row_field(row, "family", str),
                    question=row_field(row, "question", str), gold=row_field(row, "gold"),
                    meta=row_field(row, "meta", dict, default={}))
