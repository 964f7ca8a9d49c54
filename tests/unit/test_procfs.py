"""The process table as tasks/core/procfs.py reads it, against real processes."""

from __future__ import annotations

import os
import subprocess
import time

from tasks.core import procfs


def test_a_process_is_read_with_its_group_session_and_start() -> None:
    me = procfs.process(os.getpid())
    assert me is not None
    assert (me.pgid, me.sid) == (os.getpgid(0), os.getsid(0))
    assert (me.pid, me.start) in {(p.pid, p.start) for p in procfs.processes()}
    assert procfs.process(2**22 + 1) is None  # above the kernel's pid limit


def test_stop_ends_every_process_of_a_session() -> None:
    leader = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"], start_new_session=True)
    try:

        def session() -> list[int]:
            return [p.pid for p in procfs.processes() if p.sid == leader.pid and p.state != "Z"]

        deadline = time.monotonic() + 30
        while len(session()) < 2:  # sh and its two sleeps (sh may exec the last one)
            assert time.monotonic() < deadline, "the session never started"
            time.sleep(0.05)
        assert procfs.stop(session, grace=5.0) >= 2
        assert session() == []
    finally:
        leader.kill()
        leader.wait()
