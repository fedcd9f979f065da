"""The pipeline keeps no state of its own: what tasks share lives in a ``trace_rl.session.Session``.

Parses every module of ``tasks`` and ``flows`` and fails on module-level mutable state: a
dict, list or set (literal, comprehension or constructor call), a call other than the immutable
or declarative objects named below, a memoising decorator (``lru_cache``, ``cache``) on a module
function, or a ``global`` statement.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted([*ROOT.glob("tasks/*.py"), *ROOT.glob("flows/*.py")])

IMMUTABLE_CALLS = {
    "MappingProxyType", "frozenset", "tuple", "TypeVar", "NewType",  # immutable values, types
    "getLogger", "get_logger",  # loggers
    "task", "flow",  # Prefect task and flow objects
    "PhaseKey",  # the Prefect cache policy (a configuration, replaced, never changed)
    "TrainConfig",  # a frozen pydantic model
}
MEMOISING = {"lru_cache", "cache", "cached_property"}


def _name(node: ast.AST) -> str:
    """``f`` of ``f(...)``, ``m.f(...)`` or ``f``."""
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def findings(source: str) -> list[str]:
    """Module-level mutable state in ``source``, one line per finding."""
    out = []
    tree = ast.parse(source)
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if value is not None:
            target = ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
            if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp,
                                  ast.SetComp)):
                out.append(f"{node.lineno}: {target} is a mutable {type(value).__name__}")
            elif isinstance(value, ast.Call) and _name(value) not in IMMUTABLE_CALLS:
                out.append(f"{node.lineno}: {target} = {_name(value)}(...)")
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for deco in node.decorator_list:
                if _name(deco) in MEMOISING:
                    out.append(f"{node.lineno}: {node.name} memoised by {_name(deco)}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out.append(f"{node.lineno}: global {', '.join(node.names)}")
    return out


@pytest.mark.parametrize("path", MODULES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_module_level_mutable_state(path: Path) -> None:
    assert findings(path.read_text()) == []


@pytest.mark.parametrize("source", [
    "_LIVE: dict[str, int] = {}",
    "_QUEUED = set()",
    "_SEEN = [x for x in range(3)]",
    "import weakref\n_LOADED = weakref.WeakKeyDictionary()",
    "from functools import lru_cache\n@lru_cache(maxsize=8)\ndef store(w): return w",
    "import functools\n@functools.cache\ndef f(): return 1",
    "_n = 0\ndef bump():\n    global _n\n    _n += 1",
])
def test_the_check_finds_mutable_state(source: str) -> None:
    assert findings(source)


@pytest.mark.parametrize("source", [
    "PENDING = '.pending-logs'",
    "FIELDS = ('step', 'level')",
    "import logging\nlog = logging.getLogger(__name__)",
    "from types import MappingProxyType\nHOOKS = MappingProxyType({'on_running': (print,)})",
    "RESERVE = 16 << 20",
])
def test_the_check_passes_constants(source: str) -> None:
    assert findings(source) == []
