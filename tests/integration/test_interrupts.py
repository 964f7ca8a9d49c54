"""Interrupted downloads (issue 26, item 5), as they happen: a server on loopback that trickles its
files, a real `doit` run stopped by a real SIGTERM or SIGINT in the middle of a download, and one
killed outright (SIGKILL) whose temporary tree the next run removes.

An interrupted download stops as an interrupted build does: one `interrupted: stopped …` line, the
task's own line, the signal's status (128 + its number), no traceback, nothing left in the cache. A second
Ctrl-C during a build (issue 55, item 3) ends the run at once, as cleanly: status 130, still one
`interrupted:` line, no traceback, no staged tree or cache temporary left.
"""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import PURE_PROFILE, Workspace, make_workspace

from tasks.store.cache import temporary_dir

pytestmark = pytest.mark.integration


class TrickleServer:
    """Serves ``directory`` on loopback; a file whose path ``slow`` accepts is sent a few bytes at a time
    (its full Content-Length announced), while ``trickling`` is set. ``started`` is set once such a
    body has begun."""

    def __init__(self, directory: Path, slow: Callable[[str], bool]) -> None:
        self.directory = directory
        self.slow = slow
        self.trickling = True
        self.started = threading.Event()
        outer = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(outer.directory), **kwargs)

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                path = Path(self.translate_path(self.path))
                if not (outer.trickling and outer.slow(self.path) and path.is_file()):
                    super().do_GET()
                    return
                data = path.read_bytes()
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                outer.started.set()
                try:
                    for i in range(0, len(data), 16):  # a few KB: minutes at this pace
                        self.wfile.write(data[i : i + 16])
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:
                    pass  # the client went away: what the test wants

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> TrickleServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def trickle(published: Path) -> Iterator[TrickleServer]:
    """The published fixtures, with source archives (url and pypi kinds) and wheels trickled."""
    with TrickleServer(published, lambda path: path.endswith((".tar", ".whl"))) as srv:
        yield srv


def start(ws: Workspace, spawned: list[subprocess.Popen[str]], srv: TrickleServer, *args: str) -> subprocess.Popen[str]:
    """``doit ARGS``, returned once a trickled download of it has begun."""
    srv.started.clear()
    proc = ws.popen(*args)
    spawned.append(proc)
    deadline = time.monotonic() + 300  # a loaded host: the pure package builds before the closure fetches
    while not srv.started.wait(0.2):
        assert proc.poll() is None, f"the run ended before its download: {proc.communicate()[0]}"
        assert time.monotonic() < deadline, "the download never started"
    time.sleep(0.5)  # well inside the body
    return proc


def temporaries(cache: Path) -> list[str]:
    """What the cache holds of unfinished work: tmp/ and fetched/.fetch-* (and their locks)."""
    found = [p.name for p in (cache / "tmp").iterdir()] if (cache / "tmp").is_dir() else []
    fetched = cache / "fetched"
    return found + ([p.name for p in fetched.iterdir() if p.name.startswith(".")] if fetched.is_dir() else [])


def stopped_cleanly(proc: subprocess.Popen[str], sig: signal.Signals, ws: Workspace) -> str:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, out  # as a build interrupted by that signal
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "interrupted: stopped 1 download(s), cleaning up" in out, out
    assert temporaries(ws.cache) == [], out
    assert list((ws.root / "build" / "run").glob("*.json")) == [], out  # ended whole: nothing for the next run
    return out


