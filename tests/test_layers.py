"""The rule of dependencies (docs/architecture.md), read from the source with ``ast``: imports point
one way, deployments and the CLI -> flows -> tasks -> trace_rl adapters -> trace_core, and no two
of trace_rl's sub-packages (engines, envs, rollout, storage, policy, ...) import each other in a
cycle. Every import counts, a function's deferred one included: it is a dependency all the same."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FLOORS = ["trace_core", "trace_rl", "tasks", "flows", "cli", "deployments"]
"""Bottom to top: a package may import only the floors below it (and itself)."""
OUTSIDE_CORE = {"prefect", "duckdb", "mlflow", "vllm"}
"""What trace_core, the pure algorithm, never imports."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (relative imports resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    here = module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the package a module's relative imports start from
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            out.add(".".join([*base, *([node.module] if node.module else [])]))
    return out


def package_files(package: str) -> list[Path]:
    return sorted((REPO / package).rglob("*.py"))


def test_the_rule_sees_the_imports_it_checks():
    """The parser is not vacuous: it finds known edges, deferred and relative ones included."""
    assert "trace_core.allocators" in imports(REPO / "trace_rl" / "config" / "sections.py")
    assert "flows.train" in imports(REPO / "cli" / "app.py")  # deferred, inside a command
    assert "trace_rl.envs.base" in imports(REPO / "trace_rl" / "rollout" / "react.py")


@pytest.mark.parametrize("floor", FLOORS)
def test_imports_point_down(floor):
    above = set(FLOORS[FLOORS.index(floor) + 1:]) | {"bench", "studies", "tests"}
    bad = [f"{module_name(p)} imports {name}" for p in package_files(floor)
           for name in sorted(imports(p)) if name.split(".")[0] in above]
    assert not bad, "\n".join(bad)


def test_benchmarks_do_not_depend_on_studies():
    """bench/ (the benchmarks behind the README's claims) runs without studies/ (one-off work)."""
    bad = [f"{module_name(p)} imports {name}" for p in package_files("bench")
           for name in sorted(imports(p)) if name.split(".")[0] == "studies"]
    assert not bad, "\n".join(bad)


def test_trace_core_is_pure():
    bad = [f"{module_name(p)} imports {name}" for p in package_files("trace_core")
           for name in sorted(imports(p)) if name.split(".")[0] in OUTSIDE_CORE]
    assert not bad, "\n".join(bad)


def sub_package_graph() -> dict[str, set[str]]:
    """trace_rl's sub-packages (and top-level modules) -> those they import."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in package_files("trace_rl"):
        parts = module_name(path).split(".")
        if len(parts) < 2:
            continue
        for name in imports(path):
            other = name.split(".")
            if other[0] == "trace_rl" and len(other) > 1 and other[1] != parts[1]:
                graph[parts[1]].add(other[1])
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its nodes in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert cycle({"rollout": {"envs"}, "envs": {"base"}}) is None
    assert cycle({"rollout": {"envs"}, "envs": {"rollout"}}) == ["envs", "rollout", "envs"]


def test_no_cycle_between_trace_rl_sub_packages():
    graph = sub_package_graph()
    assert "envs" in graph["rollout"]  # the loop drives environments: the one direction
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def module_graph(package: str) -> dict[str, set[str]]:
    """The modules of ``package`` (a folder) -> those of its modules they import."""
    modules = {module_name(p): p for p in package_files(package)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        graph[name] = set()
        for imported in imports(path):
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()  # ``from pkg.mod import name`` names the module pkg.mod
            if parts and ".".join(parts) != name:
                graph[name].add(".".join(parts))
    return graph


@pytest.mark.parametrize("package", ["trace_rl/sandbox", "trace_rl/envs"])
def test_no_import_circle_inside_the_sandbox_or_the_families(package):
    """The sandbox's modules (the call, the host's side, the limits) and the families' (each
    folder imports the registry; the registry finds the folders without importing them by name)
    import one way."""
    graph = module_graph(package)
    assert len(graph) > 3 and cycle(graph) is None, " -> ".join(cycle(graph) or [])
