"""One way out: tasks/proc.py starts every subprocess (../shared/ARCHITECTURE-REVIEW.md, "Verdict" 5).

Read with ``ast``: no module of tasks/ but proc.py imports ``subprocess`` or names it, except the files
that run elsewhere with the standard library alone (tests/unit/test_standalone.py), which cannot import
proc.py. Code inside a string (a probe script a module hands to another interpreter) is not the
module's own and is not read.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TASKS = Path(__file__).resolve().parents[2] / "tasks"

#: proc.py, and the files that run elsewhere with the standard library only (test_standalone.py), so start
#: their own processes where they need any (preflight.py's probe, gate.py's compiler through fork and exec).
ALLOWED = frozenset(
    {"proc.py", "gate.py", "verify_runner.py", "preflight.py", "bundle_unpack.py", "capture_base.py"}
    | {"ninjaorder.py", "smoke/*.py"}
)
#: What else starts a process: os's functions of these names (os.fork, os.execvp, os.posix_spawn, ...).
OS_STARTS = ("system", "popen", "fork", "exec", "spawn", "posix_spawn")


def subprocess_uses(tree: ast.AST) -> list[str]:
    """Where ``tree`` imports subprocess or names it (``line: text``); its functions included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "subprocess" for a in node.names):
            found.append(f"{node.lineno}: import subprocess")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "subprocess":
            found.append(f"{node.lineno}: from subprocess import ...")
        elif isinstance(node, ast.Name) and node.id == "subprocess":
            found.append(f"{node.lineno}: subprocess")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr.startswith(OS_STARTS):
                found.append(f"{node.lineno}: os.{node.attr}")
    return found


def _allowed(path: Path) -> bool:
    return any(path.relative_to(TASKS).match(pattern) for pattern in ALLOWED)


def _modules() -> list[Path]:
    return sorted(p for p in TASKS.rglob("*.py") if not _allowed(p))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(TASKS).as_posix())
def test_no_subprocess_outside_proc(path: Path) -> None:
    uses = subprocess_uses(ast.parse(path.read_text(), str(path)))
    assert not uses, f"{path} starts processes itself; use tasks/proc.py (query, stream, run_logged, run): {uses}"


def test_the_allowed_files_exist() -> None:
    for pattern in ALLOWED:
        assert list(TASKS.glob(pattern)), pattern


def test_the_check_can_fail() -> None:
    assert subprocess_uses(ast.parse("def f():\n    import subprocess\n    subprocess.run(['x'])\n")) == [
        "2: import subprocess",
        "3: subprocess",
    ]
    assert subprocess_uses(ast.parse("from subprocess import run\nimport os\nos.system('x')\n")) == [
        "1: from subprocess import ...",
        "3: os.system",
    ]
    assert subprocess_uses(ast.parse("import os\nos.execvp('x', ['x'])\nos.path.join('a')\n")) == ["2: os.execvp"]
    assert _allowed(TASKS / "smoke" / "apex.py") and not _allowed(TASKS / "verify.py")
    assert subprocess_uses(ast.parse("PROBE = 'import subprocess; subprocess.run([1])'\n")) == []