@pytest.mark.parametrize(
    ("sig", "options"),
    [(signal.SIGTERM, ()), (signal.SIGINT, ()), (signal.SIGINT, ("-n", "1"))],
    ids=["SIGTERM", "SIGINT", "SIGINT-main-thread"],  # -n 1: the download runs in the thread the handler runs in
)
def test_an_interrupted_source_archive_download_stops_cleanly(
    tmp_path: Path,
    trickle: TrickleServer,
    spawned: list[subprocess.Popen[str]],
    sig: signal.Signals,
    options: tuple[str, ...],
) -> None:
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", trickle.url)
    proc = start(ws, spawned, trickle, *options, "fetch:repro-pybind")
    assert [n for n in temporaries(ws.cache) if n.startswith("src-repro-pybind.")], "no download under way"
    out = stopped_cleanly(proc, sig, ws)
    assert "Interrupted: download of http://127.0.0.1:" in out and "repro_pybind-0.1.0.tar interrupted" in out, out
    assert not (ws.cache / "sources").is_dir() or not any((ws.cache / "sources").iterdir())
    trickle.trickling = False
    ws.doit("fetch:repro-pybind")  # the next run fetches it whole
    assert temporaries(ws.cache) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_an_interrupted_closure_wheel_download_stops_cleanly(
    tmp_path: Path, trickle: TrickleServer, spawned: list[subprocess.Popen[str]], sig: signal.Signals
) -> None:
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", trickle.url)
    ws.lock.write_text(ws.lock.read_text() + PURE_PROFILE)
    proc = start(ws, spawned, trickle, "wheels", "profile=pure")
    assert [n for n in temporaries(ws.cache) if n.startswith(".fetch-")], "no closure download under way"
    out = stopped_cleanly(proc, sig, ws)
    assert "Interrupted: download of http://127.0.0.1:" in out and ".whl interrupted" in out, out
    assert not (ws.wheels / "manifest.json").exists()
    trickle.trickling = False
    ws.doit("wheels", "profile=pure")
    assert (ws.wheels / "manifest.json").is_file()
    assert temporaries(ws.cache) == []


def test_what_a_killed_download_left_is_removed_by_the_next_run_but_a_live_runs_is_kept(
    tmp_path: Path, trickle: TrickleServer, spawned: list[subprocess.Popen[str]]
) -> None:
    """SIGKILL leaves the half-downloaded archive in the cache; the next run that uses the cache, from
    another workspace (so not through the killed run's own record), removes it, and never the
    temporary tree of a run that is still downloading."""
    cache = tmp_path / "cache"
    killed_ws = make_workspace(tmp_path / "killed", cache, trickle.url)
    killed = start(killed_ws, spawned, trickle, "fetch:repro-pybind")
    killed.send_signal(signal.SIGKILL)
    killed.communicate(timeout=60)
    left = [n for n in temporaries(cache) if not n.endswith(".lock")]
    assert len(left) == 1 and left[0].startswith("src-repro-pybind."), left
    assert (cache / "tmp" / left[0] / "archive").is_file()  # the partial download

    # The next run, from another workspace (so not through the killed run's own record): it removes
    # the leftover as it starts, and downloads in turn.
    live = start(make_workspace(tmp_path / "live", cache, trickle.url), spawned, trickle, "fetch:repro-cuda")
    assert not (cache / "tmp" / left[0]).exists()
    live_tmp = [n for n in temporaries(cache) if not n.endswith(".lock")]
    assert len(live_tmp) == 1 and live_tmp[0].startswith("src-repro-cuda."), live_tmp
    # A third run while that one downloads: neither its tree nor one this test process holds is touched.
    with temporary_dir(cache / "fetched", ".fetch-") as held:
        res = make_workspace(tmp_path / "next", cache, trickle.url).doit("fetch:repro-pure")
        assert "temporary tree" not in res.stderr, res.stderr
        assert (cache / "tmp" / live_tmp[0] / "archive").is_file(), "a live run's download was removed"
        assert held.is_dir()
    assert live.poll() is None
    live.send_signal(signal.SIGTERM)
    out, _ = live.communicate(timeout=120)
    assert "removed 1 temporary tree(s) that interrupted runs left in the cache" in out, out
    assert live.returncode == 128 + signal.SIGTERM, out
    assert temporaries(cache) == []


def interrupted_twice(proc: subprocess.Popen[str]) -> str:
    """Ctrl-C, and a second one 0.1 s later (a user pressing it twice); the run's output, once it ended."""
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert len([line for line in out.splitlines() if line.startswith("interrupted:")]) == 1, out
    return out


def trees(cache: Path) -> list[str]:
    """The cache's temporary trees (:func:`temporaries` without the free locks the next run sweeps)."""
    return [n for n in temporaries(cache) if not n.endswith(".lock")]


