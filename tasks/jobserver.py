"""One compiler-job budget for every package build of a run: a GNU make jobserver.

The run owns a named pipe (GNU make 4.4's ``--jobserver-auth=fifo:PATH``)
holding one token per job slot, advertised to builds through ``MAKEFLAGS``.

Every compiler process takes one token for as long as it runs, through the
``gate`` script below: put in front of the compilers by ccache's
``CCACHE_PREFIX`` (so a compile served from the object cache takes none), or,
without the object cache, by scripts named like the compilers first on
``PATH`` (and ``PYTORCH_NVCC``, ``CXX`` by path, CMake's CUDA launcher). A
compile started inside one (nvcc's host compiler) runs on its parent's token.
So the compilers of all packages together never exceed the budget, however
many packages, and ninja runs within a package, build at once, and a freed
slot goes to the next waiting compile at once, whichever ninja it belongs to.

ninja is not made a jobserver client (1.13 can be one): as a client it
starts what tokens it can get, then waits for one of its own commands to end
before asking again (ninja-build/ninja#2683). TransformerEngine's ninja,
started while other packages held every token, ran its longest unit alone
for 230 s on a 16-core host while its 53 other units were ready and slots
had come free. A ``ninja`` shim first on ``PATH`` gives every ninja
``-j <budget>`` instead (an explicit ``-j`` also makes ninja ignore
``MAKEFLAGS``): its commands then wait in the gate, not in ninja. Before that
it lets tasks/ninjaorder.py put the longest units first in the manifest, from
the times in ``REPRO_UNIT_TIMES``.

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
import selectors
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks import ninjaorder

#: ninja gained jobserver client support (``MAKEFLAGS`` with ``fifo:``) in 1.13.
MIN_NINJA = (1, 13)

_SHIM = """#!/bin/sh
# reprostack: while a jobserver is advertised in MAKEFLAGS, every ninja runs
# up to the run's budget of commands (-j), and each compiler among them takes
# a token in the gate: ninja as a jobserver client would wait for one of its
# own commands to end before taking a token that came free (tasks/jobserver.py).
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
# Longest unit first, from the package's last compile times (tasks/ninjaorder.py); never fatal.
[ -n "$REPRO_UNIT_TIMES" ] && {python} -I {order} "$REPRO_UNIT_TIMES" "$@" >/dev/null 2>&1
exec {real} -j {slots} "$@"
"""

#: One token per compiler process: ``gate COMMAND ARGS...`` (``CCACHE_PREFIX``, the compiler scripts).
#: It asks the run's broker (:class:`Broker`) for a token at its package's priority, then becomes the
#: compiler, which inherits the connection: the token goes back when the compiler (and whatever it
#: started) has ended, however it ended, even killed.
_GATE = """#!{python} -IS
# reprostack: run a compiler on one job token of the run (tasks/jobserver.py).
import os, socket, sys
args = sys.argv[1:]
if not os.environ.get("REPRO_GATE_HELD"):  # a compiler started by one holding a token runs on it
    conn = socket.socket(socket.AF_UNIX)
    conn.connect({socket!r})
    hello = os.environ.get("REPRO_GATE_PRIORITY", "0") + " " + os.environ.get("REPRO_GATE_PACKAGE", "")
    conn.sendall(hello.encode() + b"\\n")
    if conn.recv(1) != b"+":
        sys.exit("reprostack gate: the run's job broker is gone")
    os.set_inheritable(conn.fileno(), True)
    os.environ["REPRO_GATE_HELD"] = "1"
