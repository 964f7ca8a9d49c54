"""Environmental faults as they happen (issue 20): a full disk under wheels/ and under the build logs.

A small tmpfs, filled up, is the full disk; the runs are real `doit` runs of the example lock's
pure-Python package (no compiler needed). Each fault must end in one line naming the path, the error's
own exit status, no traceback, and nothing half-written.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import PURE_PROFILE, Workspace, small_tmpfs

pytestmark = pytest.mark.integration


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a 1 MiB tmpfs with a few KiB left."""
    with small_tmpfs(tmp_path / "small", "1m") as small:
        with (small / "filler").open("wb") as fh, contextlib.suppress(OSError):
            fh.write(b"\0" * ((1 << 20) - (8 << 10)))
        yield small


def one_clear_line(res: subprocess.CompletedProcess[str], where: Path) -> None:
    out = res.stdout + res.stderr
    assert res.returncode == 10, out  # ReproError: the environment
    assert "Traceback" not in out, out
    lines = [line for line in res.stderr.splitlines() if "No space left on device" in line]
    assert len(lines) == 1 and str(where) in lines[0], res.stderr


def test_full_disk_under_wheels_leaves_no_partial_file_and_no_manifest(workspace: Workspace, full_disk: Path) -> None:
    ws = workspace
    ws.lock.write_text(ws.lock.read_text() + PURE_PROFILE)
    ws.doit("wheels", "profile=pure")  # the wheels are in the cache; only wheels/ is on the full disk
    out = full_disk / "wheels"
    res = ws.doit("wheels", "profile=pure", f"wheels={out}", check=False)
    one_clear_line(res, out)
    assert not (out / "manifest.json").exists()  # an incomplete wheelhouse says so
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], list(out.iterdir())  # no temporary copy
    (full_disk / "filler").unlink()
    ws.doit("wheels", "profile=pure", f"wheels={out}")
    assert (out / "manifest.json").is_file()


def test_full_disk_under_the_build_logs_is_one_clear_line(workspace: Workspace, full_disk: Path) -> None:
    ws = workspace
    ws.lock.write_text(ws.lock.read_text() + PURE_PROFILE)
    res = ws.doit("wheels", "profile=pure", f"builddir={full_disk / 'build'}", check=False)
    one_clear_line(res, full_disk / "build")
    assert not (ws.wheels / "manifest.json").exists()


def test_a_run_with_another_builddir_in_the_same_directory_is_refused(workspace: Workspace) -> None:
    """Two runs in one directory share doit's database (.doit.db) whatever their builddir=: the second
    refuses at once with one line, not later with sqlite's "database is locked"."""
    from filelock import FileLock

    ws = workspace
    ws.lock.write_text(ws.lock.read_text() + PURE_PROFILE)
    with FileLock(str(ws.root / ".doit.db.lock")):  # what the first run, with builddir=build, holds
        res = ws.doit("wheels", "profile=pure", f"builddir={ws.root / 'other-build'}", check=False)
    assert res.returncode == 10, res.stdout + res.stderr
    assert "doit's database of this directory, is in use by another doit run" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "database is locked" not in res.stderr
    ws.doit("wheels", "profile=pure", f"builddir={ws.root / 'other-build'}")  # once it is free, it runs
