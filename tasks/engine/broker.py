"""The broker of a run's job tokens: which compile gets the next free slot, and room in the memory budget.

Every compile's gate (tasks/outside/gate.py) says hello on the broker's socket and asks for a token; the
broker hands the run's tokens (tasks/engine/jobserver.py owns their fifo) to the waiting compiles in the
order tasks/engine/admission.py's :func:`~tasks.engine.admission.choose` decides, keeps what each unit is
expected to hold and what it holds, and hears back what it held and how long it ran. With a Ray cluster
(tasks/engine/cluster.py), it places an admitted compile on a node.
"""

from __future__ import annotations

import heapq
import json
import os
import select
import selectors
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.engine import admission
from tasks.engine.admission import Expect, Expectations

if TYPE_CHECKING:
    from tasks.engine.cluster import Cluster


#: Of the host's MemAvailable, this share of the memory budget stays free of admissions: where the units' time
#: or the host's other work is not as recorded, the kernel still has room before any unit is killed.
HEADROOM_SHARE = 0.05
#: While compiles wait with a memory budget, the broker asks again this often (seconds), without an event:
#: a running unit's peak may have passed by the clock, or the host's memory come free.
RECHECK_S = 1.0
#: A report of what a running unit holds lets the broker ask again at most this often (seconds).
REPORTED_S = 0.25

#: Where a finished unit's record goes as it comes (unit, what it held and how long it ran): a build cut off
#: before its end (a host taken back, the process killed) keeps what its finished units measured.
Journal = Callable[[str, dict[str, object]], None]


@dataclass
class _Unit:
    """A compile connected to the broker: waiting, or running on a token and on room in the budget."""

    package: str
    unit: str
    expect: Expect
    retry: bool = False
    live_mb: float = 0.0
    past: bool = False
    since: float = 0.0
    #: Seconds into the unit when it first held half its expected peak (None: not yet).
    high_since: float | None = None
    buf: bytes = b""
    #: On a cluster: the node it runs on (tasks/engine/cluster.py ``Node``) and its task there, once sent.
    node: Any = None
    task: object = None
    #: Its gate said it must run here (a link, a preprocessor run): never sent to a cluster.
    here: bool = False
    #: A short unit (admission.is_step): first in line while its package waits on it alone.
    step: bool = False

    def outlook(self, now: float) -> admission.Steps:
        """What this running unit is expected to hold from ``now`` (seconds since the epoch) on."""
        return admission.outlook(
            self.expect, elapsed_s=max(0.0, now - self.since), live_mb=self.live_mb, past=self.past,
            high_since_s=self.high_since,
        )  # fmt: skip

    def reserved(self, now: float | None = None) -> float:
        """The memory counted for this running unit now: what it holds, or more, what it is expected to hold."""
        return self.outlook(time.time() if now is None else now)[0][1]


