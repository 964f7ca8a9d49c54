"""The run's progress on the console: what its builds have done, and the time left by the run's forecast.

The figure is the forecast's own (tasks/engine/forecast.py :func:`~tasks.engine.forecast.remaining`): the
simulation that forecast the run, played again with what the run has seen taken off, the units that ended
and the seconds the running ones have run. What it has seen: each build's ninja lines (tasks/engine/timeline.py
:class:`~tasks.engine.timeline.Progress`) and the broker's unit log, read as it grows. On a terminal one
status line is rewritten in place (tasks/core/console.py :class:`~tasks.core.console.Live`); in a log, whole
lines, one per build every :data:`EVERY` to 30 seconds, or sooner when a build starts or ends or the
figure moves. docs/building.md, "The forecast" (its "The time left").
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from tasks.core import proc, procfs
from tasks.core.console import Live
from tasks.engine import forecast as run_forecast
from tasks.engine.forecast import Forecast, Seen
from tasks.engine.timeline import COMPILERS, Progress

#: In a log: a build's line once this many seconds passed since the last (seconds), at the next look
#: (:data:`TICK_LOG`), and no more often unless something moved: one at least every 30 s on a busy host too (on
#: the H200 host, with 30 here, the looks' 5 s and a busy tick made gaps of up to 36 s).
EVERY = 20.0
#: In a log: never two lines closer than this (seconds), whatever moved.
GAP = 5.0
#: In a log: a line before its time when the time left moved by this share of it, and by :data:`MOVED_S` at least.
MOVED_SHARE = 0.2
MOVED_S = 60.0
#: The status line is drawn again this often (seconds) on a terminal; a log is looked at this often.
TICK_TTY = 1.0
TICK_LOG = GAP
#: The time left is simulated again when what the run has seen changed, at most this often, and at least
#: this often otherwise (seconds); in between it counts down. A simulation that takes long is made less
#: often: never more than one second of it in :data:`COST_SHARE` seconds.
AGAIN_S = 2.0
AGAIN_EVERY = 15.0
COST_SHARE = 20


def duration(seconds: float) -> str:
    """``seconds`` as the heartbeat writes elapsed time (``6m05s``), to the nearest second."""
    whole = max(0, math.floor(seconds + 0.5))
    return f"{whole // 60}m{whole % 60:02d}s"


class UnitsLog:
    """The broker's unit log (``build/logs/units.log``, tasks/engine/broker.py) read as it grows, from where
    it stood when this run's broker started: the units of each package that started and have not ended
    (with when they started, seconds since the epoch) and those that ended."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.running: dict[str, dict[str, float]] = {}
        self.done: dict[str, set[str]] = {}
        self._offset = 0
        self._partial = b""
        if path is not None:
            try:
                self._offset = path.stat().st_size
            except OSError:
                self._offset = 0

    def read(self) -> None:
        if self.path is None:
            return
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            return
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            self.take(raw.decode(errors="replace"))

    def take(self, line: str) -> None:
        """One line: ``TIME EVENT PACKAGE UNIT ...`` (broker.py ``_note``)."""
        words = line.split()
        if len(words) < 4 or line.startswith("#"):
            return
        try:
            when = float(words[0])
        except ValueError:
            return
        event, package, unit = words[1:4]
        if event in ("start", "retry"):
            self.running.setdefault(package, {})[unit] = when
            self.done.get(package, set()).discard(unit)
        elif event == "end":
            self.running.get(package, {}).pop(unit, None)
            self.done.setdefault(package, set()).add(unit)


def compilers_by_session(sessions: Collection[int]) -> dict[int, int]:
    """How many compiler processes run in each of ``sessions`` (one read of the process table)."""
    counts = dict.fromkeys(sessions, 0)
    if sessions:
        for p in procfs.processes():
            if p.sid in counts and p.name in COMPILERS:
                counts[p.sid] += 1
    return counts


