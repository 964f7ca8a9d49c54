"""What a no-op `doit wheels` loads: the modules of ours it may import, named, and no transport.

The no-op is what users run most (docs/building.md, "The no-op"); every module it imports is start-up
time. Parsing the lock imports no transport (git, the package index, HTTP, TLS, tomlkit's writer): the
source kinds import theirs where they fetch (tasks/lock/kinds.py). Read from ``python -X importtime``,
which lists every module the run imports.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import FixtureServer, Workspace, copy_cache, make_workspace

#: Our modules a no-op `doit wheels` may load. A change that needs another one here costs every run its
#: import: make it lazy where only some runs need it, or add it here and say why in the commit.
NOOP_MODULES = frozenset(
    {
        "tasks", "tasks.cli", "tasks.cli.dodo", "tasks.cli.failures", "tasks.cli.graph",
        "tasks.core", "tasks.core.console", "tasks.core.digest", "tasks.core.errors", "tasks.core.fsutil",
        "tasks.core.imageref", "tasks.core.members", "tasks.core.proc", "tasks.core.procfs", "tasks.core.replay",
        "tasks.core.settings", "tasks.core.startup", "tasks.core.treehash", "tasks.core.workspace",
        "tasks.env", "tasks.env.compilers", "tasks.env.reproducible", "tasks.env.toolchain",
        "tasks.lock", "tasks.lock.keys", "tasks.lock.kinds", "tasks.lock.lockfile", "tasks.lock.schema",
        "tasks.stages", "tasks.stages.context", "tasks.stages.patch", "tasks.stages.provenance",
        "tasks.stages.wheelhouse",
        "tasks.store", "tasks.store.cache", "tasks.store.manifest", "tasks.store.noop", "tasks.store.simple_index",
        "tasks.store.wheelnorm",
    }
)  # fmt: skip
#: Never in a no-op: the transports, the writers and what only builds, images or verification need.
NEVER = (
    "urllib.request", "http.client", "ssl", "requests", "urllib3", "tomlkit", "html", "html.parser",
    "boto3", "botocore", "ray", "elftools", "cyclonedx.model", "pathspec",
)  # fmt: skip


def imported(stderr: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", stderr, flags=re.M)}


def noop_modules(ws: Workspace) -> set[str]:
    ws.doit("wheels", "profile=quick")  # placed from the cache: then the no-op
    cmd = [sys.executable, "-X", "importtime", *ws.command("wheels", "profile=quick")[1:]]
    done = subprocess.run(cmd, env=ws.env(), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not [ln for ln in done.stdout.splitlines() if ln.startswith(".  ")], done.stdout  # a no-op: nothing ran
    return imported(done.stderr)


def test_a_noop_loads_only_the_modules_named_and_no_transport(
    tmp_path: Path, quick_cache: Path, server: FixtureServer
) -> None:
    ws = make_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)
    found = noop_modules(ws)
    ours = {m for m in found if m == "tasks" or m.startswith("tasks.")}
    assert "tasks.lock.lockfile" in ours and "doit" in found  # the list is really read
    assert ours <= NOOP_MODULES, f"a no-op `doit wheels` now imports {sorted(ours - NOOP_MODULES)}"
    bad = sorted(m for m in found if m in NEVER or m.split(".")[0] in NEVER)
    assert not bad, f"a no-op `doit wheels` imports {bad}"


def test_the_budget_check_can_fail() -> None:
    text = "import time: 10 | 10 | tasks.lock.git\nimport time: 5 | 5 |   ssl\n"
    assert imported(text) == {"tasks.lock.git", "ssl"}
    assert not ({"tasks.lock.git"} <= NOOP_MODULES) and "ssl" in NEVER
