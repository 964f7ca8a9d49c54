"""tasks/core/net.py against a real HTTP server on loopback: REPRO_NET_TIMEOUT reaches the registry's requests,
and the remote cache's session tries a failing request 3 times, 0.5 s and 1 s apart."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tasks.cli.oci import resolve_digest
from tasks.core import net
from tasks.core.errors import ImageError
from tasks.core.imageref import parse_reference
from tasks.store.remote import HttpStore, RemoteUnavailable


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    delay_s = 0.0  # before every answer
    status = 200
    release: threading.Event
    hits: list[tuple[str, float]]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def _answer(self) -> None:
        self.server.hits.append((self.command, time.monotonic()))
        if self.server.release.wait(self.server.delay_s):
            return  # the test is over
        self.send_response(self.server.status)
        self.send_header("Docker-Content-Digest", "sha256:" + "a" * 64)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_PUT = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    srv.release, srv.hits = threading.Event(), []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()
        thread.join(10)


def _ref(srv: _Server) -> str:
    return f"127.0.0.1:{srv.server_address[1]}/reprostack/base:1"


def test_net_timeout_reaches_the_registry(server: _Server, monkeypatch: pytest.MonkeyPatch) -> None:
    server.delay_s = 30.0
    monkeypatch.setenv("REPRO_NET_TIMEOUT", "0.5")
    assert net.timeout() == 0.5
    started = time.monotonic()
    with pytest.raises(ImageError, match=r"cannot reach registry 127\.0\.0\.1:\d+ for .*timed out.*0\.5"):
        resolve_digest(parse_reference(_ref(server)))
    assert time.monotonic() - started < 10
    assert [method for method, _ in server.hits] == ["HEAD"]  # one try: only the remote cache retries


def test_the_registry_answers_within_the_timeout(server: _Server, monkeypatch: pytest.MonkeyPatch) -> None:
    server.delay_s = 0.1
    monkeypatch.setenv("REPRO_NET_TIMEOUT", "5")
    assert resolve_digest(parse_reference(_ref(server))) == "sha256:" + "a" * 64


def test_net_timeout_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REPRO_NET_TIMEOUT", raising=False)
    assert net.timeout() == net.DEFAULT_TIMEOUT_S == 60


def test_the_remote_tries_a_server_error_three_times(server: _Server, tmp_path: Path) -> None:
    server.status = 503
    store = HttpStore(f"http://127.0.0.1:{server.server_address[1]}", timeout=5)
    for call, method in (
        (lambda: store.get("ac/k"), "GET"),
        (lambda: store.put("ac/k", b"x"), "PUT"),
        (lambda: store.download("cas/k", tmp_path / "blob", 10), "GET"),
    ):
        server.hits.clear()
        with pytest.raises(RemoteUnavailable, match=rf"^{method} http://127\.0\.0\.1:\d+/\w+/k: HTTP 503$"):
            call()
        assert [m for m, _ in server.hits] == [method] * 3
        waits = [b - a for (_, a), (_, b) in zip(server.hits, server.hits[1:], strict=False)]
        assert 0.45 < waits[0] < 0.9 and 0.95 < waits[1] < 1.5, waits