class Broker:
    """Admits the run's compiles: a token each, highest priority first (its package's plus its own seconds,
    then first come), and, with a memory budget, room for each unit's recorded or estimated peak.

    A compile's gate (tasks/outside/gate.py) connects and says its package's priority
    (:func:`tasks.engine.admission.priority`) and its unit, and waits in line by that priority plus the
    unit's seconds (:func:`tasks.engine.admission.unit_priority`); the broker admits it when a token is
    free and its expected memory fits in the budget next to what the running units hold or are expected
    to reach (and in what the host really has left), answers ``+``, and takes the token and the room
    back when the connection closes. A unit that does not fit waits, and units behind it start only
    where they leave its room free: heavy units are never overtaken for good, light ones fill the rest.
    While a unit runs its gate reports its memory; once the process its recorded peak came in has ended,
    only its recorded rest is counted. So the long units of the package that sets the run's wall time
    are never queued behind short ones of a package that does not, and memory is counted per unit, not
    as a fixed figure per job. Which waiter goes next is :func:`tasks.engine.admission.choose`'s
    decision; the broker keeps the sockets, the token fifo and
    the selector loop.
    """

    def __init__(
        self,
        fifo_fd: int,
        *,
        budget_mb: float | None = None,
        log: Path | None = None,
        slots: int = 0,
        cluster: Cluster | None = None,
    ) -> None:
        self._fifo = fifo_fd
        self.cluster = cluster
        self.budget_mb = budget_mb
        #: Of the host's MemAvailable, what no admission takes (:data:`HEADROOM_SHARE` of the budget).
        self.headroom_mb = HEADROOM_SHARE * budget_mb if budget_mb is not None else 0.0
        self.slots = slots
        self._building: dict[str, float] = {}  # package -> priority, while its build runs
        self._dir = tempfile.mkdtemp(prefix="reprostack-jobs-")  # short: unix socket paths are limited
        self.socket = os.path.join(self._dir, "broker.sock")
        self._listen = socket.socket(socket.AF_UNIX)
        self._listen.bind(self.socket)
        self._listen.listen(256)
        self._listen.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()
        self._tokens = os.open(f"/proc/self/fd/{fifo_fd}", os.O_RDONLY | os.O_NONBLOCK)
        self._waiting: list[tuple[float, int, socket.socket]] = []
        self._units: dict[socket.socket, _Unit] = {}
        self._held: set[socket.socket] = set()
        self._counts: dict[str, list[int]] = {}  # package -> [waiting, held]
        self._starved_since: dict[str, float] = {}
        self._starved: dict[str, list[tuple[float, float]]] = {}
        self._plans: dict[str, Expectations] = {}
        self._times: dict[str, dict[str, float]] = {}  # package -> its units' known seconds
        self._results: dict[str, dict[str, dict[str, object]]] = {}
        self._journals: dict[str, Journal] = {}
        self._journal_failed: set[str] = set()
        self._lock = threading.Lock()
        self._log = log.open("a", buffering=1) if log is not None else None
        if self._log is not None:  # the log grows by run: each starts with this line
            budget = f"{budget_mb:.0f}MB" if budget_mb is not None else "tokens only"
            on = f", on the {cluster.describe()}" if cluster is not None else ""
            self._log.write(
                f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} run {os.getpid()}: {slots} slots, memory {budget}{on}\n"
            )
        self.peak_running = 0
        self.peak_reserved_mb = 0.0
        self._seq = 0
        self._stop = False
        self._need_token = False
        self._changed = False  # since the last pass: something that may let a waiter in at once
        self._granted = 0.0  # when the broker last asked which waiter goes (time.monotonic())
        self._served = threading.Condition()  # notified after each pass of the broker's loop (settle())
        self._thread = threading.Thread(target=self._serve, name="job-broker", daemon=True)
        self._thread.start()

    def building(
        self,
        package: str,
        priority: float = 0.0,
        *,
        records: dict[str, dict[str, object]] | None = None,
        hints: dict[str, dict[str, object]] | None = None,
        default_mb: float = 0.0,
        journal: Journal | None = None,
        times: dict[str, float] | None = None,
    ) -> None:
        """``package``'s build has started, at ``priority`` (while the highest one builds, a token may be
        kept for it: :func:`tasks.engine.admission.choose`); its units are expected to hold what ``records`` say
        by unit, else what ``hints`` say, else ``default_mb``, and to take the seconds ``times`` say (each
        waits in line by them: :func:`tasks.engine.admission.unit_priority`). Each of its units' records goes
        to ``journal`` as the unit ends (the cache's records: tasks/store/history.py ``record_unit``)."""
        with self._lock:
            self._building[package] = priority
            self._times[package] = dict(times or {})
            self._plans[package] = Expectations(records=records or {}, hints=hints or {}, default_mb=default_mb)
            if journal is not None:
                self._journals[package] = journal
            else:
                self._journals.pop(package, None)
        self._wake()

    def finished(self, package: str) -> None:
        with self._lock:
            self._building.pop(package, None)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def results(self, package: str) -> dict[str, dict[str, object]]:
        """What each of ``package``'s finished units held (``peak_mb``, ``peak_in``, ``after_mb``, ``seconds``,
        ``killed``), and forgets them."""
        with self._lock:
            return self._results.pop(package, {})

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listen, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        fifo_registered = False
        while not self._stop:
            if self._need_token != fifo_registered:
                if self._need_token:
                    sel.register(self._tokens, selectors.EVENT_READ, "tokens")
                else:
                    sel.unregister(self._tokens)
                fifo_registered = self._need_token
            recheck = RECHECK_S if self._waiting and self.budget_mb is not None else None
            events = sel.select(recheck)
            for key, _ in events:
                what = key.data
                if what != "conn":
                    self._changed = True
                if what == "accept":
                    try:
                        conn, _addr = self._listen.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(False)
                    self._units[conn] = _Unit(package="", unit="", expect=Expect(0.0))
                    sel.register(conn, selectors.EVENT_READ, "conn")
                elif what == "conn":
                    conn = _sock(key.fileobj)
                    data = self._recv(conn)
                    if data is None:
                        sel.unregister(conn)
                        conn.close()
                        self._closed(conn)
                    else:
                        self._received(conn, data)
                elif what == "wake":
                    os.read(self._wake_r, 64)
            # A waiter came, a token or room came back, a build began or ended: ask at once. Reports of what
            # the running units hold, and the clock alone, move what they are expected to hold: ask again
            # at most every REPORTED_S (the choice costs milliseconds; 64 gates report every second).
            now = time.monotonic()
            if self._changed or not events or now - self._granted >= REPORTED_S:
                self._changed = False
                self._granted = now
                self._grant()
            with self._served:
                self._served.notify_all()
        for conn in list(self._units):  # gates still connected when the server closes: their ends unread
            conn.close()
        sel.close()

    def settle(self, package: str | None = None, timeout: float = 10.0) -> bool:
        """Wait until the broker has seen the end of every compile of ``package`` (of every package, with
        None) whose gate is gone; False if some connection is still open after ``timeout`` seconds.

        A gate's token goes back, and its unit's report is kept, when the broker's thread reads the end
        of its connection: after the build that ran it has ended, not with it. Read at once, a loaded
        host showed one of two tokens still out (CI's `assert 1 == 2` in test_jobserver) and the last
        units' records missing; the token was not lost, only not yet given back.
        """
        deadline = time.monotonic() + timeout
        with self._served:
            while True:
                pending, _w, _x = select.select([self._listen], [], [], 0)  # a gate not yet accepted
                units = list(self._units.values())
                if not pending and not any(not u.package or package in (None, u.package) for u in units):
                    return True
                left = deadline - time.monotonic()
                if left <= 0 or self._stop:
                    return False
                self._wake()
                self._served.wait(min(left, 0.05))

    def _received(self, conn: socket.socket, data: bytes) -> None:
        unit = self._units[conn]
        unit.buf += data
        while b"\n" in unit.buf:
            raw, unit.buf = unit.buf.split(b"\n", 1)
            if conn in self._held and raw.startswith(b"x "):
                self._remote(conn, unit, raw[2:])
                continue
            words = raw.decode(errors="replace").split()
            if conn in self._held:
                self._report(conn, unit, words)
            elif not unit.package:
                self._hello(conn, unit, words)

    def _hello(self, conn: socket.socket, unit: _Unit, words: list[str]) -> None:
        """``PRIORITY PACKAGE UNIT [NEED_MB] [here]``: a compile asks to run (NEED_MB: its retry, with that
        room; ``here``: not on a cluster)."""
        try:
            prio = float(words[0])
        except (ValueError, IndexError):
            prio = 0.0
        if words[-1:] == ["here"] and len(words) > 3:
            unit.here = True
            words = words[:-1]
        unit.package = words[1] if len(words) > 1 else "-"
        unit.unit = words[2] if len(words) > 2 else "-"
        with self._lock:
            plan = self._plans.get(unit.package)
            times = self._times.get(unit.package, {})
        unit.expect = plan.expect(unit.unit) if plan is not None else Expect(0.0)
        prio = admission.unit_priority(times, unit.unit, prio)
        unit.step = admission.is_step(times, unit.unit)
        if len(words) > 3:  # killed for memory once: first in line, with the room it asked for
            try:
                need = float(words[3])
            except ValueError:
                need = unit.expect.peak_mb
            need = max(need, unit.expect.peak_mb)
            if self.budget_mb is not None:
                need = min(need, self.budget_mb)
            unit.expect = Expect(need)
            unit.retry = True
            prio = float("inf")
        self._count(unit, waiting=+1)
        self._seq += 1
        heapq.heappush(self._waiting, (-prio, self._seq, conn))
        self._changed = True
        self._note("wait", unit)

    def _report(self, conn: socket.socket, unit: _Unit, words: list[str]) -> None:
        """A running compile's reports: ``m LIVE_MB PAST``, ``k PEAK_MB`` (killed for memory) and
        ``d PEAK_MB PEAK_IN AFTER_MB SECONDS EXIT [BEFORE_MB PEAK_FROM_S PEAK_FOR_S [CPU_S]]`` (done; ``-``
        where its peak was not timed; CPU_S: the CPU-seconds of the compiler's process tree)."""
        try:
            if words[0] == "m":
                unit.live_mb = float(words[1])
                if unit.high_since is None and unit.live_mb >= admission.HIGH_SHARE * unit.expect.peak_mb:
                    unit.high_since = max(0.0, time.time() - unit.since)
                if words[2] == "1" and not unit.past:
                    unit.past = True
                    self._note("past", unit)  # the process its peak comes in has ended: its rest counts
                with self._lock:
                    self.peak_reserved_mb = max(self.peak_reserved_mb, self._reserved())
            elif words[0] == "k":
                self._record(unit, {"peak_mb": float(words[1]), "killed": True})
                self._note("killed", unit)
            elif words[0] == "d":
                found: dict[str, object] = {"peak_mb": float(words[1]), "seconds": float(words[4])}
                if words[2] != "-":
                    found["peak_in"] = words[2]
                if float(words[3]) > 0:
                    found["after_mb"] = float(words[3])
                if words[5] != "0":
                    found["exit"] = int(words[5])
                if len(words) > 8 and words[8] != "-":
                    found["before_mb"] = float(words[6])
                    found["peak_from_s"] = float(words[7])
                    found["peak_for_s"] = float(words[8])
                if len(words) > 9:
                    found["cpu_s"] = float(words[9])
                if unit.node is not None:  # where and when it ran (the trace's node tracks)
                    found["node"] = unit.node.name
                    found["since"] = unit.since
                self._record(unit, found)
        except (IndexError, ValueError):
            return

    def _record(self, unit: _Unit, found: dict[str, object]) -> None:
        """Keep what a unit reported; a retried unit keeps the mark and the larger peak of its killed run.
        The package's journal gets it at once; one that fails is said once and the build goes on (its
        records are written again when the build ends)."""
        with self._lock:
            done = self._results.setdefault(unit.package, {})
            previous = done.get(unit.unit, {})
            if previous.get("killed"):
                found["killed"] = True
                found["peak_mb"] = max(_mb(previous.get("peak_mb")), _mb(found.get("peak_mb")))
            done[unit.unit] = found
            journal = self._journals.get(unit.package)
        if journal is None:
            return
        try:
            journal(unit.unit, dict(found))
        except (OSError, ValueError):  # (a full disk: the unit log says so once; the build goes on)
            if unit.package not in self._journal_failed:
                self._journal_failed.add(unit.package)
                self._note("unrecorded", unit)

    def _closed(self, conn: socket.socket) -> None:
        """A closed connection: a running unit's token goes back and its room is free; a waiter is dropped."""
        self._changed = True
        unit = self._units.pop(conn)
        if conn in self._held:
            self._held.discard(conn)
            self._count(unit, held=-1)
            os.write(self._fifo, b"+")
            self._note("end", unit)
        elif unit.package:  # it waited (only a waiter leaves the line here: a running unit was never in it)
            self._waiting = [w for w in self._waiting if w[2] is not conn]
            heapq.heapify(self._waiting)
            self._count(unit, waiting=-1)
        if self.cluster is not None and (unit.task is not None or unit.node is not None):
            if unit.task is not None:  # its gate is gone (Ctrl-C, a failed build) while it ran there: so is it
                self._note("cancelled", unit)
            self.cluster.release(unit.task, unit.node, unit.expect.peak_mb)
            unit.task = unit.node = None

    def _remote(self, conn: socket.socket, unit: _Unit, payload: bytes) -> None:
        """A gate the broker sent to the cluster sends its compile (``x {json}``): run it on the unit's node."""
        cluster = self.cluster
        try:
            job = json.loads(payload)
        except ValueError:
            job = None
        if cluster is None or unit.node is None or not isinstance(job, dict) or unit.task is not None:
            self._send(conn, b'r {"local": true}\n')
            return

        def done(result: dict[str, object]) -> None:
            self._ran(conn, unit, result)

        unit.task = cluster.submit(job, unit.expect.peak_mb, unit.node, done)

    def _ran(self, conn: socket.socket, unit: _Unit, result: dict[str, object]) -> None:
        """A compile's result from the cluster (the cluster's waiter thread): to its gate, with what it wrote."""
        out = result.pop("out_bytes", b"")
        err = result.pop("err_bytes", b"")
        out = out if isinstance(out, bytes) else b""
        err = err if isinstance(err, bytes) else b""
        task, unit.task = unit.task, None
        now = getattr(task, "node", None)  # where it ran last (None: nowhere any more, it runs here)
        if now is not unit.node:
            unit.node = now
            self._note("moved" if now is not None else "local", unit)
        result.pop("moves", None)
        header = json.dumps({**result, "out": len(out), "err": len(err)}).encode()
        self._send(conn, b"r " + header + b"\n" + out + err)

    @staticmethod
    def _send(conn: socket.socket, data: bytes) -> None:
        """All of ``data`` to a gate's connection (non-blocking: waits while the gate reads); a gate that is
        gone gets nothing."""
        view = memoryview(data)
        while view:
            try:
                view = view[conn.send(view) :]
            except BlockingIOError:
                select.select([], [conn], [], 1.0)
            except OSError:
                return

    def _reserved(self) -> float:
        now = time.time()
        return sum(self._units[c].reserved(now) for c in self._held)

    def _candidate(self) -> tuple[float, int, socket.socket] | None:
        """The waiter to admit next, if any: the one :func:`tasks.engine.admission.choose` picks."""
        with self._lock:
            building = dict(self._building)
        held = [self._units[c] for c in self._held]
        now = time.time()
        running = []
        for u in held:
            ahead = u.outlook(now)
            running.append(admission.Running(u.package, ahead[0][1], u.live_mb, ahead))
        chosen = admission.choose(
            [
                admission.Waiter(self._units[conn].package, -neg, seq, self._units[conn].expect, self._units[conn].step)
                for neg, seq, conn in self._waiting
            ],
            running,
            slots=self.slots,
            budget_mb=self.budget_mb,
            available_mb=available_memory_mb() if self.budget_mb is not None and held else None,
            building=building,
            headroom_mb=self.headroom_mb,
        )
        return None if chosen is None else next(w for w in self._waiting if w[1] == chosen.seq)

    def _grant(self) -> None:
        """Admit waiters while one fits and a token is free (else wait for the token's fifo, or a release)."""
        self._need_token = False
        while self._waiting:
            chosen = self._candidate()
            if chosen is None:
                return
            try:
                token = os.read(self._tokens, 1)
            except BlockingIOError:
                token = b""
            if not token:
                self._need_token = True
                return
            self._waiting.remove(chosen)
            heapq.heapify(self._waiting)
            conn = chosen[2]
            unit = self._units[conn]
            expect = unit.expect.peak_in if unit.expect.after_mb is not None else ""
            unit.node = self.cluster.place(unit.expect.peak_mb) if self.cluster is not None and not unit.here else None
            try:
                conn.send((b"@" if unit.node is not None else b"+") + expect.encode() + b"\n")
            except OSError:
                os.write(self._fifo, token)
                if unit.node is not None and self.cluster is not None:
                    self.cluster.release(None, unit.node, unit.expect.peak_mb)
                    unit.node = None
                continue
            self._held.add(conn)
            unit.since = time.time()
            self._count(unit, waiting=-1, held=+1)
            with self._lock:
                self.peak_running = max(self.peak_running, len(self._held))
                self.peak_reserved_mb = max(self.peak_reserved_mb, self._reserved())
            self._note("retry" if unit.retry else "start", unit)

    def _note(self, event: str, unit: _Unit) -> None:
        """One line of the run's unit log: what happened, to which unit, and the budget's state after it."""
        if self._log is None:
            return
        line = (
            f"{time.time():.3f} {event} {unit.package} {unit.unit} expect={unit.expect.peak_mb:.0f}MB "
            f"live={unit.live_mb:.0f}MB running={len(self._held)} reserved={self._reserved():.0f}MB "
            f"waiting={len(self._waiting)}"
        )
        if event in ("wait", "start") and unit.expect.timed:  # when its peak is expected: seconds in, and for
            line += f" peak_at={unit.expect.peak_from_s:.0f}s+{unit.expect.peak_for_s:.0f}s"
        if unit.node is not None:
            line += f" node={unit.node.name}"
        if event == "end":
            line += f" seconds={time.time() - unit.since:.1f}"
        try:
            self._log.write(line + "\n")
        except (OSError, ValueError):
            self._log = None

    def _count(self, unit: _Unit, *, waiting: int = 0, held: int = 0) -> None:
        """Track, per package, the spans when it had compilers waiting and none running: its wait for slots."""
        counts = self._counts.setdefault(unit.package, [0, 0])
        counts[0] += waiting
        counts[1] += held
        starved = counts[0] > 0 and counts[1] == 0
        now = time.time()
        with self._lock:
            if starved and unit.package not in self._starved_since:
                self._starved_since[unit.package] = now
            elif not starved and unit.package in self._starved_since:
                self._starved.setdefault(unit.package, []).append((self._starved_since.pop(unit.package), now))

    def starved(self, package: str) -> list[tuple[float, float]]:
        """The (start, end) spans, in seconds since the epoch, when ``package`` had compilers waiting for a
        token and none running (what its build waited for job slots), and forgets them."""
        with self._lock:
            return self._starved.pop(package, [])

    @staticmethod
    def _recv(conn: socket.socket) -> bytes | None:
        """What ``conn`` sent (b"" if nothing yet), None when it closed."""
        try:
            data = conn.recv(4096)
        except BlockingIOError:
            return b""
        except OSError:
            return None
        return data or None

    def close(self) -> None:
        self._stop = True
        self._wake()
        self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w, self._tokens):
            try:
                os.close(fd)
            except OSError:
                pass
        self._listen.close()
        if self._log is not None:
            self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _mb(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def available_memory_mb() -> float | None:
    """The host's ``MemAvailable`` in MB, None where ``/proc/meminfo`` does not say."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def available_memory_gb() -> float | None:
    """:func:`available_memory_mb` in GB."""
    mb = available_memory_mb()
    return mb / 1024 if mb is not None else None


def _sock(obj: object) -> socket.socket:
    assert isinstance(obj, socket.socket)
    return obj