os.execvp(args[0], args)
"""


class Broker:
    """Hands the run's tokens to waiting compilers, highest priority first (then first come).

    A compiler's gate connects and sends its package's priority (:func:`priority`); the broker
    takes a token from the jobserver's fifo for it, answers ``+``, and puts the token back when the
    connection closes. So the package that sets the run's wall time is never queued behind one that
    does not, and a token freed by any package goes to the best waiter at once.
    """

    def __init__(self, fifo_fd: int) -> None:
        self._fifo = fifo_fd
        self._dir = tempfile.mkdtemp(prefix="reprostack-jobs-")  # short: unix socket paths are limited
        self.socket = os.path.join(self._dir, "broker.sock")
        self._listen = socket.socket(socket.AF_UNIX)
        self._listen.bind(self.socket)
        self._listen.listen(256)
        self._listen.setblocking(False)
        self._wake_r, self._wake_w = os.pipe()
        self._tokens = os.open(f"/proc/self/fd/{fifo_fd}", os.O_RDONLY | os.O_NONBLOCK)
        self._waiting: list[tuple[float, int, socket.socket]] = []
        self._held: set[socket.socket] = set()
        self._package: dict[socket.socket, str] = {}
        self._counts: dict[str, list[int]] = {}  # package -> [waiting, held]
        self._starved_since: dict[str, float] = {}
        self._starved: dict[str, list[tuple[float, float]]] = {}
        self._log_lock = threading.Lock()
        self._seq = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="job-broker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listen, selectors.EVENT_READ, "accept")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        fifo_registered = False
        pending: dict[socket.socket, bytes] = {}
        while not self._stop:
            want_tokens = bool(self._waiting)
            if want_tokens != fifo_registered:
                if want_tokens:
                    sel.register(self._tokens, selectors.EVENT_READ, "tokens")
                else:
                    sel.unregister(self._tokens)
                fifo_registered = want_tokens
            for key, _ in sel.select():
                what = key.data
                if what == "accept":
                    try:
                        conn, _addr = self._listen.accept()
                    except BlockingIOError:
                        continue
                    conn.setblocking(False)
                    pending[conn] = b""
                    sel.register(conn, selectors.EVENT_READ, "hello")
                elif what == "hello":
                    conn = _sock(key.fileobj)
                    data = self._recv(conn)
                    if data is None:  # gone before it said anything
                        sel.unregister(conn)
                        pending.pop(conn, None)
                        conn.close()
                        continue
                    pending[conn] += data
                    if b"\n" in pending[conn]:
                        words = pending.pop(conn).split(b"\n")[0].decode(errors="replace").split()
                        try:
                            prio = float(words[0])
                        except (ValueError, IndexError):
                            prio = 0.0
                        self._package[conn] = words[1] if len(words) > 1 else ""
                        self._count(conn, waiting=+1)
                        self._seq += 1
                        heapq.heappush(self._waiting, (-prio, self._seq, conn))
                        sel.modify(conn, selectors.EVENT_READ, "waiting")
                elif what in ("waiting", "held"):
                    conn = _sock(key.fileobj)
                    if self._recv(conn) is None:  # closed: a held token goes back; a waiter is dropped
                        sel.unregister(conn)
                        conn.close()
                        if conn in self._held:
                            self._held.discard(conn)
                            self._count(conn, held=-1)
                            os.write(self._fifo, b"+")
                        else:
                            self._waiting = [w for w in self._waiting if w[2] is not conn]
                            heapq.heapify(self._waiting)
                            self._count(conn, waiting=-1)
                        self._package.pop(conn, None)
                elif what == "tokens":
                    while self._waiting:
                        try:
                            token = os.read(self._tokens, 1)
                        except BlockingIOError:
                            break
                        if not token:
                            break
                        _prio, _seq, conn = heapq.heappop(self._waiting)
                        try:
                            conn.send(b"+")
                        except OSError:
                            os.write(self._fifo, token)
                            continue
                        self._held.add(conn)
                        self._count(conn, waiting=-1, held=+1)
                        sel.modify(conn, selectors.EVENT_READ, "held")
                elif what == "wake":
                    os.read(self._wake_r, 64)
        sel.close()

    def _count(self, conn: socket.socket, *, waiting: int = 0, held: int = 0) -> None:
        """Track, per package, the spans when it had compilers waiting and none running: its wait for slots."""
        package = self._package.get(conn, "")
        counts = self._counts.setdefault(package, [0, 0])
        counts[0] += waiting
        counts[1] += held
        starved = counts[0] > 0 and counts[1] == 0
        now = time.time()
        with self._log_lock:
            if starved and package not in self._starved_since:
                self._starved_since[package] = now
            elif not starved and package in self._starved_since:
                self._starved.setdefault(package, []).append((self._starved_since.pop(package), now))

    def starved(self, package: str) -> list[tuple[float, float]]:
        """The (start, end) spans, in seconds since the epoch, when ``package`` had compilers waiting for a
        token and none running (what its build waited for job slots), and forgets them."""
        with self._log_lock:
            return self._starved.pop(package, [])

    @staticmethod
    def _recv(conn: socket.socket) -> bytes | None:
        """What ``conn`` sent (b"" if nothing yet), None when it closed."""
        try:
            data = conn.recv(64)
        except BlockingIOError:
            return b""
        except OSError:
            return None
        return data or None

    def close(self) -> None:
        self._stop = True
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass
        self._thread.join(timeout=5)
        for fd in (self._wake_r, self._wake_w, self._tokens):
            try:
                os.close(fd)
            except OSError:
                pass
        self._listen.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _sock(obj: object) -> socket.socket:
    assert isinstance(obj, socket.socket)
    return obj


def priority(times: dict[str, float], slots: int) -> float:
    """A package's claim on the run's tokens: its recorded critical path, its longest compile unit, plus
    its work spread over the budget (tasks/ninjaorder.py records unit times; patches/<pkg>/ holds hints
    for an empty cache). Packages without records get 0: after every package that has them."""
    if not times:
        return 0.0
    return round(max(times.values()) + sum(times.values()) / max(1, slots), 1)


#: The compilers gated by name on PATH where no ccache does it (tasks/objcache.py masquerades the same names).
GATED = ("cc", "gcc", "c++", "g++", "nvcc")


@dataclass(frozen=True)
class Budget:
    """How many compiler jobs may run at once, and why."""

    slots: int
    reason: str


def plan_budget(
    *, cores: int, mem_gb: float | None, heaviest_gb: float, jobs: int | None, mem_source: str = "available"
) -> Budget:
    """The run's job budget: ``jobs`` (default: cores), lowered so that the heaviest
    package's jobs fit in memory (``mem_gb`` / ``heaviest_gb`` per job)."""
    slots = jobs or cores
    reason = f"jobs={jobs}" if jobs else f"{cores} cores"
    if mem_gb is not None and heaviest_gb > 0:
        fit = max(1, int(mem_gb // heaviest_gb))
        if fit < slots:
            slots = fit
            reason = f"{mem_gb:.0f} GB {mem_source} / {heaviest_gb:g} GB per job"
    return Budget(slots=max(1, slots), reason=reason)


def ninja_version(ninja: str) -> tuple[int, ...] | None:
    try:
        out = subprocess.run([ninja, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.match(r"(\d+)\.(\d+)", out.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


class JobServer:
    """A fifo of ``slots`` tokens plus the ninja shim, alive for this process."""

    def __init__(self, slots: int, directory: Path, *, search_path: str) -> None:
        self.slots = slots
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.fifo = directory / f"jobserver-{os.getpid()}.fifo"
        self.fifo.unlink(missing_ok=True)
        os.mkfifo(self.fifo, 0o600)
        # Read-write, so that the fifo never reports end-of-file to readers
        # and writes never block while this process lives.
        self._fd = os.open(self.fifo, os.O_RDWR)
        os.write(self._fd, b"+" * slots)
        self._gather = threading.Lock()
        real = shutil.which("ninja", path=search_path)
        version = ninja_version(real) if real else None
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
                )
            )
            shim.chmod(shim.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            self.broker = Broker(self._fd)
            self.gate.write_text(_GATE.format(python=sys.executable, socket=self.broker.socket))
            self.gate.chmod(0o755)
        atexit.register(self.close)

    def describe(self) -> str:
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
        if "cxx-by-path" in scripts:
            out["CXX"] = str(gated / "cxx-by-path")
        if "nvcc" in scripts:  # torch's cpp_extension runs $CUDA_HOME/bin/nvcc by path otherwise
            out["PYTORCH_NVCC"] = str(gated / "nvcc")
        out.setdefault("CMAKE_CUDA_COMPILER_LAUNCHER", gate)
        how = ", ".join(f"{name} = {target}" for name, target in targets.items())
        return out, f"# each compiler takes a job token through the run's gate: {how}"

    @staticmethod
    def _gated(env: dict[str, str]) -> dict[str, str]:
        """What the gate's compiler scripts run for ``env`` (without ccache): name -> command."""
        targets = {}
        for name in GATED:
            found = shutil.which(name, path=env.get("PATH", ""))
            if found:
                targets[name] = shlex.quote(os.path.abspath(found))
        cxx = env.get("CXX", "")
        if cxx and "/" in shlex.split(cxx)[0]:
            targets["cxx-by-path"] = cxx
        return targets

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
