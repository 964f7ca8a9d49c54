"""The remote wheel cache against a real nginx (WebDAV PUT) on loopback, and sharded builds."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    QUICK,
    Workspace,
    built_packages,
    copy_cache,
    entries,
    make_workspace,
    object_counts,
    require,
    shas,
    warm_workspace,
)
from serve import FixtureServer

from tasks.core.fsutil import rmtree
from tasks.core.treehash import file_sha256
from tasks.store.remote import history_key

pytestmark = pytest.mark.integration

NGINX_CONF = """\
daemon off;
worker_processes 1;
{user}
pid {root}/nginx.pid;
error_log {root}/error.log;
events {{ worker_connections 64; }}
http {{
    access_log {root}/access.log;
    client_body_temp_path {root}/body;
    proxy_temp_path {root}/proxy;
    fastcgi_temp_path {root}/fastcgi;
    uwsgi_temp_path {root}/uwsgi;
    scgi_temp_path {root}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {store};
        location / {{
            dav_methods PUT;
            create_full_put_path on;
            client_max_body_size 0;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Nginx:
    """nginx in the foreground serving ``store`` as a Bazel HTTP cache (GET, PUT)."""

    def __init__(self, root: Path, store: Path) -> None:
        exe = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
        if exe is None:
            message = "nginx not installed: apt-get install nginx-light (scripts/ci-docker.sh installs it in CI)"
            require(message)
        self.root, self.store, self.port = root, store, free_port()
        root.mkdir(parents=True, exist_ok=True)
        store.mkdir(parents=True, exist_ok=True)
        user = "user root;" if os.geteuid() == 0 else ""  # workers must reach the test's private tmp dirs
        conf = root / "nginx.conf"
        conf.write_text(NGINX_CONF.format(user=user, root=root, port=self.port, store=store))
        self.proc = subprocess.Popen(
            [exe, "-p", str(root), "-c", str(conf), "-e", str(root / "error.log")],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.1)
        self.stop()
        log = (root / "error.log").read_text() if (root / "error.log").exists() else ""
        pytest.fail(f"nginx did not start on port {self.port}:\n{log}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Nginx]:
    srv = Nginx(tmp_path / "nginx", tmp_path / "store")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def seeded(
    tmp_path_factory: pytest.TempPathFactory, quick_cache: Path, server: FixtureServer
) -> Iterator[tuple[Nginx, Workspace]]:
    """A remote filled by a workspace that built the quick profile with remote_write=on."""
    root = tmp_path_factory.mktemp("seeded")
    srv = Nginx(root / "nginx", root / "store")
    try:
        ws = warm_workspace(root / "a", quick_cache, server)
        res = ws.doit("wheels", "profile=quick", f"remote={srv.url}", "remote_write=on")
        assert sorted(built_packages(res.stdout)) == QUICK
        assert res.stdout.count("uploaded ") == len(QUICK)
        yield srv, ws
    finally:
        srv.stop()


@pytest.mark.needs_nvcc
def test_fresh_workspace_restores_everything_from_the_remote(
    seeded: tuple[Nginx, Workspace], tmp_path: Path, server: FixtureServer
) -> None:
    srv, a = seeded
    b = make_workspace(tmp_path / "b", tmp_path / "cache-b", server.url)
    res = b.doit("wheels", "profile=quick", f"remote={srv.url}")
    assert built_packages(res.stdout) == []
    assert sorted(line.split()[1] for line in res.stdout.splitlines() if line.startswith("restored ")) == QUICK
    assert shas(b) == shas(a)
    assert all(e["note"] == "restored from remote" for e in entries(b.cache).values())
    assert "WARNING" not in res.stderr


@pytest.mark.needs_nvcc
def test_altered_blob_is_detected_and_rebuilt(
    seeded: tuple[Nginx, Workspace], tmp_path: Path, quick_cache: Path, server: FixtureServer
) -> None:
    srv, a = seeded
    store = tmp_path / "store"
    shutil.copytree(srv.store, store)
    good = shas(a)
    (store / "cas" / good["repro_pure"]).write_bytes(b"garbage, not the wheel")
    altered = Nginx(tmp_path / "nginx", store)
    try:
        c = warm_workspace(tmp_path / "c", quick_cache, server)
        res = c.doit("wheels", "profile=quick", f"remote={altered.url}")
    finally:
        altered.stop()
    assert "WARNING: remote blob" in res.stderr and "rejected" in res.stderr, res.stderr
    assert built_packages(res.stdout) == ["repro_pure"]
    assert shas(c) == good  # rebuilt bit for bit; the garbage went nowhere
    meta = entries(c.cache)
    assert "restored_from" not in meta["repro_pure"]
    assert {m["sha256"] for m in meta.values()} == set(good.values())
    for p in [*c.wheels.rglob("*"), *c.cache.joinpath("wheels").rglob("*")]:
        assert not (p.is_file() and p.read_bytes() == b"garbage, not the wheel"), p


@pytest.mark.needs_nvcc
def test_unresponsive_remote_builds_locally_in_bounded_time(
    tmp_path: Path, quick_cache: Path, server: FixtureServer
) -> None:
    # Every wheel but repro_pure's stays cached.
    ws = make_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)
    for entry in (ws.cache / "wheels").glob("*/*/entry.json"):
        if json.loads(entry.read_text())["package"] == "repro_pure":
            rmtree(entry.parent)
    with socket.socket() as hang:  # accepts connections (backlog) and never answers
        hang.bind(("127.0.0.1", 0))
        hang.listen(8)
        url = f"http://127.0.0.1:{hang.getsockname()[1]}"
        started = time.monotonic()
        res = ws.doit("wheels", "profile=quick", f"remote={url}", "remote_timeout=1", "remote_write=on")
        elapsed = time.monotonic() - started
    assert built_packages(res.stdout) == ["repro_pure"]
    assert "WARNING: remote cache" in res.stderr and "not consulted again" in res.stderr, res.stderr
    assert res.stderr.count("WARNING: remote cache") == 1
    assert "uploaded" not in res.stdout
    assert set(shas(ws)) == set(QUICK)
    # 3 tries of 1 s and 1.5 s of backoff: the remote costs seconds, then the run goes on without it.
    assert elapsed < 120, elapsed


@pytest.mark.needs_nvcc
def test_shards_fill_one_remote_and_a_third_workspace_assembles_without_compiling(
    nginx: Nginx, tmp_path: Path, quick_cache: Path, server: FixtureServer
) -> None:
    built: list[list[str]] = []
    for i in (1, 2):
        ws = warm_workspace(tmp_path / f"shard{i}", quick_cache, server)
        res = ws.doit("wheels", "profile=quick", f"shard={i}/2", f"remote={nginx.url}", "remote_write=on")
        built.append(sorted(built_packages(res.stdout)))
        assert f"shard {i}/2:" in res.stdout
        assert not (ws.wheels / "manifest.json").exists()
        # Each shard keeps its own build timeline, as a whole run does.
        trace = json.loads((ws.root / "build" / "trace.json").read_text())
        rows = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
        assert rows == set(built[-1]), (rows, built[-1])
    assert built[0] and built[1] and not set(built[0]) & set(built[1])
    assert sorted(built[0] + built[1]) == QUICK
    third = make_workspace(tmp_path / "third", tmp_path / "cache-third", server.url)
    res = third.doit("wheels", "profile=quick", f"remote={nginx.url}")
    assert built_packages(res.stdout) == []
    assert set(shas(third)) == set(QUICK)


def _puts(srv: Nginx) -> list[str]:
    """The paths of the PUT requests in nginx's access log so far."""
    log = (srv.root / "access.log").read_text() if (srv.root / "access.log").exists() else ""
    return [line.split('"PUT ', 1)[1].split()[0] for line in log.splitlines() if '"PUT ' in line]


@pytest.mark.needs_nvcc
def test_wheels_from_the_local_cache_are_uploaded_once(
    nginx: Nginx, tmp_path: Path, quick_cache: Path, server: FixtureServer
) -> None:
    # Wheels built before the remote was set: a local hit must still reach the remote with remote_write=on.
    hot = make_workspace(tmp_path / "hot", copy_cache(quick_cache, tmp_path / "cache"), server.url)
    res = hot.doit("wheels", "profile=quick", f"remote={nginx.url}", "remote_write=on")
    assert built_packages(res.stdout) == []
    assert res.stdout.count("uploaded ") == len(QUICK), res.stdout
    keys = {e["package"]: str(e["key"]) for e in entries(hot.cache).values()}
    history = [f"/ac/{history_key(p)}" for p in QUICK]  # each upload goes first in its package's history
    assert sorted(_puts(nginx)) == sorted(
        [f"/cas/{sha}" for sha in shas(hot).values()] + [f"/ac/{k}" for k in keys.values()] + history
    )

    # Already there: nothing is sent again.
    res = hot.doit("wheels", "profile=quick", f"remote={nginx.url}", "remote_write=on")
    assert "uploaded " not in res.stdout
    assert len(_puts(nginx)) == 3 * len(QUICK)

    # A record lost on the server: only the record goes up again, not the blob beside it.
    (nginx.store / "ac" / keys["repro_pure"]).unlink()
    res = hot.doit("wheels", "profile=quick", f"remote={nginx.url}", "remote_write=on")
    assert "uploaded repro_pure" in res.stdout and "the blob was there" in res.stdout
    assert _puts(nginx)[3 * len(QUICK) :] == [f"/ac/{keys['repro_pure']}", f"/ac/{history_key('repro_pure')}"]

    fresh = make_workspace(tmp_path / "fresh", tmp_path / "cache-fresh", server.url)
    res = fresh.doit("wheels", "profile=quick", f"remote={nginx.url}")
    assert built_packages(res.stdout) == []
    assert shas(fresh) == shas(hot)


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file()} if root.exists() else set()


@pytest.mark.needs_headers  # compiles the pybind fixture
def test_object_cache_is_shared_through_the_remote(nginx: Nginx, tmp_path: Path, server: FixtureServer) -> None:
    # Workspace a compiles and (remote_write=on) stores its objects under URL/ccache/.
    a = make_workspace(tmp_path / "a", tmp_path / "cache-a", server.url)
    res = a.doit("build:repro_pybind", f"remote={nginx.url}", "remote_write=on")
    assert f"shared with {nginx.url}/ccache" in res.stdout
    assert object_counts(res.stdout, "repro_pybind") == (0, 1)
    assert "remote object cache did not answer" not in res.stdout
    stored = _files(nginx.store / "ccache")
    assert stored, "no object reached the remote"
    (wheel_a,) = (tmp_path / "cache-a").glob("wheels/*/*/repro_pybind-*.whl")

    # Workspace b, empty caches, another action key for the same compile (so no wheel to restore):
    # the object comes from the remote, read-only, and the wheel is the same.
    b = make_workspace(tmp_path / "b", tmp_path / "cache-b", server.url)
    b.lock.write_text(b.lock.read_text() + '\n[profiles.moved.packages.repro_pybind.env]\nX_UNUSED = "1"\n')
    res = b.doit("build:repro_pybind", "profile=moved", f"remote={nginx.url}")
    assert built_packages(res.stdout) == ["repro_pybind"]
    assert object_counts(res.stdout, "repro_pybind") == (1, 0)
    (wheel_b,) = (tmp_path / "cache-b").glob("wheels/*/*/repro_pybind-*.whl")
    assert file_sha256(wheel_b) == file_sha256(wheel_a)
    assert _files(nginx.store / "ccache") == stored, "a read-only workspace wrote to the remote"


@pytest.mark.needs_headers  # compiles the pybind fixture
def test_object_cache_with_the_remote_down_compiles_locally(tmp_path: Path, server: FixtureServer) -> None:
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", server.url)
    started = time.monotonic()
    res = ws.doit("build:repro_pybind", f"remote=http://127.0.0.1:{free_port()}", "remote_write=on")
    assert object_counts(res.stdout, "repro_pybind") == (0, 1)
    # Said once, after the build, not left for the user to find in ccache's log.
    assert (
        "warning: repro_pybind: the remote object cache did not answer (timeout or error) for 1 of 1 compiles; "
        "they were compiled here and not uploaded"
    ) in res.stdout, res.stdout
    assert time.monotonic() - started < 120
