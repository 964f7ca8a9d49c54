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
import fcntl
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import stat
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import proc
from tasks.core.console import warn
from tasks.engine import admission
from tasks.engine.broker import Broker
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


def _record_units(cache_root: Path, package: str, units: dict[str, dict[str, object]], log: Path) -> None:
    """Record what ``package``'s units held in the cache (the next run admits them by it) and say so in its log."""
    history.record_results(cache_root, package, units)
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
        self.slots = slots = _fill(self._fd, slots)
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

    def describe(self, *, compiles: bool = True) -> str:
        """How the run's builds share the slots, in plain words. ``compiles``: whether a build of the run compiles
        an extension; where none does, what ninja would change is left unsaid."""
        if self.clients and self.broker is not None and self.broker.cluster is not None:
            return f"compiles on the {self.broker.cluster.describe()} (ninja {_fmt(self.ninja_version)})"
        if self.clients:
            return f"jobserver with {self.slots} slots shared by all builds (ninja {_fmt(self.ninja_version)})"
        held = f"each build holds up to {self.slots} slots while it runs"
        if not compiles:
            return held
        found = f"ninja {_fmt(self.ninja_version)}" if self.ninja_version else "none"
        return f"{held} (its MAX_JOBS); sharing them compile by compile needs ninja >= 1.13 on PATH (found: {found})"

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
        self,
        package: str,
        *,
        out: Path,
        cache_root: Path,
        patches: Path,
        default_mb: float,
        log: Path,
        profile: str = "default",
    ) -> Iterator[Session]:
        """Open ``package``'s build with the run's broker for the block, and close it however the block ends.

        The :class:`Session`'s ``env`` goes into the build's environment: the file the build's waits for
        tokens go to (``out/waits.log``) and, with the gate, the package and its priority
        (:func:`tasks.engine.admission.priority` of its known unit times, which go to ``out/unit-times.json``
        for the ninja shim). The broker expects the package's units to hold what this cache
        (``cache_root``) recorded, else what the hints in ``patches`` (the package's folder of the lock's
        patches; the ``profile``'s own where it has them) say, else ``default_mb``. When the block ends, a
        failed or interrupted build's too, the broker waits for the build's gates to end
        (:meth:`Broker.settle`: their tokens back, their reports read), and what the units held and their
        seconds go to the cache for the next build and to ``log``. Each unit's record goes to the cache as
        the unit ends too (history.record_unit): a build cut off before the block ends keeps them.
        """
        session = Session(env={}, wait_log=out / "waits.log")
        prio = 0.0
        times: dict[str, float] = {}
        if self.clients:
            times = history.known_times(
                cache_root, history.hints_path(patches, history.TIMES_HINTS_FILE, profile), package
            )
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
            hints=history.load_memory(history.hints_path(patches, history.MEMORY_HINTS_FILE, profile)),
            default_mb=default_mb,
            journal=functools.partial(history.record_unit, cache_root, package),
            times=times,
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


def _fill(fd: int, slots: int) -> int:
    """Write ``slots`` tokens into the fifo ``fd``, never blocking: the tokens it holds (fewer than ``slots``,
    with a warning, where the pipe cannot hold them all).

    A pipe holds 64 KiB unless grown (``F_SETPIPE_SZ``, up to ``/proc/sys/fs/pipe-max-size``; a user past
    ``pipe-user-pages-soft`` gets 4 KiB), and every token comes back into it: a budget larger than it holds
    would block the run's first write for ever, with no output (``jobs=`` above 65 536, or a Ray cluster
    of more CPUs)."""
    try:
        size = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
        if size < slots:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, slots)
    except OSError:  # more than this user may have: the pipe keeps its size
        pass
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    written = 0
    try:
        while written < slots:
            written += os.write(fd, b"+" * min(slots - written, 65536))
    except BlockingIOError:
        pass
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    if written < slots:
        warn(f"job budget: the job server's fifo holds {written} tokens, not {slots}: the run takes {written} jobs")
    return written


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
