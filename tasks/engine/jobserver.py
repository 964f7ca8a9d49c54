"""One compiler-job budget for every package build of a run: a GNU make jobserver.

The run owns a named pipe (GNU make 4.4's ``--jobserver-auth=fifo:PATH``)
holding one token per job slot, advertised to builds through ``MAKEFLAGS``.

Every compiler process takes one token for as long as it runs, and room for
its own expected memory in the run's memory budget (:class:`Broker`), through
the gate (tasks/outside/gate.py): put in front of the compilers by ccache's
``CCACHE_PREFIX`` (so a compile served from the object cache takes none), or,
without the object cache, by scripts named like the compilers first on
``PATH`` (and ``PYTORCH_NVCC``, ``CXX`` by path, CMake's CUDA launcher). A
compile started inside one (nvcc's host compiler) runs on its parent's token.
So the compilers of all packages together never exceed the budget, however
many packages, and ninja runs within a package, build at once, and a freed
slot goes to the next waiting compile at once, whichever ninja it belongs to.
Which one is tasks/engine/admission.py's choice (:func:`tasks.engine.admission.choose`); a
build opens and closes its part with :meth:`JobServer.build_session`.

ninja is not made a jobserver client (1.13 can be one): as a client it
starts what tokens it can get, then waits for one of its own commands to end
before asking again (ninja-build/ninja#2683). TransformerEngine's ninja,
started while other packages held every token, ran its longest unit alone
for 230 s on a 16-core host while its 53 other units were ready and slots
had come free. A ``ninja`` shim first on ``PATH`` gives every ninja
``-j <budget>`` instead (an explicit ``-j`` also makes ninja ignore
``MAKEFLAGS``): its commands then wait in the gate, not in ninja. Before that
it lets tasks/outside/ninjaorder.py put the longest units first in the manifest, from
the times in ``REPRO_UNIT_TIMES`` (:meth:`JobServer.build_session`).

Without ninja >= 1.13 on PATH (the shim is written only then), a build takes
as many tokens as it runs jobs (``MAX_JOBS``), so parallel builds still share
one budget, coarsely.
"""

from __future__ import annotations

import atexit
import hashlib
import heapq
import json
import os
import re
import select
import selectors
import shlex
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.core import proc
from tasks.engine import admission
from tasks.engine.admission import Expect, Expectations
from tasks.env import compilers
from tasks.outside import gate as gate_module
from tasks.outside import ninjaorder
from tasks.store import history

if TYPE_CHECKING:
    from tasks.engine.cluster import Cluster

#: ninja gained jobserver client support (``MAKEFLAGS`` with ``fifo:``) in 1.13.
MIN_NINJA = (1, 13)

_SHIM = """#!/bin/sh
# reprostack: while a jobserver is advertised in MAKEFLAGS, every ninja runs
# up to the run's budget of commands (-j), and each compiler among them takes
# a token in the gate: ninja as a jobserver client would wait for one of its
# own commands to end before taking a token that came free (tasks/engine/jobserver.py).
case "$MAKEFLAGS" in
  *--jobserver-auth=fifo:*) ;;
  *) exec {real} "$@" ;;
esac
skip=0
query=0
for a do
  shift
  if [ "$skip" = 1 ]; then skip=0; continue; fi
  case "$a" in
    -j) skip=1; continue ;;
    -j*) continue ;;
    --version|-t|-n) query=1 ;;
  esac
  set -- "$@" "$a"
done
[ "$query" = 1 ] && exec {real} "$@"
# Longest unit first, from the package's last compile times (tasks/outside/ninjaorder.py); never fatal.
[ -n "${unit_times}" ] && {python} -I {order} "${unit_times}" "$@" >/dev/null 2>&1
exec {real} -j {slots} "$@"
"""


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
    buf: bytes = b""
    #: On a cluster: the node it runs on (tasks/engine/cluster.py ``Node``) and its task there, once sent.
    node: Any = None
    task: object = None
    #: Its gate said it must run here (a link, a preprocessor run): never sent to a cluster.
    here: bool = False

    def reserved(self) -> float:
        """The memory counted for this running unit: what it holds, or more, what it is expected to reach."""
        return admission.reserved(self.expect, self.live_mb, self.past)


