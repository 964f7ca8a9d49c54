"""scripts/cache_server.py takes a parallel build's first burst of connections without dropping any."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_burst_of_connections_is_queued_while_the_server_is_busy(tmp_path: Path) -> None:
    # A 64-core build starts 64 ccache processes at once. While the server is
    # not accepting (here: stopped), the kernel must still complete every
    # handshake into the listen queue; a dropped SYN is retried only after
    # 1 s, past ccache's connect timeout, and that object is never shared.
    # With socketserver's default backlog of 5, only 6 of 64 connect.
    server = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "cache_server.py"), str(tmp_path / "root")],
        stdout=subprocess.PIPE,
        text=True,
    )
    socks: list[socket.socket] = []
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline().split()[-1].rsplit(":", 1)[1])
        os.kill(server.pid, signal.SIGSTOP)
        for _ in range(64):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        connected: set[socket.socket] = set()
        deadline = time.monotonic() + 0.8
        while len(connected) < len(socks) and time.monotonic() < deadline:
            _, writable, _ = select.select([], [s for s in socks if s not in connected], [], 0.05)
            connected.update(s for s in writable if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0)
        assert len(connected) == 64
    finally:
        for s in socks:
            s.close()
        server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()
