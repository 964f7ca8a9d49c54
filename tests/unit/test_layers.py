"""tasks/ is ten layered packages (tasks/__init__.py ``LAYERS``): a module imports only modules of its own
package and of the packages before it, and no modules import one another in a circle.

The graph is read from the source with ``ast``: ``import tasks.x.y`` and ``from tasks[.x[.y]] import z`` at
module level, inside functions (run when the function is: the two modules are tied all the same) and under
``if TYPE_CHECKING:`` (mypy reads those: a type-only import that runs upward is an upward dependency too).
Every module lives in a package; docs/development.md's floor plan names each package's modules.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tasks import LAYERS

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tasks"
FLOOR_PLAN = REPO / "docs" / "development.md"

Graph = dict[str, set[str]]


def _module(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(node: ast.AST, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``node`` imports anywhere in it: module level, functions, TYPE_CHECKING."""
    found: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Import):
            for alias in child.names:
                name = alias.name
                while name and name not in modules:  # import tasks.a.b.c: the longest module it names
                    name = name.rpartition(".")[0]
                if name:
                    found.add(name)
        elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
            named = {f"{child.module}.{alias.name}" for alias in child.names} & modules
            found |= named or ({child.module} & modules)
    return found


def import_graph(root: Path = TASKS) -> Graph:
    """Each module of the package at ``root``, with the modules of the package it imports (packages count as
    their ``__init__``; a package's own ``__init__``, loaded first anyway, is no edge)."""
    paths = {_module(path, root): path for path in sorted(root.rglob("*.py"))}
    modules = set(paths)
    graph = {name: _imports(ast.parse(path.read_text(), str(path)), modules) for name, path in paths.items()}
    for name, targets in graph.items():
        targets.discard(name)
        for parent in (name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)):
            targets.discard(parent)
    return graph


def layer_of(module: str, layers: tuple[str, ...] = LAYERS) -> int | None:
    """The index of ``module``'s package in ``layers``; None for the root package itself."""
    parts = module.split(".")
    if len(parts) == 1:
        return None
    return layers.index(parts[1]) if parts[1] in layers else -1


def upward(graph: Graph, layers: tuple[str, ...] = LAYERS) -> list[str]:
    """Every import from a module to a module of a later package, ``a -> b``."""
    found = []
    for name, targets in sorted(graph.items()):
        here = layer_of(name, layers)
        for target in sorted(targets):
            there = layer_of(target, layers)
            if here is not None and there is not None and there > here:
                found.append(f"{name} -> {target}")
    return found


def find_cycle(graph: Graph) -> list[str] | None:
    """One circle of ``graph`` (its modules, the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        path.append(name)
        for target in sorted(graph.get(name, ())):
            if target in path:
                return [*path[path.index(target) :], target]
            if target not in done:
                found = visit(target)
                if found:
                    return found
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if name not in done:
            found = visit(name)
            if found:
                return found
    return None


def test_every_module_is_in_a_layer() -> None:
    loose = sorted(p.name for p in TASKS.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside the layers (move each into one of tasks/{{{','.join(LAYERS)}}}/): {loose}"
    packages = sorted(p.name for p in TASKS.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert packages == sorted(LAYERS)


def test_no_import_runs_upward() -> None:
    graph = import_graph()
    assert "tasks.store.cache" in graph["tasks.stages.build"]  # the graph is really read
    assert "tasks.stages.context" in graph["tasks.verify.image"]
    found = upward(graph)
    assert not found, "imports into a later layer (tasks/__init__.py LAYERS):\n  " + "\n  ".join(found)


def test_no_circle_even_with_type_only_and_function_imports() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "tasks/ modules import each other in a circle: " + " -> ".join(cycle or [])


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """A planted upward import (in a function, under TYPE_CHECKING) and a planted circle are reported."""
    root = tmp_path / "tasks"
    for layer in ("low", "high"):
        (root / layer).mkdir(parents=True)
        (root / layer / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "low" / "a.py").write_text("def f():\n    from tasks.high import b\n")
    (root / "low" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tasks.high.b\n")
    (root / "high" / "b.py").write_text("from tasks.low import c\n")
    (root / "high" / "d.py").write_text("import tasks.low.a\n")
    graph = import_graph(root)
    assert upward(graph, ("low", "high")) == ["tasks.low.a -> tasks.high.b", "tasks.low.c -> tasks.high.b"]
    assert find_cycle(graph) == ["tasks.high.b", "tasks.low.c", "tasks.high.b"]
    (root / "low" / "a.py").write_text("")
    (root / "low" / "c.py").write_text("")
    graph = import_graph(root)
    assert upward(graph, ("low", "high")) == [] and find_cycle(graph) is None


def floor_plan() -> dict[str, set[str]]:
    """docs/development.md's floor plan: each package's row, with the modules it names (```name```)."""
    rows: dict[str, set[str]] = {}
    for line in FLOOR_PLAN.read_text().splitlines():
        found = re.match(r"\|\s*`tasks/(\w+)/`\s*\|([^|]*)\|", line)
        if found:
            rows[found.group(1)] = set(re.findall(r"`([\w/]+)`", found.group(2)))
    return rows


def test_the_floor_plan_is_the_tree() -> None:
    """Each package of the tree is a row of the floor plan, in LAYERS' order, naming exactly its modules."""
    rows = floor_plan()
    assert list(rows) == list(LAYERS), "docs/development.md's floor plan rows are not tasks/__init__.py LAYERS"
    for layer in LAYERS:
        here = {p.stem for p in (TASKS / layer).glob("*.py") if p.name != "__init__.py"}
        here |= {f"{p.parent.name}/" for p in (TASKS / layer).glob("*/__init__.py")}
        assert rows[layer] == here, (
            f"tasks/{layer}/: the floor plan names {sorted(rows[layer])}, the tree has {sorted(here)}"
        )