class Broker:
    """Admits the run's compiles: a token each, highest priority first (then first come), and, with a
    memory budget, room for each unit's recorded or estimated peak.

    A compile's gate (tasks/outside/gate.py) connects and says its package's priority
    (:func:`tasks.engine.admission.priority`) and its unit; the broker admits it when a token is free and its
    expected memory fits in the budget next to what the running units hold or are expected to reach
    (and in what the host really has left), answers ``+``, and takes the token and the room back when
    the connection closes. A unit that does not fit waits, and units behind it start only where they
    leave its room free: heavy units are never overtaken for good, light ones fill the rest. While a
    unit runs its gate reports its memory; once the process its recorded peak came in has ended, only
    its recorded rest is counted. So the package that sets the run's wall time is never queued behind
    one that does not, and memory is counted per unit, not as a fixed figure per job. Which waiter goes
    next is :func:`tasks.engine.admission.choose`'s decision; the broker keeps the sockets, the token fifo and
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
        self._results: dict[str, dict[str, dict[str, object]]] = {}
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
    ) -> None:
        """``package``'s build has started, at ``priority`` (while the highest one builds, a token may be
        kept for it: :func:`tasks.engine.admission.choose`); its units are expected to hold what ``records`` say
        by unit, else what ``hints`` say, else ``default_mb``."""
        with self._lock:
            self._building[package] = priority
            self._plans[package] = Expectations(records=records or {}, hints=hints or {}, default_mb=default_mb)
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
            for key, _ in sel.select():
                what = key.data
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
                self._grant()
            with self._served:
                self._served.notify_all()
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
        unit.expect = plan.expect(unit.unit) if plan is not None else Expect(0.0)
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
        self._note("wait", unit)

    def _report(self, conn: socket.socket, unit: _Unit, words: list[str]) -> None:
        """A running compile's reports: ``m LIVE_MB PAST``, ``k PEAK_MB`` (killed for memory) and
        ``d PEAK_MB PEAK_IN AFTER_MB SECONDS EXIT`` (done)."""
        try:
            if words[0] == "m":
                unit.live_mb = float(words[1])
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
                if unit.node is not None:  # where and when it ran (the trace's node tracks)
                    found["node"] = unit.node.name
                    found["since"] = unit.since
                self._record(unit, found)
        except (IndexError, ValueError):
            return

    def _record(self, unit: _Unit, found: dict[str, object]) -> None:
        """Keep what a unit reported; a retried unit keeps the mark and the larger peak of its killed run."""
        with self._lock:
            done = self._results.setdefault(unit.package, {})
            previous = done.get(unit.unit, {})
            if previous.get("killed"):
                found["killed"] = True
                found["peak_mb"] = max(_mb(previous.get("peak_mb")), _mb(found.get("peak_mb")))
            done[unit.unit] = found

    def _closed(self, conn: socket.socket) -> None:
        """A closed connection: a running unit's token goes back and its room is free; a waiter is dropped."""
        unit = self._units.pop(conn)
        if conn in self._held:
            self._held.discard(conn)
            self._count(unit, held=-1)
            os.write(self._fifo, b"+")
            self._note("end", unit)
        if self.cluster is not None and (unit.task is not None or unit.node is not None):
            if unit.task is not None:  # its gate is gone (Ctrl-C, a failed build) while it ran there: so is it
                self._note("cancelled", unit)
            self.cluster.release(unit.task, unit.node, unit.expect.peak_mb)
            unit.task = unit.node = None
        elif unit.package:
            self._waiting = [w for w in self._waiting if w[2] is not conn]
            heapq.heapify(self._waiting)
            self._count(unit, waiting=-1)

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
        return sum(self._units[c].reserved() for c in self._held)

    def _candidate(self) -> tuple[float, int, socket.socket] | None:
        """The waiter to admit next, if any: the one :func:`tasks.engine.admission.choose` picks."""
        with self._lock:
            building = dict(self._building)
        held = [self._units[c] for c in self._held]
        chosen = admission.choose(
            [
                admission.Waiter(self._units[conn].package, -neg, seq, self._units[conn].expect)
                for neg, seq, conn in self._waiting
            ],
            [admission.Running(u.package, u.reserved(), u.live_mb) for u in held],
            slots=self.slots,
            budget_mb=self.budget_mb,
            available_mb=available_memory_mb() if self.budget_mb is not None and held else None,
            building=building,
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


def _record_units(cache_root: Path, package: str, units: dict[str, dict[str, object]], log: Path) -> None:
    """Record what ``package``'s units held in the cache (the next run admits them by it) and say so in its log."""
    history.record_memory(cache_root, package, units)
    # The units' times too: an interrupted or failed build leaves no ninja log to take them from.
    history.record_times(
        cache_root,
        package,
        {u: float(str(found["seconds"])) for u, found in units.items() if "seconds" in found and "exit" not in found},
    )
    killed = sorted(u for u, found in units.items() if found.get("killed"))
    peaks = {u: float(str(found.get("peak_mb", 0))) for u, found in units.items()}
    with log.open("a") as fh:
        if peaks:
            top = max(peaks, key=peaks.__getitem__)
            fh.write(f"# {len(peaks)} compiles; the largest held {peaks[top] / 1024:.1f} GB ({top})\n")
        for unit in killed:
            then = "failed again" if units[unit].get("exit") else "then passed"
            fh.write(f"# {unit} was killed for memory and run once more: it {then}\n")
    for unit in killed:
        print(f"note: {package}: {unit} was killed for memory and run once more with room for it", flush=True)


@dataclass
class Session:
    """One package's build as the run's job server sees it (:meth:`JobServer.build_session`)."""

    #: What the build's environment gets: the file its waits for job tokens go to and, with the gate, the
    #: package and its priority (tasks/outside/gate.py's ``ENV_*`` names) and its unit times for the ninja shim.
    env: dict[str, str]
    #: Where :meth:`JobServer.slot` writes the build's waits for its tokens (``REPRO_WAIT_LOG``).
    wait_log: Path
    #: Once the build has ended, however: what each of its units held (:meth:`Broker.results`).
    units: dict[str, dict[str, object]] = field(default_factory=dict)
    #: Once the build has ended without an exception: the spans when its compilers waited for a token and
    #: none of them ran (:meth:`Broker.starved`).
    starved: list[tuple[float, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Budget:
    """How many compiler jobs may run at once, and why."""

    slots: int
    reason: str


def plan_budget(
    *,
    cores: int,
    mem_gb: float | None,
    heaviest_gb: float,
    jobs: int | None,
    mem_source: str = "available",
    per_unit: bool = False,
) -> Budget:
    """The run's job budget: ``jobs`` (default: cores), lowered so that the heaviest
    package's jobs fit in memory (``mem_gb`` / ``heaviest_gb`` per job), unless the gate
    admits each unit against ``mem_gb`` by its own memory (``per_unit``)."""
    slots = jobs or cores
    reason = f"jobs={jobs}" if jobs else f"{cores} cores"
    if per_unit and mem_gb is not None:
        reason += f"; memory admitted per unit against {mem_gb:.0f} GB {mem_source}"
    elif mem_gb is not None and heaviest_gb > 0:
        fit = max(1, int(mem_gb // heaviest_gb))
        if fit < slots:
            slots = fit
            reason = f"{mem_gb:.0f} GB {mem_source} / {heaviest_gb:g} GB per job"
    return Budget(slots=max(1, slots), reason=reason)


def find_ninja(search_path: str) -> tuple[str | None, tuple[int, ...] | None]:
    """The ninja on ``search_path`` and its version (None, None without one)."""
    real = shutil.which("ninja", path=search_path)
    return real, (ninja_version(real) if real else None)


def ninja_version(ninja: str) -> tuple[int, ...] | None:
    try:
        out = proc.query([ninja, "--version"], timeout=30, text=True).stdout
    except (OSError, proc.TimeoutExpired):
        return None
    m = re.match(r"(\d+)\.(\d+)", out.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


class JobServer:
    """A fifo of ``slots`` tokens plus the ninja shim, alive for this process."""

    def __init__(
        self,
        slots: int,
        directory: Path,
        *,
        search_path: str,
        ninja: tuple[str | None, tuple[int, ...] | None] | None = None,
        mem_budget_gb: float | None = None,
        unit_log: Path | None = None,
        cluster: Cluster | None = None,
    ) -> None:
        """``slots`` tokens; the gate admits units against ``mem_budget_gb`` (None: tokens only) and logs
        each unit's start and end to ``unit_log``. ``ninja``: :func:`find_ninja`'s answer, if known. With a
        ``cluster`` (tasks/engine/cluster.py), the compiles run on its nodes; the job server closes it."""
        self.slots = slots
        self.cluster = cluster
        # make and ninja split MAKEFLAGS (the fifo's path) on spaces, build scripts the gate's scripts' paths
        self.directory = directory = compilers.spaceless_dir(directory, "reprostack-jobserver-")
        self.fifo = directory / f"jobserver-{os.getpid()}.fifo"
        self.fifo.unlink(missing_ok=True)
        os.mkfifo(self.fifo, 0o600)
        # Read-write, so that the fifo never reports end-of-file to readers
        # and writes never block while this process lives.
        self._fd = os.open(self.fifo, os.O_RDWR)
        os.write(self._fd, b"+" * slots)
        self._gather = threading.Lock()
        real, version = ninja if ninja is not None else find_ninja(search_path)
        self.ninja = real
        self.ninja_version = version
        self.clients = version is not None and version >= MIN_NINJA
        self.bin = directory / f"bin-{os.getpid()}"
        self.gate = self.bin / "gate"
        self.broker: Broker | None = None
        if self.clients and real:
            self.bin.mkdir(exist_ok=True)
            shim = self.bin / "ninja"
            shim.write_text(
                _SHIM.format(
                    real=shlex.quote(os.path.abspath(real)),
                    slots=slots,
                    python=shlex.quote(sys.executable),
                    order=shlex.quote(str(Path(ninjaorder.__file__).resolve())),
                    unit_times=gate_module.ENV_UNIT_TIMES,
                )
            )
            shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            if unit_log is not None:
                unit_log.parent.mkdir(parents=True, exist_ok=True)
            budget_mb = mem_budget_gb * 1024 if mem_budget_gb is not None else None
            self.broker = Broker(self._fd, budget_mb=budget_mb, log=unit_log, slots=slots, cluster=cluster)
            source = Path(gate_module.__file__).read_text()
            call = f"\nraise SystemExit(main({self.broker.socket!r}, sys.argv[1:]))\n"
            if compilers.has_space(sys.executable):  # a '#!' line cannot name it: a shell starts the gate
                script = self.bin / "gate.py"
                script.write_text(source + call)
                quoted = f"{shlex.quote(sys.executable)} -IS {shlex.quote(str(script))}"
                self.gate.write_text(f'#!/bin/sh\nexec {quoted} "$@"\n')
            else:
                self.gate.write_text(f"#!{sys.executable} -IS\n" + source + call)
            self.gate.chmod(0o755)
        atexit.register(self.close)

    def describe(self) -> str:
        if self.clients and self.broker is not None and self.broker.cluster is not None:
            return f"compiles on the {self.broker.cluster.describe()} (ninja {_fmt(self.ninja_version)})"
        if self.clients:
            return f"jobserver with {self.slots} slots shared by all builds (ninja {_fmt(self.ninja_version)})"
        found = f"ninja {_fmt(self.ninja_version)}" if self.ninja_version else "no ninja"
        return f"{self.slots} job slots; {found} on PATH cannot share them (needs >= 1.13): a build holds its MAX_JOBS"

    def env(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with MAKEFLAGS advertising the jobserver and the shim first on PATH."""
        if not self.clients:
            return base
        env = dict(base)
        flags = [f for f in env.get("MAKEFLAGS", "").split() if not f.startswith(("-j", "--jobserver"))]
        env["MAKEFLAGS"] = " ".join([f"-j{self.slots}", f"--jobserver-auth=fifo:{self.fifo}", *flags])
        env.pop("MFLAGS", None)
        env["PATH"] = os.pathsep.join([str(self.bin), env.get("PATH", "")])
        return env

    def gate_env(self, env: dict[str, str], *, ccache: bool) -> tuple[dict[str, str], str]:
        """``env`` (the build's final environment) with every compiler process taking a token in the gate,
        and a line for the build log saying how the compilers reach it.

        With ``ccache`` (the object cache routes the build's compilers through ccache), ccache runs the
        gate on a miss (``CCACHE_PREFIX``, and ``CCACHE_PREFIX_CPP`` for its preprocessor runs);
        otherwise scripts named like the compilers go first on PATH, and ``PYTORCH_NVCC``, ``CXX``
        given by path and CMake's CUDA launcher name the gate too.
        """
        if not self.clients:
            return env, ""
        out = dict(env)
        gate = str(self.gate)
        if ccache:  # its preprocessor runs (nvcc -E: seconds, hundreds of MB) too
            out["CCACHE_PREFIX"] = out["CCACHE_PREFIX_CPP"] = gate
            return out, "# each compiler takes a job token through the run's gate: ccache (CCACHE_PREFIX)"
        path = out.get("PATH", "")
        targets = self._gated(out)
        scripts = {name: f'#!/bin/sh\nexec {shlex.quote(gate)} {target} "$@"\n' for name, target in targets.items()}
        by_path = {var: f"{var.lower()}-by-path" for var in compilers.by_path(out)}
        digest = hashlib.sha256(json.dumps(scripts, sort_keys=True).encode()).hexdigest()[:16]
        gated = self.bin / f"gated-{digest}"
        if not gated.is_dir():
            tmp = self.bin / f".gated-{digest}-{threading.get_ident()}"
            tmp.mkdir(parents=True)
            for name, text in scripts.items():
                (tmp / name).write_text(text)
                (tmp / name).chmod(0o755)
            try:
                tmp.rename(gated)
            except OSError:  # another build of this run wrote the same scripts first
                shutil.rmtree(tmp, ignore_errors=True)
        out["PATH"] = os.pathsep.join([str(gated), path])
        for var, name in by_path.items():
            out[var] = str(gated / name)
        if "nvcc" in scripts:  # torch's cpp_extension runs $CUDA_HOME/bin/nvcc by path otherwise
            out["PYTORCH_NVCC"] = str(gated / "nvcc")
        out.setdefault("CMAKE_CUDA_COMPILER_LAUNCHER", gate)
        how = ", ".join(f"{name} = {target}" for name, target in targets.items())
        return out, f"# each compiler takes a job token through the run's gate: {how}"

    @staticmethod
    def _gated(env: dict[str, str]) -> dict[str, str]:
        """What the gate's compiler scripts run for ``env`` (without ccache): name -> command."""
        targets = {}
        for name in compilers.names(env):
            found = shutil.which(name, path=env.get("PATH", ""))
            if found:
                targets[name] = shlex.quote(os.path.abspath(found))
        for var, command in compilers.by_path(env).items():
            targets[f"{var.lower()}-by-path"] = command
        return targets

    @contextmanager
    def build_session(
        self, package: str, *, out: Path, cache_root: Path, patches: Path, default_mb: float, log: Path
    ) -> Iterator[Session]:
        """Open ``package``'s build with the run's broker for the block, and close it however the block ends.

        The :class:`Session`'s ``env`` goes into the build's environment: the file the build's waits for
        tokens go to (``out/waits.log``) and, with the gate, the package and its priority
        (:func:`tasks.engine.admission.priority` of its known unit times, which go to ``out/unit-times.json``
        for the ninja shim). The broker expects the package's units to hold what this cache
        (``cache_root``) recorded, else what the hints in ``patches`` (the package's folder of the lock's
        patches) say, else ``default_mb``. When the block ends, a failed or interrupted build's too, the
        broker waits for the build's gates to end (:meth:`Broker.settle`: their tokens back, their reports
        read), and what the units held and their seconds go to the cache for the next build and to ``log``.
        """
        session = Session(env={}, wait_log=out / "waits.log")
        prio = 0.0
        if self.clients:
            times = history.known_times(cache_root, patches / history.TIMES_HINTS_FILE, package)
            if times:
                times_file = out / "unit-times.json"
                times_file.write_text(json.dumps(times))
                session.env[gate_module.ENV_UNIT_TIMES] = str(times_file)
            prio = admission.priority(times, self.slots)
            session.env[gate_module.ENV_PRIORITY] = str(prio)
            session.env[gate_module.ENV_PACKAGE] = package
        session.env[gate_module.ENV_WAIT_LOG] = str(session.wait_log)
        broker = self.broker  # (there is one only with self.clients)
        if broker is None:
            yield session
            return
        broker.building(
            package,
            prio,
            records=history.load_memory(history.memory_path(cache_root, package)),
            hints=history.load_memory(patches / history.MEMORY_HINTS_FILE),
            default_mb=default_mb,
        )
        try:
            yield session
        finally:  # what each unit held, failed builds' too (a unit killed for memory)
            broker.finished(package)
            broker.settle(package)  # its gates have ended: their tokens back, their reports read
            session.units = broker.results(package)
            _record_units(cache_root, package, session.units, log)
        session.starved = broker.starved(package)

    def tokens_for(self, jobs: int) -> int:
        """Tokens a build of ``jobs`` compiler jobs holds while it runs.

        With the gate, none: every compiler takes its own, and the rest of a
        build (setup.py, cmake's configure, pip) hardly uses a core. Without,
        as many as the build runs jobs.
        """
        return 0 if self.clients else max(1, min(jobs, self.slots))

    @contextmanager
    def slot(self, count: int = 1, wait_log: Path | None = None) -> Iterator[None]:
        """Hold ``count`` tokens (blocking until they are free) for the block's duration.

        With ``wait_log``, the wait's start and end (ns since the epoch) are appended to it, as the
        ninja shim does for its first token.
        """
        taken = 0
        waited = time.time_ns()
        try:
            # One gatherer at a time, so two builds each holding part of
            # what they need cannot wait on each other forever.
            with self._gather:
                while taken < count:
                    taken += len(os.read(self._fd, count - taken))
            if wait_log is not None and count:
                with wait_log.open("a") as fh:
                    fh.write(f"{waited} {time.time_ns()}\n")
            yield
        finally:
            if taken:
                os.write(self._fd, b"+" * taken)

    def close(self) -> None:
        if self.broker is not None:
            self.broker.close()
            self.broker = None
        if self.cluster is not None:
            self.cluster.close()
            self.cluster = None
        try:
            os.close(self._fd)
        except OSError:
            pass
        self.fifo.unlink(missing_ok=True)
        shutil.rmtree(self.bin, ignore_errors=True)


def _fmt(version: tuple[int, ...] | None) -> str:
    return ".".join(map(str, version)) if version else "?"


#: Lines compilers and build drivers print when the kernel's OOM killer or an
#: exhausted address space stopped them (gcc, nvcc's cicc/ptxas, the C++ runtime).
#: A bare "Killed" is nvcc's: its shell prints it when the OOM killer SIGKILLs
#: cicc or ptxas (FA3's full profile on the H200 host: 41 jobs, cicc at up to 22 GB).
_OOM = re.compile(
    r"died due to signal 9|Killed signal terminated program|internal compiler error: Killed"
    r"|virtual memory exhausted|out of memory allocating|std::bad_alloc|Cannot allocate memory"
    r"|^\s*Killed\s*$"
)


def killed_for_memory(log_text: str) -> str | None:
    """The first line of ``log_text`` showing a compiler killed for memory, if any.

    A bare "Killed" comes with ninja's ``FAILED:`` line for the unit before it.
    """
    failed = ""
    for line in log_text.splitlines():
        if line.lstrip().startswith("FAILED:"):
            failed = line.strip()
        if _OOM.search(line):
            return f"{failed}: Killed" if failed and line.strip() == "Killed" else line.strip()
    return None
