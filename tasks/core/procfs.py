"""The kernel's process table, read from ``/proc``: which processes run in a group or a session, and
stopping them (TERM, then KILL).

One reader for the three places that look: a stalled ``git fetch``'s process group (tasks/lock/git.py),
the sessions a killed run left behind (tasks/core/workspace.py) and the compilers a build runs
(tasks/engine/timeline.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class Process:
    """One line of ``/proc/PID/stat``, the fields used here."""

    pid: int
    name: str  # the command name (comm), without its parentheses
    state: str  # R, S, D, Z, ...
    pgid: int
    sid: int
    cpu_ticks: int  # utime + stime, in clock ticks
    start: str  # start time, clock ticks since boot: with pid, names one process over time
    ppid: int = 0


def _parse(pid: int, text: str) -> Process | None:
    fields = text[text.rfind(")") + 2 :].split()
    if len(fields) < 20:
        return None
    return Process(
        pid=pid,
        name=text[text.find("(") + 1 : text.rfind(")")],
        state=fields[0],
        pgid=int(fields[2]),
        sid=int(fields[3]),
        cpu_ticks=int(fields[11]) + int(fields[12]),
        start=fields[19],
        ppid=int(fields[1]),
    )


def process(pid: int, root: Path = PROC) -> Process | None:
    """``pid`` as the kernel has it now, or None when no such process runs."""
    try:
        return _parse(pid, (root / str(pid) / "stat").read_text())
    except (OSError, ValueError):
        return None


def processes(root: Path = PROC) -> list[Process]:
    """Every process now running (one that ends while this reads is left out)."""
    found = []
    for stat in root.glob("[0-9]*/stat"):
        try:
            entry = _parse(int(stat.parent.name), stat.read_text())
        except (OSError, ValueError):
            continue
        if entry is not None:
            found.append(entry)
    return found


def stop(members: Callable[[], list[int]], grace: float) -> int:
    """TERM every pid ``members()`` names, then, after ``grace`` seconds, KILL what is left; how many there were."""
    found = members()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, grace)):
        pids = members()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while members() and time.monotonic() < deadline:
            time.sleep(0.05)
    return len(found)


def process_seconds() -> float:
    """Seconds since this process started (the interpreter's start-up included), from /proc; 0 where unknown."""
    try:
        with open("/proc/self/stat", encoding="ascii") as fh:
            start_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
