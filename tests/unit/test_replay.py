"""tasks/core/replay.py: what a traced run keeps as its inputs, and each kind of change that ends a replay.

The traced runs are small scripts in processes of their own (tracing puts wrappers in front of ``os.stat`` and
adds an audit hook for the life of the process), in a directory of files they read in each of the ways a run
reads: opened, ``stat``-ed, looked for and missing, listed, and written into.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    replay.finish()
"""


def run(where: Path, mode: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHONPATH": str(REPO), **env}
    environ.pop("REPRO_NOOP_REPLAY", None)
    environ.pop("PYTEST_CURRENT_TEST", None)  # "(setup)" in the fixture, "(call)" in the test: another environment
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], cwd=where, env=environ, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.fixture
def where(tmp_path: Path) -> Path:
    (tmp_path / "input.txt").write_text("input\n")
    (tmp_path / "stat-only.txt").write_text("size\n")
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "a").write_text("")
    (tmp_path / "out").mkdir()
    run(tmp_path, "record")  # the record
    run(tmp_path, "record")  # the same again: confirmed
    return tmp_path


def replayed(where: Path, **env: str) -> bool:
    done = run(where, "check", **env)
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
    elif change == "a name where the run wrote":
        (where / "out" / "other.txt").write_text("")
    else:
        env["SOME_VARIABLE"] = "1"
    assert not replayed(where, **env)


def test_a_record_that_is_not_one_does_not_answer(where: Path) -> None:
    import json

    record = where / replay.RECORD
    doc = json.loads(record.read_text())
    record.write_text(json.dumps({**doc, "output": [[3, "elsewhere"]]}))
    assert not replayed(where)
    record.write_text(record.read_text()[:100])  # cut short
    assert not replayed(where)


def test_an_unconfirmed_record_does_not_answer(tmp_path: Path) -> None:
    for name in ("input.txt", "stat-only.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "listed").mkdir()
    (tmp_path / "out").mkdir()
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
