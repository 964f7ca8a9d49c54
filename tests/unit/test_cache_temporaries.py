"""The cache's temporary trees: held by their run, removed by a later one once that run is gone.

Real processes hold them (tasks.store.cache.temporary_dir in a child Python), and are killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tasks.store.cache import Cache, sweep, temporary_dir

REPO = Path(__file__).resolve().parents[2]

_HOLDER = """
import sys, time
from pathlib import Path
from tasks.store.cache import temporary_dir
with temporary_dir(Path(sys.argv[1]), sys.argv[2]) as tmp:
    (tmp / "partial").write_bytes(b"x" * 1000)
    print(tmp, flush=True)
    time.sleep(300)
"""


def hold(spawned: list[subprocess.Popen[str]], parent: Path, prefix: str) -> tuple[subprocess.Popen[str], Path]:
    """A process holding a temporary tree under ``parent``, and that tree."""
    p = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(parent), prefix],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    spawned.append(p)
    assert p.stdout is not None
    return p, Path(p.stdout.readline().strip())


def test_a_live_runs_tree_is_kept_and_a_killed_runs_removed(
    tmp_path: Path, spawned: list[subprocess.Popen[str]]
) -> None:
    cache = Cache(tmp_path / "cache")
    cache.ensure()
    live, kept = hold(spawned, cache.root / "tmp", "src-live.")
    killed, left = hold(spawned, cache.root / "fetched", ".fetch-")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert left.is_dir() and (left / "partial").is_file()  # SIGKILL runs no cleanup
    assert cache.sweep() == 1
    assert not left.exists() and not left.with_name(left.name + ".lock").exists()
    assert (kept / "partial").is_file()  # its run still holds it
    assert cache.sweep() == 0
    live.send_signal(signal.SIGTERM)  # ends it without its cleanup either
    live.wait()
    assert cache.sweep() == 1
    assert sorted(os.listdir(cache.root / "tmp")) == []
    assert [n for n in os.listdir(cache.root / "fetched") if n.startswith(".")] == []


def test_a_tree_from_before_the_locks_is_removed_and_this_process_own_kept(tmp_path: Path) -> None:
    old = tmp_path / "tmp" / "src-old.abc123"  # made by a version without the locks: nobody holds it
    old.mkdir(parents=True)
    stray = tmp_path / "tmp" / "src-gone.def456.lock"  # a lock whose tree went, its run with it
    stray.write_text("")
    with temporary_dir(tmp_path / "tmp", "src-mine.") as mine:
        assert sweep(tmp_path / "tmp") == 1
        assert mine.is_dir() and not old.exists() and not stray.exists()
    assert not mine.exists()
    assert os.listdir(tmp_path / "tmp") == []


def test_a_fresh_tree_is_never_taken_by_a_sweep_that_runs_meanwhile(tmp_path: Path) -> None:
    """A sweep in a loop while trees come and go: none is removed under its holder."""
    parent = tmp_path / "tmp"
    parent.mkdir()
    sweeper = subprocess.Popen(
        [sys.executable, "-c", "import sys, pathlib\nfrom tasks.store.cache import sweep\n"
         "while True: sweep(pathlib.Path(sys.argv[1]))", str(parent)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 5
        made = 0
        while time.monotonic() < deadline:
            with temporary_dir(parent, "src-race.") as tmp:
                (tmp / "file").write_text("x")  # fails if a sweep removed the tree
                made += 1
        assert made > 10
    finally:
        sweeper.kill()
        sweeper.wait()
