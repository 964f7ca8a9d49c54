#!/usr/bin/env python3
"""A loopback HTTP cache with GET/HEAD/PUT of files under a directory, for benchmarks on hosts without nginx.

It speaks the subset of the Bazel HTTP remote-cache layout that `remote=`
uses (``/ac/<key>``, ``/cas/<sha256>``), stores each PUT atomically and
counts the bytes it sent and received, so a benchmark can report the bytes a
restore moved. The tests use Debian's nginx with WebDAV instead; this stands
in on the GPU host, which has no nginx and no network:

    python3 scripts/cache_server.py DIR [PORT]
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Server(ThreadingHTTPServer):
    # socketserver listens with a backlog of 5. A parallel build's first wave
    # (64 ccache processes at once on a 64-core host) then overflows the
    # accept queue; the dropped connections are retried by the kernel only
    # after 1 s, past ccache's connect timeout, and those objects are never
    # shared. nginx listens with 511; the kernel caps this at somaxconn.
    request_queue_size = 1024


class CacheServer:
    """A ThreadingHTTPServer over ``root`` on 127.0.0.1, started in a daemon thread."""

    def __init__(self, root: Path, port: int = 0) -> None:
        self.root = root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._count = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def _path(self) -> Path | None:
                rel = self.path.split("?", 1)[0].lstrip("/")
                target = (server.root / rel).resolve()
                return target if target.is_relative_to(server.root) and rel else None

            def do_GET(self) -> None:
                self._get(body=True)

            def do_HEAD(self) -> None:
                self._get(body=False)

            def _get(self, *, body: bool) -> None:
                target = self._path()
                if target is None or not target.is_file():
                    self.send_error(404)
                    return
                data = target.read_bytes()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.send_header("Content-Type", "application/octet-stream")
                self.end_headers()
                if body:
                    self.wfile.write(data)
                    with server._count:
                        server.bytes_sent += len(data)

            def do_PUT(self) -> None:
                target = self._path()
                length = int(self.headers.get("Content-Length") or -1)
                if target is None or length < 0:
                    self.send_error(400)
                    return
                data = self.rfile.read(length)
                target.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".put-")
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, target)
                with server._count:
                    server.bytes_received += len(data)
                self.send_response(201)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = _Server(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> CacheServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    srv = CacheServer(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) == 3 else 0)
    print(f"serving {srv.root} at {srv.url}", flush=True)
    srv.httpd.serve_forever()
