"""Code that runs elsewhere imports only what is there (../shared/ARCHITECTURE-REVIEW.md, "Verdict" 3).

Each file below says in its docstring where it runs and what it may import; these tests read the files
with ``ast`` and hold them to it. Every import counts, in functions too (a function runs there as well);
imports under ``if TYPE_CHECKING:`` do not (they never run). ``sys.stdlib_module_names`` is this
interpreter's standard library: for the files that run on Python 3.8 the modules added since are refused
by name (:data:`NEWER_THAN_3_8`), and their grammar is parsed as 3.8's.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

from tasks.verify.image import KIT_DEPENDENCIES

TASKS = Path(__file__).resolve().parents[2] / "tasks"

#: Standard library only, no import of the rest of tasks/, and any Python from 3.8 (True) or the doit
#: process's Python (False); each as its docstring says.
STDLIB_ONLY = {
    "outside/gate.py": False,  # runs under `python -IS`, once per compile
    "outside/ninjaorder.py": False,  # the ninja shim runs it with doit's Python, outside any package
    "outside/verify_runner.py": True,  # runs under the interpreter being verified
    "outside/preflight.py": True,  # copied beside the wheels, runs on the target node
    "outside/unbundle.py": True,  # travels inside the bundle as unbundle.py
    "outside/capture_base.py": True,  # copied to a cluster node, runs in the base's interpreter
}
#: The files that run in the verification venv with the stack: the standard library, torch and these packages
#: (tasks/outside/train_gpt.py: the training check's ranks; its docstring says where it runs).
WITH_THE_STACK = {
    "outside/train_gpt.py": frozenset(
        {"torch", "megatron", "transformer_engine", "flash_attn_3", "grouped_gemm", "apex"}
    ),
}
#: What a smoke script may import besides the standard library: the copied harness and torch (and the
#: package it tests, its own name; tasks/outside/smoke/__init__.py).
SMOKE_ALLOWED = frozenset({"_harness", "torch"})
#: Standard-library modules that Python 3.8 does not have.
NEWER_THAN_3_8 = frozenset({"graphlib", "zoneinfo", "tomllib", "_tokenize", "wsgiref.types"})
STDLIB = frozenset(sys.stdlib_module_names)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(tree: ast.AST, *, deferred: bool = True) -> set[str]:
    """The absolute module names ``tree`` imports (``from a.b import c``: ``a.b`` and ``a.b.c``), in its
    functions too when ``deferred``, leaving out ``if TYPE_CHECKING:``; a relative import is ``.name``."""
    if not deferred and isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return set()
    found: set[str] = set()
    if isinstance(tree, ast.Import):
        found |= {alias.name for alias in tree.names}
    elif isinstance(tree, ast.ImportFrom):
        module = "." * tree.level + (tree.module or "")
        found.add(module)
        if tree.level == 0:
            found |= {f"{module}.{alias.name}" for alias in tree.names}
    children = tree.orelse if isinstance(tree, ast.If) and _type_checking(tree.test) else ast.iter_child_nodes(tree)
    for child in children:
        found |= imports(child, deferred=deferred)
    return found


def outside(names: Iterable[str], allowed: Iterable[str] = (), *, py38: bool = False) -> set[str]:
    """The imports of ``names`` that are neither in the standard library (Python 3.8's with ``py38``) nor
    ``allowed`` (top-level names)."""
    bad = set()
    for name in names:
        top = name.split(".")[0]
        if top in allowed or (top in STDLIB and not (py38 and (top in NEWER_THAN_3_8 or name in NEWER_THAN_3_8))):
            continue
        bad.add(name)
    return bad


def _parse(path: Path, *, py38: bool = False) -> ast.Module:
    return ast.parse(path.read_text(), str(path), feature_version=(3, 8) if py38 else None)


def closure(module: str, root: Path = TASKS) -> tuple[set[str], set[str]]:
    """What importing ``module`` and running it loads: the modules of the package at ``root`` and the
    top-level names outside it. ``module``'s own imports count wherever they are; the modules it reaches
    count at module level only (a deferred import there runs only on paths that say so, as
    tasks/stages/provenance.py's does)."""
    package = root.name
    ours: set[str] = set()
    theirs: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in ours:
            continue
        ours.add(name)
        path = root.parent.joinpath(*name.split(".")).with_suffix(".py")
        tree = _parse(path if path.exists() else path.with_suffix("") / "__init__.py")
        for imported in imports(tree, deferred=name == module):
            parts = imported.split(".")
            if parts[0] != package:
                theirs.add(parts[0])
            elif len(parts) > 1 and root.parent.joinpath(*parts).with_suffix(".py").is_file():
                todo.append(".".join(parts))
    return ours, theirs


@pytest.mark.parametrize("name", sorted(STDLIB_ONLY))
def test_standard_library_only(name: str) -> None:
    py38 = STDLIB_ONLY[name]
    found = imports(_parse(TASKS / name, py38=py38))
    assert found, "no import read"
    assert not outside(found, py38=py38), f"tasks/{name} runs elsewhere with the standard library only"


@pytest.mark.parametrize("name", sorted(WITH_THE_STACK))
def test_the_training_ranks_import_the_standard_library_torch_and_the_stack(name: str) -> None:
    found = imports(_parse(TASKS / name))
    assert "torch" in found and any(n.startswith("megatron.core.") for n in found), "no import read"
    assert not outside(found, WITH_THE_STACK[name]), f"tasks/{name} runs in the verification venv alone"


def test_every_module_of_outside_is_held_to_it() -> None:
    """tasks/outside/ is the package of code that runs elsewhere: each module there is listed above."""
    found = {p.relative_to(TASKS).as_posix() for p in TASKS.glob("outside/*.py") if p.name != "__init__.py"}
    assert found == set(STDLIB_ONLY) | set(WITH_THE_STACK)


@pytest.mark.parametrize("path", sorted(TASKS.glob("outside/smoke/*.py")), ids=lambda p: p.name)
def test_smoke_scripts_import_the_standard_library_torch_and_their_package(path: Path) -> None:
    found = imports(_parse(path))
    assert not outside(found, SMOKE_ALLOWED | {path.stem}), f"{path} runs in the verification venv alone"


def test_verify_incontainer_needs_the_standard_library_and_the_kit() -> None:
    """Inside the image, tasks/ is there and KIT_DEPENDENCIES beside it (tasks/verify/image.py), no more."""
    ours, theirs = closure("tasks.verify.incontainer")
    assert "tasks.verify.checks" in ours
    assert not outside(theirs, KIT_DEPENDENCIES), "tasks.verify.incontainer imports what the image lacks"


def test_python_m_tasks_bundle_needs_the_standard_library() -> None:
    """``python3 -m tasks.image.bundle BUNDLE DEST`` (old instructions; tasks/image/bundle.py) runs from a checkout
    with a bare python3."""
    ours, theirs = closure("tasks.image.bundle")
    assert "tasks.outside.unbundle" in ours
    assert not outside(theirs), "tasks.image.bundle imports beyond the standard library"


def test_the_checks_can_fail(tmp_path: Path) -> None:
    assert outside(imports(ast.parse("import os.path\nfrom os import path\nimport json"))) == set()
    assert outside(imports(ast.parse("def f():\n    import requests\n"))) == {"requests"}
    assert outside(imports(ast.parse("from . import x"))) == {"."}
    assert outside(imports(ast.parse("import tomllib")), py38=True) == {"tomllib"}
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import requests\nelse:\n    import yaml\n"
    assert outside(imports(ast.parse(typing_only))) == {"yaml"}
    with pytest.raises(SyntaxError):
        ast.parse("if (n := 1):\n    match n:\n        case 1: pass\n", feature_version=(3, 8))
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "entry.py").write_text("def main():\n    from pkg import a\n")
    (root / "a.py").write_text("import json\nfrom pkg.b import x\ndef later():\n    import yaml\n")
    (root / "b.py").write_text("import requests\n")
    assert closure("pkg.entry", root) == ({"pkg.entry", "pkg.a", "pkg.b"}, {"json", "requests"})
