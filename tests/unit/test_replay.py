"""tasks/core/replay.py: what a traced run keeps as its inputs, and each kind of change that ends a replay.

The traced runs are small scripts in processes of their own (tracing puts wrappers in front of ``os.stat`` and
adds an audit hook for the life of the process), in a directory of files they read in each of the ways a run
reads: opened, ``stat``-ed, looked for and missing, listed, and written into.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tasks.core import replay

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, os, sys
from tasks.core import replay
replay.RACY_SECONDS = 0.0  # the files here are seconds old
if replay.replay(["doit", "wheels"]):
    sys.exit(0)
if sys.argv[1] == "check":
    print("slow")
else:
    open("input.txt").read()
    os.stat("stat-only.txt")
    os.path.exists("missing.txt")
    os.listdir("listed")
    os.stat("looked-at").st_mtime  # a directory's mtime as a cache's key (importlib.metadata's of sys.path)
    with open("out/written.txt", "w") as f:
        f.write("x")
    from filelock import FileLock
    FileLock("ws.lock").acquire()  # the workspace's lock, held for the run (tasks/core/workspace.py)
    os.listdir("out")  # a scan for other runs' claims, then this run's own, gone when it ends (build/run)
    claim = f"out/{os.getpid()}.json"
    open(claim, "w").close()
    atexit.register(os.unlink, claim)
    print("hello")
    print("a warning", file=sys.stderr)
    print("bye")
    # The lock and the wheelhouse's manifest the record is made from.
    replay.finish(os.environ.get("REPLAY_TEST_LOCK", "input.txt"), "stat-only.txt")
"""


def run(where: Path, mode: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": str(REPO), **env}
    environ.pop("REPRO_NOOP_REPLAY", None)
    environ.pop("PYTEST_CURRENT_TEST", None)  # "(setup)" in the fixture, "(call)" in the test: another environment
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], cwd=where, env=environ, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr
    return done


def _tree(tmp_path: Path) -> None:
    """The files and directories the script reads in each of its ways."""
    (tmp_path / "input.txt").write_text("input\n")
    (tmp_path / "stat-only.txt").write_text("size\n")
    for name in ("listed", "looked-at", "out"):
        (tmp_path / name).mkdir()


@pytest.fixture
def where(tmp_path: Path) -> Path:
    _tree(tmp_path)
    (tmp_path / "listed" / "a").write_text("")
    run(tmp_path, "record")  # the record
    run(tmp_path, "record")  # the same again: confirmed
    return tmp_path


def replayed(where: Path, timeout: float = 120, **env: str) -> bool:
    done = run(where, "check", timeout, **env)
    if done.stdout.startswith("slow"):
        return False
    assert (done.stdout, done.stderr) == ("hello\nbye\n", "a warning\n")
    return True


def test_a_confirmed_record_replays_what_the_run_printed(where: Path) -> None:
    assert replayed(where)
    assert replayed(where)  # and keeps doing so
    (where / "out" / "written.txt").write_text("what the run writes is no input")
    assert replayed(where)


def test_a_lock_the_run_took_held_by_another_process_ends_the_replay(where: Path) -> None:
    from filelock import FileLock

    with FileLock(str(where / "ws.lock")):
        assert not replayed(where)
    assert replayed(where)


@pytest.mark.parametrize(
    "change",
    [
        "content of a file read",
        "a file stat-ed alone",
        "a file looked for appears",
        "a name in a listed directory",
        "a name in a directory looked at",
        "a name where the run wrote",
        "the environment",
    ],
)
def test_each_change_to_what_the_run_read_ends_the_replay(where: Path, change: str) -> None:
    env: dict[str, str] = {}
    if change == "content of a file read":
        with (where / "input.txt").open("a") as f:
            f.write("more\n")
    elif change == "a file stat-ed alone":
        os.utime(where / "stat-only.txt", ns=(1, 1))
    elif change == "a file looked for appears":
        (where / "missing.txt").write_text("")
    elif change == "a name in a listed directory":
        (where / "listed" / "b").write_text("")
    elif change == "a name in a directory looked at":
        (where / "looked-at" / "b").write_text("")
    elif change == "a name where the run wrote":
        (where / "out" / "other.txt").write_text("")
    else:
        env["SOME_VARIABLE"] = "1"
    assert not replayed(where, **env)


def test_a_record_that_is_not_one_does_not_answer(where: Path) -> None:
    record = where / replay.RECORD
    doc = json.loads(record.read_text())
    record.write_text(json.dumps({**doc, "output": [[3, "elsewhere"]]}))
    assert not replayed(where)
    record.write_text(record.read_text()[:100])  # cut short
    assert not replayed(where)


def test_an_unconfirmed_record_does_not_answer(tmp_path: Path) -> None:
    _tree(tmp_path)
    run(tmp_path, "record")
    assert not replayed(tmp_path)


