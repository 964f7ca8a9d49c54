"""The no-op replayed (tasks/core/replay.py), through the installed command's entry point as users run it.

A workspace of the example lock with a profile of the pure-Python fixture alone (no compiler, no nvcc), built
once; then `wheels` runs through ``tasks.cli.main:reprostack`` (what the installed ``reprostack`` runs) with
``-X importtime``, whose lines say whether doit was loaded: a replayed run loads neither doit nor the graph.
Each change a user can make to what the no-op reads is made in turn, and the run after it must be the slow
one, saying what the slow one says.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import PURE_PROFILE, FixtureServer, Workspace, make_workspace

from tasks.core import replay

ENTRY = "import sys\nfrom tasks.cli.main import reprostack\nreprostack()\n"


class Run:
    def __init__(self, done: subprocess.CompletedProcess[str]) -> None:
        self.code = done.returncode
        self.stdout = done.stdout
        lines = done.stderr.splitlines(keepends=True)
        self.stderr = "".join(ln for ln in lines if not ln.startswith("import time:"))
        self.modules = {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", done.stderr, re.M)}

    @property
    def replayed(self) -> bool:
        assert "tasks.core.replay" in self.modules, self.stderr  # the importtime lines are really read
        return "doit" not in self.modules and "tasks.cli.graph" not in self.modules


@pytest.fixture
def ws(tmp_path: Path, server: FixtureServer) -> Workspace:
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", server.url)
    ws.lock.write_text(ws.lock.read_text() + PURE_PROFILE)
    (ws.root / "reprostack-entry.py").write_text(ENTRY)
    ws.doit("wheels", "profile=pure")
    return ws


def wheels(ws: Workspace, *extra: str, env: dict[str, str] | None = None, task: tuple[str, ...] = ("wheels",)) -> Run:
    cmd = [sys.executable, "-X", "importtime", str(ws.root / "reprostack-entry.py"), *task, "profile=pure",
           f"lock={ws.lock.name}", f"cache={ws.cache}", *extra]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=ws.root, env=env or ws.env(), capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )
    run = Run(done)
    assert run.code == 0, run.stdout + run.stderr
    return run


def settle(ws: Workspace, env: dict[str, str] | None = None, task: tuple[str, ...] = ("wheels",)) -> Run:
    """Runs until one is replayed (a record is written, then confirmed by the next run once nothing it read
    is younger than replay.RACY_SECONDS); the replayed run."""
    records: list[dict[str, Any]] = []
    for _ in range(4):
        time.sleep(replay.RACY_SECONDS + 0.2)
        run = wheels(ws, env=env, task=task)
        if run.replayed:
            return run
        with contextlib.suppress(OSError, ValueError):
            records.append({**json.loads((ws.root / replay.RECORD).read_text()), "at": time.time_ns()})
    raise AssertionError(f"no run was replayed:\n{run.stdout}\n{run.stderr}\n{_unconfirmed(records)}")


def _unconfirmed(records: list[dict[str, Any]]) -> str:
    """Why the last records did not confirm: what their inputs read differently, what was fresh."""
    lines = []
    for before, after in itertools.pairwise(records):
        old = {(k, p): v for k, p, v in before["inputs"]}
        new = {(k, p): v for k, p, v in after["inputs"]}
        lines += [f"changed {key}: {old.get(key)} -> {new.get(key)}" for key in sorted(old.keys() | new.keys())
                  if old.get(key) != new.get(key)]  # fmt: skip
        if before["output"] != after["output"]:
            lines.append(f"output {before['output']} -> {after['output']}")
    for record in records:
        racy = record["at"] - int(replay.RACY_SECONDS * 1e9) - 10**9  # (the record was read a moment after)
        lines += [f"fresh {p}" for k, p, v in record["inputs"] if k in "sl" and v and len(v) > 5 and max(v[4:]) > racy]
    return "\n".join(lines[:40]) or "(every record read the same, none fresh)"


def test_a_noop_is_replayed_and_any_change_it_reads_ends_the_replay(ws: Workspace) -> None:
    slow = wheels(ws)
    assert not slow.replayed and "-- wheels" in slow.stdout and ".  " not in slow.stdout, slow.stdout
    fast = settle(ws)
    assert (fast.stdout, fast.stderr) == (slow.stdout, slow.stderr)  # what the slow run said, in its order
    assert wheels(ws).replayed

    # The lock edited (a comment): read again; nothing to build (the wheelhouse names the lock's digest: assembled
    # again).
    ws.lock.write_text(ws.lock.read_text() + "\n# a comment\n")
    run = wheels(ws)
    assert not run.replayed and "-- build:repro_pure" in run.stdout and ".  wheels" in run.stdout, run.stdout
    settle(ws)

    # A wheel of wheels/ altered in place (same name, same directory): the slow run puts the right one back.
    (wheel,) = (ws.root / "wheels").glob("repro_pure-*.whl")
    with wheel.open("ab") as f:
        f.write(b"\0")
    run = wheels(ws)
    assert not run.replayed and ".  wheels" in run.stdout, run.stdout
    settle(ws)

    # The wheel cache's entry removed: the build task runs again (restores or builds the wheel).
    (entry,) = [p for p in (ws.cache / "wheels").rglob("entry.json")]
    entry.unlink()
    run = wheels(ws)
    assert not run.replayed and ".  build:repro_pure" in run.stdout, run.stdout
    settle(ws)

    # A patch edited: the action key moves, the package builds again.
    patch = next((ws.root / "patches" / "repro_pure").glob("*.patch"))
    patch.write_text(patch.read_text().replace("patched", "patched again", 1))
    run = wheels(ws)
    assert not run.replayed and ".  build:repro_pure" in run.stdout, run.stdout
    settle(ws)

    # Another run's claim on the workspace: the slow run, which says so.
    claim = ws.root / "build" / "run" / f"{os.getppid()}.json"
    claim.write_text('{"pid": 1, "start": 0, "argv": [], "since": ""}')
    run = wheels(ws)
    assert not run.replayed
    claim.unlink(missing_ok=True)
    settle(ws)

    # Another environment, another command line: not this record's.
    assert not wheels(ws, env={**ws.env(), "SOME_VARIABLE": "1"}).replayed
    assert not wheels(ws, "jobs=1").replayed
    settle(ws)
    assert not wheels(ws, env={**ws.env(), "REPRO_NOOP_REPLAY": "off"}).replayed

    # No task at all, README's `.venv/bin/doit`: the default task is wheels, recorded and replayed as such.
    assert not wheels(ws, task=()).replayed  # another command line
    assert "-- wheels" in settle(ws, task=()).stdout


def test_a_noop_is_replayed_while_other_processes_write_in_a_directory_it_imports_from(
    ws: Workspace, tmp_path: Path
) -> None:
    """A directory on ``sys.path`` where another process comes and goes (a checkout where other builds write
    their temporaries, as the quickstart does in this one): the run looks at its mtime (importlib.metadata's
    cache key) on every start, and the record keeps its names, which stay the same. The other process is a
    thread that moves the directory's times, as a temporary file that came and went does (a real file, left
    there a moment, was there at some listings on a loaded host: a name the run did see)."""
    beside = tmp_path / "on-sys-path"
    beside.mkdir()
    env = ws.env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(beside), env.get("PYTHONPATH")) if p)
    stop = threading.Event()

    def writer() -> None:  # what a temporary file that came and went leaves: the directory's times moved
        while not stop.wait(0.02):
            os.utime(beside)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        slow = wheels(ws, env=env)
        fast = settle(ws, env=env)
        assert (fast.stdout, fast.stderr) == (slow.stdout, slow.stderr)
        (beside / "new_module.py").write_text("")  # a name that stays: the slow run
        assert not wheels(ws, env=env).replayed
    finally:
        stop.set()
        thread.join()


def test_a_run_that_builds_or_fails_leaves_no_record(ws: Workspace) -> None:
    (ws.root / replay.RECORD).unlink(missing_ok=True)
    entries = list((ws.cache / "wheels").rglob("entry.json"))
    for entry in entries:
        entry.unlink()
    run = wheels(ws)
    assert ".  build:repro_pure" in run.stdout
    assert not (ws.root / replay.RECORD).exists()  # a run that built is no no-op
    ws.lock.write_text(ws.lock.read_text().replace("[profiles.pure]", "[profiles.pure]\nbogus = 1", 1))
    cmd = [sys.executable, str(ws.root / "reprostack-entry.py"), "wheels", "profile=pure", f"lock={ws.lock.name}",
           f"cache={ws.cache}"]  # fmt: skip
    done = subprocess.run(cmd, cwd=ws.root, env=ws.env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert not (ws.root / replay.RECORD).exists()