class Status:
    """The run's progress: its builds (each a :class:`~tasks.engine.timeline.Progress`, :meth:`follow`) and
    the time left by ``forecast`` (None: no figure, said as ``unknown (why)``). ``known``: the packages the
    forecast had a record of; a figure that counts another is a floor (``at least``). ``live``: the
    terminal's status line, else whole lines go to ``emit``."""

    def __init__(
        self,
        forecast: Forecast | None,
        *,
        known: Collection[str] = (),
        why: str = "no history",
        units_log: Path | None = None,
        live: Live | None = None,
        emit: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.forecast = forecast
        self.known = frozenset(known)
        self.why = why
        self.live = live
        self.emit = emit or (lambda line: print(line, flush=True))
        self.clock = clock
        self.wall = wall
        self.started_at = clock()
        self.units = UnitsLog(units_log)
        self._open: dict[str, Progress] = {}
        self._ended: set[str] = set()
        self._lock = threading.RLock()
        self._thread: tuple[threading.Thread, threading.Event] | None = None
        self._rest: tuple[float, Forecast | None, object] | None = None  # (when, what is left, what was seen)
        self._cost = 0.0
        self._said_at: float | None = None
        self._said_open: frozenset[str] = frozenset()
        self._said_left: float | None = None
        self._compilers: tuple[float, dict[int, int]] = (-math.inf, {})
        self._failed = False

    @contextmanager
    def follow(self, progress: Progress) -> Iterator[Progress]:
        """Count ``progress``'s build among the run's while the block runs."""
        self.open(progress)
        try:
            with progress:
                yield progress
        finally:
            self.close(progress.package)

    def open(self, progress: Progress) -> None:
        with self._lock:
            self._open[progress.package] = progress
            self._ended.discard(progress.package)
            if self._thread is None:
                stop = threading.Event()
                thread = threading.Thread(target=self._beat, args=(stop,), name="run-status", daemon=True)
                self._thread = (thread, stop)
                thread.start()
        self.tick()

    def close(self, package: str) -> None:
        with self._lock:
            self._open.pop(package, None)
            self._ended.add(package)
            ticker = None
            if not self._open:
                ticker, self._thread = self._thread, None
        if ticker is None:
            self.tick()
            return
        ticker[1].set()
        ticker[0].join()
        if self.live is not None:
            self.live.clear()

    def _beat(self, stop: threading.Event) -> None:
        every = TICK_TTY if self.live is not None else TICK_LOG
        while not stop.wait(every):
            self.tick()

    def tick(self, now: float | None = None) -> None:
        """Look at the builds once: on a terminal draw the status line again, in a log write the builds' lines
        when they are due. Never fails a build."""
        try:
            with self._lock:
                if not self._open or self._failed:
                    return
                if proc.stop_signal() is not None:  # interrupted: its lines, and no status line below them
                    if self.live is not None:
                        self.live.clear()
                    return
                now = self.clock() if now is None else now
                self.units.read()
                if self.live is not None:
                    self.live.show(self.live_line(now))
                elif self._due(now):
                    for line in self.lines(now):
                        self.emit(line)
                    self._said_at, self._said_open = now, frozenset(self._open)
                    self._said_left = self.left(now)[0]
        except Exception as exc:  # a status that cannot be said is a line, once; the builds go on
            if not self._failed:
                self._failed = True
                print(f"note: no more progress lines in this run ({exc.__class__.__name__}: {exc})", flush=True)

    def _due(self, now: float) -> bool:
        if self._said_at is None:
            return True
        gap = now - self._said_at
        if gap >= EVERY:
            return True
        if gap < GAP:
            return False
        if frozenset(self._open) != self._said_open:
            return True
        left, _ = self.left(now)
        if left is None or self._said_left is None:
            return False
        expected = max(0.0, self._said_left - gap)
        return abs(left - expected) >= max(MOVED_S, MOVED_SHARE * expected)

    def seen(self, now: float) -> dict[str, Seen]:
        """What the run has seen of each build, for the forecast (tasks/engine/forecast.py :class:`Seen`)."""
        wall = self.wall()
        found = {name: Seen(ended=True) for name in self._ended}
        for name, progress in self._open.items():
            done = frozenset(progress.ended) | frozenset(self.units.done.get(name, ()))
            running = {u: max(0.0, wall - since) for u, since in self.units.running.get(name, {}).items()}
            found[name] = Seen(elapsed_s=max(0.0, now - progress.started_at), done=done, running=running)
        return found

    def rest(self, now: float) -> tuple[Forecast | None, float]:
        """The forecast of what is left, and how many seconds ago it was made (it is made again when what
        was seen changed, at most every :data:`AGAIN_S`, else every :data:`AGAIN_EVERY`)."""
        if self.forecast is None:
            return None, 0.0
        seen = self.seen(now)
        shape = sorted((n, s.ended, len(s.done), tuple(sorted(s.running))) for n, s in seen.items())
        if self._rest is not None:
            made, rest, was = self._rest
            age = now - made
            if age < max(AGAIN_S, COST_SHARE * self._cost) or (shape == was and age < AGAIN_EVERY):
                return rest, age
        began = time.perf_counter()
        rest = run_forecast.remaining(self.forecast, seen)
        self._cost = time.perf_counter() - began
        self._rest = (now, rest, shape)
        return rest, 0.0

    def left(self, now: float, package: str | None = None) -> tuple[float | None, bool]:
        """The seconds left of the run (or of ``package``'s build), None where unknown, and whether the
        figure is a floor (it counts a package the forecast has no record of)."""
        rest, age = self.rest(now)
        if rest is None:
            return None, False
        if package is None:
            seconds = rest.wall_s
            floor = any(name not in self.known for name in rest.packages)
        elif package in rest.packages and package in self.known:
            seconds, floor = rest.packages[package].end_s, False
        else:
            return None, False
        return max(0.0, seconds - age), floor

    def said(self, now: float, package: str | None = None) -> str:
        """``remaining 4m10s``, ``remaining at least 4m10s`` or ``remaining unknown (no history)``."""
        seconds, floor = self.left(now, package)
        if seconds is None:
            if self.forecast is None:
                why = self.why
            elif package not in {w.name for w in self.forecast.work}:
                why = "not in the forecast"
            else:
                why = "no history"
            return f"remaining unknown ({why})"
        return f"remaining {'at least ' if floor else ''}{duration(seconds)}"

    def lines(self, now: float) -> list[str]:
        """The whole lines of a log: each build's heartbeat with its time left, and the run's where that is more."""
        out = []
        run, _ = self.left(now)
        for name, progress in self._open.items():
            own, _ = self.left(now, name)
            text = self.said(now, name)
            if run is not None and (own is None or run - own >= 1.0):
                text += f", of the run {self.said(now).removeprefix('remaining ')}"
            out.append(f"{progress.line(now)}, {text}")
        return out

    def live_line(self, now: float) -> str:
        """The terminal's one line: the run's time left first (the end is cut at the terminal's width)."""
        stamp, counts = self._compilers
        if now - stamp >= GAP:
            counts = compilers_by_session([p.session for p in self._open.values() if p.session])
            self._compilers = (now, counts)
        parts = [f"{n} {p.done}/{p.total} units" if p.total else n for n, p in self._open.items()]
        running = sum(counts.get(p.session, 0) for p in self._open.values() if p.session)
        elapsed = duration(now - self.started_at)
        return f"  {self.said(now)}, {elapsed} in: {', '.join(parts)}; {running} compiler(s) running"
