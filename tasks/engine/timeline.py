"""Build timeline and run summary: Chrome trace events, ninja logs, progress lines.

Pure helpers (no doit, no subprocesses). The trace opens in Perfetto
(ui.perfetto.dev) and chrome://tracing: one row per package build, and under
it one span per translation unit taken from ninja's ``.ninja_log``.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.core import procfs
from tasks.core.fsutil import write_atomic

_PROGRESS = re.compile(r"^\s*\[(\d+)/(\d+)\]")


@dataclass(frozen=True)
class Unit:
    """One ninja edge: its output and its start/end in ms after ninja started."""

    output: str
    start_ms: int
    end_ms: int


@dataclass
class Outcome:
    """What happened to one package in this run."""

    package: str
    status: str  # "built", "cached" or "restored" (from the remote cache)
    start: float = 0.0  # time.time() at start
    wall_s: float = 0.0
    cpu_s: float = 0.0
    max_rss_mb: float = 0.0
    units: list[Unit] = field(default_factory=list)
    ninja_start: float = 0.0
    object_hits: int = 0
    object_misses: int = 0
    wait_s: float = 0.0  # of wall_s: waiting for job slots (other builds held them)
    forecast_s: float | None = None  # what the run's forecast said of its wall time (tasks/cli/plan.py)
    escaped: dict[str, int] = field(default_factory=dict)  # compiler -> runs outside the gate
    #: (unit, node, start, seconds): the units that compiled on a cluster node (unit: its output's file name)
    nodes: list[tuple[str, str, float, float]] = field(default_factory=list)


def parse_ninja_log(text: str) -> list[Unit]:
    """Edges of a ``.ninja_log`` (format v5+: start, end, mtime, output, hash); the last entry of an output wins."""
    units: dict[str, Unit] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) < 4 or not parts[0].isdigit() or not parts[1].isdigit():
            continue
        units[parts[3]] = Unit(output=parts[3], start_ms=int(parts[0]), end_ms=int(parts[1]))
    return sorted(units.values(), key=lambda u: (u.start_ms, u.output))


def chrome_trace(outcomes: Iterable[Outcome]) -> dict[str, Any]:
    """Trace-event JSON: one thread (row) per package, complete events ("ph": "X") in microseconds; on a
    cluster, each node a process (track) of its own, holding the units that compiled there, by package."""
    outcomes = [o for o in outcomes if o.status == "built"]
    t0 = min((o.start for o in outcomes), default=0.0)
    events: list[dict[str, Any]] = []
    nodes = sorted({n[1] for o in outcomes for n in o.nodes})
    pids = {n: i for i, n in enumerate(nodes, start=2)}
    if nodes:
        events.append({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "this host"}})
    for name, pid in pids.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"node {name}"}})
    for tid, o in enumerate(sorted(outcomes, key=lambda o: o.start), start=1):
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": o.package}})
        events.append({
            "ph": "X", "name": f"build {o.package}", "cat": "package", "pid": 1, "tid": tid,
            "ts": round((o.start - t0) * 1e6), "dur": round(o.wall_s * 1e6),
            "args": {"cpu_s": round(o.cpu_s, 1), "max_rss_mb": round(o.max_rss_mb), "waited_s": round(o.wait_s, 1),
                     "object_cache_hits": o.object_hits, "object_cache_misses": o.object_misses},
        })  # fmt: skip
        base = (o.ninja_start or o.start) - t0
        on_node = {unit: node for unit, node, _, _ in o.nodes}
        for u in o.units:
            node = on_node.pop(u.output.rsplit("/", 1)[-1], "")
            events.append({
                "ph": "X", "name": u.output.rsplit("/", 1)[-1], "cat": "compile", "pid": pids.get(node, 1),
                "tid": tid, "ts": round(base * 1e6 + u.start_ms * 1e3), "dur": max(1, (u.end_ms - u.start_ms) * 1000),
                "args": {"output": u.output, **({"node": node} if node else {})},
            })  # fmt: skip
        for unit, node, start, seconds in o.nodes:  # a build without ninja's log: the broker's record
            if unit in on_node:
                events.append({
                    "ph": "X", "name": unit, "cat": "compile", "pid": pids[node], "tid": tid,
                    "ts": round((start - t0) * 1e6), "dur": max(1, round(seconds * 1e6)), "args": {"node": node},
                })  # fmt: skip
        for pid in sorted({pids[n[1]] for n in o.nodes}):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": o.package}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def summary_table(outcomes: Iterable[Outcome]) -> str:
    rows = [("package", "result", "wall s", "waited s", "built s", "CPU s", "largest process MB", "units",
             "objects hit/miss", "forecast s")]  # fmt: skip
    for o in sorted(outcomes, key=lambda o: o.package):
        forecast = f"{o.forecast_s:.1f}" if o.forecast_s is not None else "-"
        if o.status == "built":
            rows.append((
                o.package, "built", f"{o.wall_s:.1f}", f"{o.wait_s:.1f}", f"{o.wall_s - o.wait_s:.1f}",
                f"{o.cpu_s:.0f}", f"{o.max_rss_mb:.0f}", str(len(o.units)), f"{o.object_hits}/{o.object_misses}",
                forecast,
            ))  # fmt: skip
        else:
            rows.append((o.package, o.status, "-", "-", "-", "-", "-", "-", "-", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def trace_json(outcomes: Iterable[Outcome]) -> str:
    return json.dumps(chrome_trace(outcomes), indent=1) + "\n"


def report(outcomes: Mapping[str, Outcome], names: Iterable[str], trace: Path, forecast_s: float | None = None) -> None:
    """Print the run's summary table of ``names``, and the forecast of the run's wall time (``forecast_s``)
    next to what it took; write its timeline to ``trace`` when anything was built."""
    rows = [outcomes.get(n) or Outcome(package=n, status="cached") for n in names]
    print(summary_table(rows), flush=True)
    built = [o for o in rows if o.status == "built"]
    if built and forecast_s is not None:
        took = max(o.start + o.wall_s for o in built) - min(o.start for o in built)
        said = f"forecast: {forecast_s:.1f} s of wall time for the builds; they took {took:.1f} s"
        print(said + against(took, forecast_s), flush=True)
    for o in rows:
        if o.escaped:
            runs = ", ".join(f"{n} by {name}" for name, n in sorted(o.escaped.items()))
            print(
                f"warning: {o.package}: {sum(o.escaped.values())} compile(s) seen running outside the gate and the "
                f"object cache ({runs})",
                flush=True,
            )
    if any(o.status == "built" for o in rows):
        write_atomic(trace, trace_json(rows))
        print(f"build timeline: {trace} (open in ui.perfetto.dev or chrome://tracing)", flush=True)
    elif trace.exists():
        # A run that only restored from the cache keeps the last build's timeline.
        print(f"nothing built in this run; the last build's timeline stays in {trace}", flush=True)
    else:
        print("nothing built in this run, so no build timeline", flush=True)


def against(took_s: float, forecast_s: float) -> str:
    """How ``took_s`` compares with ``forecast_s``, in words for the summary: `` (2.7 % over the forecast)``."""
    if forecast_s <= 0:
        return ""
    off = (took_s - forecast_s) / forecast_s * 100
    if round(abs(off), 1) == 0:
        return " (as forecast)"
    return f" ({abs(off):.1f} % {'over' if off > 0 else 'under'} the forecast)"


#: Processes that do a compile unit's work (under gcc, nvcc, the linkers): what "compiling" counts.
COMPILERS = frozenset({"cc1", "cc1plus", "cicc", "ptxas", "nvlink", "cudafe++", "fatbinary", "ld", "collect2"})


def running_compilers(session: int) -> int:
    """How many compiler processes run in the session ``session`` (a build's, see proc.run)."""
    return sum(1 for p in procfs.processes() if p.sid == session and p.name in COMPILERS)


def finished_unit(line: str) -> str | None:
    """The unit a ninja ``[N/M]`` line says ended (ninja prints it as an edge ends, where its output is no
    terminal), by its output's file name as the gate names units: the file after ``-o`` in a command, else
    the line's last word (CMake's ``Building CXX object .../core.cpp.o``); None for another line."""
    m = _PROGRESS.match(line)
    if not m:
        return None
    words = line[m.end() :].split()
    if "-o" in words[:-1]:
        words = [words[words.index("-o") + 1]]
    return os.path.basename(words[-1]) if words else None


class Progress:
    """A build's heartbeat: one console line every ``every`` seconds while it runs, output or not (none
    with ``every`` 0: the run's status line then says it, tasks/engine/progress.py).

    Units done and total come from ninja's ``[N/M]`` lines (:meth:`feed`), and the units they name as
    ended (``ended``); the compilers running are counted in the build's session (:meth:`started` gives its
    id); elapsed is wall time.
    """

    def __init__(self, package: str, emit: Callable[[str], None], every: float = 15.0) -> None:
        self.package = package
        self.emit = emit
        self.every = every
        self.started_at = time.monotonic()
        self.done = self.total = 0
        self.ended: set[str] = set()
        self.session = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def feed(self, line: str) -> None:
        m = _PROGRESS.match(line)
        if m:
            self.done, self.total = int(m.group(1)), int(m.group(2))
            unit = finished_unit(line)
            if unit:
                self.ended.add(unit)

    def started(self, pid: int) -> None:
        """The build command started as ``pid``, the leader of its own session."""
        self.session = pid

    def __enter__(self) -> Progress:
        if self.every > 0:
            self._thread = threading.Thread(target=self._beat, name=f"progress-{self.package}", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self.every):
            self.emit(self.line())

    def line(self, now: float | None = None) -> str:
        elapsed = int((now or time.monotonic()) - self.started_at)
        parts = [f"{self.done}/{self.total} units done"] if self.total else []
        if self.session:
            parts.append(f"{running_compilers(self.session)} compiler(s) running")
        parts.append(f"{elapsed // 60}m{elapsed % 60:02d}s")
        return f"  {self.package}: {', '.join(parts)}"


def interval_union(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds covered by ``intervals`` (start, end) within [lo, hi], overlaps counted once."""
    total, reach = 0.0, lo
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def read_waits(path: Path) -> list[tuple[float, float]]:
    """The (start, end) wall-clock seconds a build waited for job slots (``JobServer.slot``'s lines)."""
    waits = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            waits.append((int(parts[0]) / 1e9, int(parts[1]) / 1e9))
    return waits