@pytest.mark.parametrize(
    ("argv", "ok"),
    [
        (["doit", "wheels"], True),
        (["reprostack", "wheels", "profile=no-fa2", "mirror=/m"], True),
        (["doit", "run", "wheels"], True),
        (["doit"], True),  # the default task: wheels
        (["doit", "profile=quick"], True),
        (["doit", "wheels", "verify"], False),
        (["doit", "wheels", "-n", "2"], False),
        (["doit", "--db-file=x", "wheels"], False),
        (["doit", "-d", "elsewhere", "wheels"], False),
        (["doit", "plan"], False),
    ],
)
def test_only_wheels_with_variables_is_replayed(argv: list[str], ok: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REPRO_NOOP_REPLAY", raising=False)
    assert replay.eligible(argv) is ok
    monkeypatch.setenv("REPRO_NOOP_REPLAY", "off")
    assert not replay.eligible(argv)


def test_what_proc_and_sys_are_kept_as() -> None:
    assert replay._kind("/proc/sys/user/max_user_namespaces", True) == "c"
    assert replay._kind("/sys/fs/cgroup/memory.max", True) == "c"
    assert replay._kind("/proc/self/ns/user", True) == "n"
    assert replay._kind("/proc/self/stat", True) is None and replay._kind("/proc/uptime", True) is None
    assert replay._kind("/etc/hosts", True) == "s" and replay._kind("/etc/hosts", False) == "l"


def _record(where: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((where / replay.RECORD).read_text())
    assert doc["confirmed"] is True and replayed(where)  # the record as written answers
    return doc


def _rewrite(where: Path, doc: Any) -> None:
    (where / replay.RECORD).write_text(json.dumps(doc))


def _hostile(doc: dict[str, Any], where: Path, case: str) -> Any:
    """The record with one field that does not hold up."""
    rows = doc["inputs"]
    if case == "own is a number":
        return {**doc, "own": 7}
    if case == "own names a number":
        return {**doc, "own": [*doc["own"], 7]}
    if case == "an input's path is a number":
        return {**doc, "inputs": [[rows[0][0], 5, rows[0][2]], *rows[1:]]}
    if case == "an input of no kind":
        return {**doc, "inputs": [["x", rows[0][1], rows[0][2]], *rows[1:]]}
    if case == "a stat of another type":
        return {**doc, "inputs": [[r[0], r[1], "big"] if r[0] == "s" else r for r in rows]}
    if case == "a relative path":
        return {**doc, "inputs": [*rows, ["s", "input.txt", None]]}
    if case == "the key is a list":
        return {**doc, "key": [doc["key"]]}
    if case == "confirmed is a string":
        return {**doc, "confirmed": "yes"}
    if case == "no input at all":
        return {**doc, "inputs": []}
    if case == "no lock named":
        return {k: v for k, v in doc.items() if k != "made_from"}
    if case == "a lock it did not read":
        return {**doc, "made_from": {**doc["made_from"], "lock": str(where / "elsewhere.lock")}}
    if case == "a manifest that is a directory":
        listed = str(where / "listed")
        return {**doc, "made_from": {**doc["made_from"], "manifest": listed}, "inputs": [*rows, ["s", listed, None]]}
    if case == "the record is a list":
        return [doc]
    raise AssertionError(case)


HOSTILE = ["own is a number", "own names a number", "an input's path is a number", "an input of no kind",
           "a stat of another type", "a relative path", "the key is a list", "confirmed is a string",
           "no input at all", "no lock named", "a lock it did not read", "a manifest that is a directory",
           "the record is a list"]  # fmt: skip


@pytest.mark.parametrize("case", HOSTILE)
def test_a_record_that_does_not_hold_up_is_no_record(where: Path, case: str) -> None:
    """Each is read as no record, not as a traceback nor as a replay: the run takes the long way."""
    _rewrite(where, _hostile(_record(where), where, case))
    assert not replayed(where)


def test_a_record_that_reads_nothing_does_not_replay_a_wheelhouse_that_is_gone(where: Path) -> None:
    doc = _record(where)
    (where / "stat-only.txt").unlink()  # the wheelhouse's manifest, gone
    _rewrite(where, {**doc, "inputs": [r for r in doc["inputs"] if not r[1].endswith("stat-only.txt")]})
    assert not replayed(where)


def test_a_fifo_where_the_record_or_an_input_is_read_does_not_hang(where: Path) -> None:
    doc = _record(where)
    fifo = where / "fifo"
    os.mkfifo(fifo)
    for kind, value in (("c", "x"), ("s", [0] * 6), ("d", [0, []]), ("l", [0] * 6)):
        _rewrite(where, {**doc, "inputs": [*doc["inputs"], [kind, str(fifo), value]]})
        assert not replayed(where, timeout=30)
    (where / replay.RECORD).unlink()
    os.mkfifo(where / replay.RECORD)  # the record itself
    assert not replayed(where, timeout=30)


def test_a_record_behind_a_link_is_no_record(where: Path) -> None:
    doc = _record(where)
    (where / replay.RECORD).unlink()
    (where / "elsewhere.json").write_text(json.dumps(doc))
    (where / replay.RECORD).symlink_to(where / "elsewhere.json")
    assert not replayed(where)


def test_a_run_that_did_not_read_its_lock_writes_no_record(tmp_path: Path) -> None:
    _tree(tmp_path)
    run(tmp_path, "record", REPLAY_TEST_LOCK="never-read.lock")
    assert not (tmp_path / replay.RECORD).exists()


def test_a_name_that_came_and_went_ends_no_replay(where: Path) -> None:
    """A directory is kept as its names: another process's temporary file in a directory the run listed or
    looked at (a checkout on ``sys.path`` where other builds write) moves its mtime, not what the run saw."""
    for directory in ("listed", "looked-at", "."):
        (where / directory / "passing.tmp").write_text("")
        (where / directory / "passing.tmp").unlink()
        assert replayed(where), directory
