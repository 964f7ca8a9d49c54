"""The modules of tasks/ import one another without a circle (../shared/ARCHITECTURE-REVIEW.md, "Verdict" 3).

The graph is read from the source with ``ast``: ``import tasks.x`` and ``from tasks[.x] import y`` at
module level (run when the module is imported) and inside functions (run when the function is), since
an import deferred into a function still ties the two modules together. Imports under
``if TYPE_CHECKING:`` are left out: they exist only for mypy, never at run time.

Module-level imports form no circle, and neither do all of them together: a function-level import
may not reach up either (the last three that did were moved down: ``tasks/core/startup.py``, the shards'
choice in ``tasks/engine/admission.py``, the host's memory in ``tasks/engine/jobserver.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

TASKS = Path(__file__).resolve().parents[2] / "tasks"

Graph = dict[str, set[str]]


def _module(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, modules: set[str], *, deferred: bool) -> set[str]:
    """The modules of ``modules`` that ``node`` imports anywhere in it (in its functions too when ``deferred``),
    except under ``if TYPE_CHECKING:``."""
    if not deferred and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return set()
    found: set[str] = set()
    if isinstance(node, ast.Import):
        found |= {alias.name for alias in node.names if alias.name in modules}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module in modules:
            found.add(node.module)
        found |= {f"{node.module}.{alias.name}" for alias in node.names} & modules
    children = node.orelse if isinstance(node, ast.If) and _type_checking(node.test) else ast.iter_child_nodes(node)
    for child in children:
        found |= _imports(child, modules, deferred=deferred)
    return found


def import_graph(root: Path = TASKS, *, deferred: bool = True) -> Graph:
    """Each module of the package at ``root``, with the modules of the package it imports."""
    paths = {_module(path, root): path for path in sorted(root.rglob("*.py"))}
    modules = set(paths)
    graph = {
        name: _imports(ast.parse(path.read_text(), str(path)), modules, deferred=deferred)
        for name, path in paths.items()
    }
    for name, targets in graph.items():  # the package's own __init__ (loaded first anyway) is no edge
        targets.discard(root.name)
        targets.discard(name)
    return graph


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


def _without(graph: Graph, edges: set[tuple[str, str]]) -> Graph:
    return {name: {t for t in targets if (name, t) not in edges} for name, targets in graph.items()}


def test_module_level_imports_form_no_circle() -> None:
    graph = import_graph(deferred=False)
    assert "tasks.store.cache" in graph["tasks.stages.build"]  # the graph is really read
    cycle = find_cycle(graph)
    assert cycle is None, "tasks/ modules import each other in a circle: " + " -> ".join(cycle or [])


def test_deferred_imports_form_no_circle_either() -> None:
    graph = import_graph()
    module_level = import_graph(deferred=False)
    assert "tasks.cli.dodo" in graph["tasks.cli.main"] - module_level["tasks.cli.main"]  # function-level imports count
    cycle = find_cycle(graph)
    assert cycle is None, "tasks/ modules import each other in a circle: " + " -> ".join(cycle or [])


def test_a_circle_is_found(tmp_path: Path) -> None:
    """The check can fail: a circle through a function-level import is reported, a TYPE_CHECKING one is not."""
    root = tmp_path / "tasks"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "a.py").write_text("from tasks import b\n")
    (root / "b.py").write_text("def f():\n    from tasks.c import g\n")
    (root / "c.py").write_text("import tasks.a\n")
    (root / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tasks import a\n")
    (root / "e.py").write_text(
        "import typing\nif typing.TYPE_CHECKING:\n    import tasks.d\nelse:\n    import tasks.a\n"
    )
    graph = import_graph(root)
    assert graph["tasks.d"] == set()
    assert graph["tasks.e"] == {"tasks.a"}
    assert find_cycle(graph) == ["tasks.a", "tasks.b", "tasks.c", "tasks.a"]
    assert find_cycle(import_graph(root, deferred=False)) is None
    assert find_cycle(_without(graph, {("tasks.b", "tasks.c")})) is None
    (root / "c.py").write_text("")
    assert find_cycle(import_graph(root)) is None
