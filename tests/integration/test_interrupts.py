"""Interrupted downloads (issue 26, item 5), as they happen: a server on loopback that trickles its
files, a real `doit` run stopped by a real SIGTERM or SIGINT in the middle of a download, and one
killed outright (SIGKILL) whose temporary tree the next run removes.

An interrupted download stops as an interrupted build does: one `interrupted: stopped …` line, the
task's own line, the signal's status (128 + its number), no traceback, nothing left in the cache.
"""

from __future__ import annotations

import http.server
import signal
import subprocess
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