@pytest.mark.needs_headers
def test_a_second_ctrl_c_during_a_build_ends_the_run_at_once(
    workspace: Workspace, spawned: list[subprocess.Popen[str]]
) -> None:
    """Two Ctrl-C 0.1 s apart while a compiler runs (issue 55, item 3): exit 130, one `interrupted:` line,
    no traceback (the second raised KeyboardInterrupt into doit's runner, waiting on its result queue), and
    nothing staged or partial left behind, nor a record for the next run."""
    ws = workspace

    def compiling() -> bool:
        """A compiler of the run: its environment names this workspace's cache (REPRO_WAIT_LOG)."""
        for environ in Path("/proc").glob("[0-9]*/environ"):
            try:
                if f"REPRO_WAIT_LOG={ws.cache}".encode() in environ.read_bytes():
                    if b"cc1plus" in (environ.parent / "cmdline").read_bytes():
                        return True
            except OSError:
                continue
        return False

    proc = ws.popen("wheels")
    spawned.append(proc)
    deadline = time.monotonic() + 300
    while not compiling():
        assert proc.poll() is None, f"the run ended before a compiler ran: {proc.communicate()[0]}"
        assert time.monotonic() < deadline, "no compiler ever ran"
        time.sleep(0.05)
    stage = ws.root / "build" / "stage"
    assert any(stage.iterdir()), "no tree staged"
    out = interrupted_twice(proc)
    assert not stage.exists() or list(stage.iterdir()) == [], out
    assert trees(ws.cache) == [], out
    assert not ws.wheels.exists(), out
    assert list((ws.root / "build" / "run").glob("*.json")) == [], out  # ended whole: nothing for the next run
    res = ws.doit("fetch:repro-pure")  # the next run: nothing of this one to clean up, and its locks swept
    assert "cleaned up after an earlier run" not in res.stderr, res.stderr
    assert temporaries(ws.cache) == []


#: A doit-like run whose build's clean-up is slow (a large tree on a loaded host): its workspace claimed, a
#: staged tree and a cache temporary recorded, the command run in a worker thread, the main thread waiting
#: on a queue as doit's runner does.
SLOW_CLEAN_UP = """
import os, queue, sys, threading, time
from pathlib import Path
from tasks.core import proc, workspace
from tasks.core.errors import ReproError
from tasks.core.fsutil import rmtree
from tasks.store.cache import Cache

root = Path(sys.argv[1])
workspace.claim(root / "build", ["wheels"])
proc.install_interrupt_handler()
done = queue.Queue()

def build():
    stage = root / "build" / "stage" / "pkg-0123456789ab"
    workspace.tree(stage, live=True)
    try:
        with Cache(root / "cache").staging("out-pkg") as out:
            (stage / "src").mkdir(parents=True)
            (stage / "src" / "pkg.cpp").write_text("int pkg;")
            (out / "pkg-0.1-cp311-linux_x86_64.whl").write_bytes(b"PK")  # half written
            try:
                proc.run(["bash", "-c", "echo started; sleep 300"], env=dict(os.environ), log=root / "build.log")
            except ReproError:
                time.sleep(120)
    finally:
        rmtree(stage)
        workspace.tree(stage, live=False)
    done.put(1)

threading.Thread(target=build, daemon=True).start()
done.get()
sys.exit(1)
"""


def test_a_second_ctrl_c_removes_what_a_slow_clean_up_had_not(
    tmp_path: Path, spawned: list[subprocess.Popen[str]]
) -> None:
    """The second Ctrl-C comes while the build's thread is still cleaning up: the at-once ending removes its
    staged tree and its cache temporary itself, and drops the run record."""
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_CLEAN_UP, str(tmp_path)],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(repo)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    spawned.append(proc)
    log = tmp_path / "build.log"
    deadline = time.monotonic() + 60
    while not (log.exists() and "started" in log.read_text().splitlines()):
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    out = interrupted_twice(proc)
    assert "exiting now (second signal): removed 2 temporary tree(s)" in out, out
    assert list((tmp_path / "build" / "stage").iterdir()) == [], out
    assert trees(tmp_path / "cache") == [], out
    assert list((tmp_path / "build" / "run").glob("*.json")) == [], out
