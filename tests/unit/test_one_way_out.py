"""One way out: tasks/core/proc.py starts every subprocess, tasks/core/net.py makes every HTTP request
(../shared/ARCHITECTURE-REVIEW.md, "Verdict" 5).

Read with ``ast``: no module of tasks/ but proc.py imports ``subprocess`` or names it, and no module but
net.py calls ``requests.get/post/put/head/request/Session`` or ``urllib.request.urlopen`` (or imports
them by name), except the files that run elsewhere with the standard library alone
(tests/unit/test_standalone.py), which cannot import either. Code inside a string (a probe script a
module hands to another interpreter) is not the module's own and is not read.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TASKS = Path(__file__).resolve().parents[2] / "tasks"

#: proc.py, and the files that run elsewhere with the standard library only (test_standalone.py), so start
#: their own processes where they need any (preflight.py's probe, gate.py's compiler through fork and exec).
ALLOWED = frozenset({"core/proc.py", "outside/*.py", "outside/smoke/*.py"})
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
    assert not uses, f"{path} starts processes itself; use tasks/core/proc.py (run, query, stream): {uses}"


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
    assert _allowed(TASKS / "outside" / "smoke" / "apex.py") and not _allowed(TASKS / "verify" / "checks.py")
    assert subprocess_uses(ast.parse("PROBE = 'import subprocess; subprocess.run([1])'\n")) == []


# --------------------------------------------------------------------------- HTTP

#: The files that run elsewhere with the standard library only, which cannot import net.py.
NET_ALLOWED = frozenset({"core/net.py", "outside/*.py", "outside/smoke/*.py"})
#: What sends a request outside a session of tasks/core/net.py.
REQUESTS_CALLS = frozenset({"get", "post", "put", "head", "patch", "delete", "options", "request", "Session"})


def _dotted(node: ast.expr) -> str:
    """``a.b.c`` of an attribute chain over a name; "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def http_uses(tree: ast.AST) -> list[str]:
    """Where ``tree`` makes an HTTP request of its own (``line: what``), outside tasks/core/net.py's sessions."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            module, _, attr = name.rpartition(".")
            if (module in ("requests", "requests.api", "requests.sessions") and attr in REQUESTS_CALLS) or (
                name in ("urllib.request.urlopen", "request.urlopen")
            ):
                found.append(f"{node.lineno}: {name}(")
        elif isinstance(node, ast.ImportFrom) and node.module in ("requests", "requests.api", "requests.sessions"):
            found += [
                f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if a.name in REQUESTS_CALLS
            ]
        elif isinstance(node, ast.ImportFrom) and node.module == "urllib.request":
            found += [f"{node.lineno}: from urllib.request import {a.name}" for a in node.names if a.name == "urlopen"]
    return found


def _net_allowed(path: Path) -> bool:
    return any(path.relative_to(TASKS).match(pattern) for pattern in NET_ALLOWED)


@pytest.mark.parametrize(
    "path", sorted(p for p in TASKS.rglob("*.py") if not _net_allowed(p)), ids=lambda p: p.relative_to(TASKS).as_posix()
)
def test_no_http_request_outside_net(path: Path) -> None:
    uses = http_uses(ast.parse(path.read_text(), str(path)))
    assert not uses, f"{path} makes HTTP requests itself; use tasks/core/net.py (session, download, timeout): {uses}"


def test_the_net_allowed_files_exist() -> None:
    for pattern in NET_ALLOWED:
        assert list(TASKS.glob(pattern)), pattern


def test_the_http_check_can_fail() -> None:
    assert http_uses(
        ast.parse("import requests\nrequests.get('u', timeout=1)\nwith requests.Session() as s:\n    pass\n")
    ) == [
        "2: requests.get(",
        "3: requests.Session(",
    ]
    assert http_uses(ast.parse("import urllib.request\nurllib.request.urlopen('u')\n")) == [
        "2: urllib.request.urlopen("
    ]
    assert http_uses(ast.parse("from urllib.request import urlopen, url2pathname\nfrom requests import head\n")) == [
        "1: from urllib.request import urlopen",
        "2: from requests import head",
    ]
    # Sessions of tasks/core/net.py, requests' exceptions and types, and a request in a string are fine.
    fine = (
        "from tasks import net\nimport requests\nnet.session(trust_env=True).get('u')\n"
        "requests.RequestException\nX = 'requests.get(1)'\n"
    )
    assert http_uses(ast.parse(fine)) == []
    assert (
        _net_allowed(TASKS / "core" / "net.py")
        and not _net_allowed(TASKS / "lock" / "pypi.py")
        and not _net_allowed(TASKS / "store" / "remote.py")
    )
