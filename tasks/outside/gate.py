"""The gate: one compiler process, run on a job token and on room in the run's memory budget.

The run's broker (tasks/engine/jobserver.py) writes this file, with a line calling
:func:`main` with its socket, as the script ``gate`` that every compiler of a
build runs through (ccache's ``CCACHE_PREFIX``, or scripts named like the
compilers first on ``PATH``). For one compile it:

1. says to the broker which package and which unit (the ``-o`` output's file
   name, the key of the package's recorded unit times) it is, at the package's
   priority, and waits until the broker admits it: a free token, and room for
   the unit's recorded or estimated peak memory;
2. runs the compiler as its child, sampling the resident memory of the whole
   process tree (nvcc, cicc, ptxas, the host compiler) from ``/proc`` while it
   runs, and telling the broker when it changes: so the broker counts what the
   unit really holds, and once the process in which the unit's recorded peak
   came (cicc, for FlashAttention's kernels) has ended, the smaller rest of it;
3. when the compile was killed for memory (SIGKILL, or the kernel's OOM
   counter rose while it ran), runs it once more, first in the queue, with
   room for twice what it reached, rather than failing the build;
4. reports the unit's peak, the process it came in, what it held after that
   process ended and its seconds, and when its peak came: from how many
   seconds into the unit, and for how long, it held at least half its peak
   (:data:`HIGH_SHARE`), and the most it held before and after that; the build
   records them next to the unit times (``timings/<package>.memory.json`` in
   the cache), and the broker admits the unit by them at the next build.

On a build with a Ray cluster (``cluster=``, tasks/engine/cluster.py) the broker may
answer ``@`` instead of ``+``: the compile then runs on a node of the cluster.
The gate sends its command line, working directory and environment to the
broker, which runs them there (:func:`run_captured`, in a Ray task), and
gets back the exit status, the memory figures and what the compiler wrote,
which it writes to its own output as the compiler would have.

The token and the room go back when the connection closes, however the gate
ends: the compiler inherits the connection and dies with a killed gate.

Standard library only, and no import of the rest of tasks/: it runs under
``python -IS``, once per compile.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable

#: The environment a build runs with, by name (set by tasks/engine/jobserver.py's ``JobServer.build_session``,
#: which imports them from here: this file imports nothing of tasks/).
#: The package a compile belongs to, and that package's priority at the broker (its hello line).
ENV_PACKAGE = "REPRO_GATE_PACKAGE"
ENV_PRIORITY = "REPRO_GATE_PRIORITY"
#: Set by a gate for its compiler: a compiler that one starts (nvcc's host compiler) runs on its token.
ENV_HELD = "REPRO_GATE_HELD"
#: Set by a gate for its compiler and what it starts (tasks/env/compilers.py's ``GATED_MARK``).
ENV_GATED = "REPRO_GATED"
#: The package's recorded unit times, which the ninja shim (tasks/engine/jobserver.py) orders its manifest by.
ENV_UNIT_TIMES = "REPRO_UNIT_TIMES"
#: The file where the build's waits for job tokens are written (tasks/engine/jobserver.py ``JobServer.slot``).
ENV_WAIT_LOG = "REPRO_WAIT_LOG"

#: A compile's memory is sampled this often at first (seconds), then less often up to MAX_INTERVAL.
FIRST_INTERVAL = 0.05
MAX_INTERVAL = 1.0
#: A change smaller than this (MB) is not reported to the broker.
REPORT_STEP_MB = 64
#: A unit's peak span: the time it holds at least this share of its peak (tasks/engine/admission.py charges
#: its peak only then, and what it holds before and after it otherwise).
HIGH_SHARE = 0.5
#: A peak that no sample saw (the kernel's figure larger than the largest sample by this factor: a spike
#: between two samples) leaves the unit untimed.
MISSED_PEAK = 1.25

_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)


#: The file name endings of the sources a compiler compiles (a command line without one links, or asks).
SOURCES = (".cu", ".cpp", ".cc", ".cxx", ".c", ".C")


def unit_name(args: list[str]) -> str:
    """The unit a compiler command line builds: its ``-o`` output's file name (as ninja's log names it).

    A preprocessor-only run (``-E``, ``-M``, ``-MM``; ccache's ``CCACHE_PREFIX_CPP``) is named by its
    source with ``.E`` after it, so that its small memory is recorded apart from the compile's.
    """
    output = ""
    source = ""
    it = iter(args[1:])
    for arg in it:
        if arg in ("-o", "--output-file"):
            output = next(it, "")
        elif arg.startswith("-o") and len(arg) > 2 and not arg.startswith("-o="):
            output = arg[2:]
        elif arg.startswith(("--output-file=", "-o=")):
            output = arg.split("=", 1)[1]
        elif not arg.startswith("-") and os.path.splitext(arg)[1] in SOURCES:
            source = arg
    if not output and not source:  # a question to the compiler (--version, -dumpmachine): no unit
        return ""
    if any(a in ("-E", "-M", "-MM") for a in args[1:]):
        return os.path.basename(source or output) + ".E"
    return os.path.basename(output or source)


def compiles(args: list[str]) -> bool:
    """Whether ``args`` compiles sources (a cluster node may run it: to objects, or to a library in one go as
    nvcc can), rather than linking objects or preprocessing, which stay where the build runs."""
    if any(a in ("-E", "-M", "-MM") for a in args[1:]):
        return False
    return any(not a.startswith("-") and os.path.splitext(a)[1] in SOURCES for a in args[1:])


def oom_kills() -> int:
    """The kernel's count of processes its OOM killer stopped (``/proc/vmstat``; cgroup OOMs count too)."""
    try:
        with open("/proc/vmstat", "rb") as fh:
            for line in fh:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/PID/task/TID/children``)."""
    found = [pid]
    i = 0
    while i < len(found):
        task_dir = f"/proc/{found[i]}/task"
        try:
            tids = os.listdir(task_dir)
        except OSError:
            tids = []
        for tid in tids:
            try:
                with open(f"{task_dir}/{tid}/children", "rb") as fh:
                    found.extend(int(c) for c in fh.read().split())
            except (OSError, ValueError):
                continue
        i += 1
    return found


def sample(pid: int) -> tuple[float, dict[str, float]]:
    """The resident memory (MB) of ``pid``'s process tree, and of its largest process of each name."""
    total = 0.0
    by_name: dict[str, float] = {}
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/statm", "rb") as fh:
                rss = int(fh.read().split()[1]) * _PAGE_MB
            with open(f"/proc/{p}/comm", "rb") as fh:
                name = fh.read().decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        total += rss
        by_name[name] = max(by_name.get(name, 0.0), rss)
    return total, by_name


class Unit:
    """What one run of the compiler held: its peak, the process the peak came in, and what it held after; and,
    once :meth:`timed`, when its peak came (``peak_from_s``, ``peak_for_s``) and what it held before."""

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self.peak_in = ""
        self.after_mb = 0.0
        self.before_mb: float | None = None
        self.peak_from_s: float | None = None
        self.peak_for_s: float | None = None
        #: CPU-seconds (user and system) of the compiler and the descendants it waited for, from the kernel.
        self.cpu_s = 0.0
        self._samples: list[tuple[float, float]] = []  # (seconds into the unit, total MB)

    def add(self, total: float, by_name: dict[str, float], at: float = 0.0) -> None:
        """Take one sample of the process tree, ``at`` seconds into the unit: its total and its largest
        process of each name (MB)."""
        self._samples.append((at, total))
        if total > self.peak_mb:
            self.peak_mb = total
            self.peak_in = max(by_name, key=by_name.__getitem__) if by_name else ""
            self.after_mb = 0.0
        elif self.peak_in not in by_name:
            self.after_mb = max(self.after_mb, total)

    def timed(self, seconds: float) -> None:
        """Time the peak of a unit that ran ``seconds``, from its samples: the span from the sample before the
        first one at :data:`HIGH_SHARE` of its peak or more to the sample after the last one (so it covers
        the span between samples too), and the most it held before and after that span. ``after_mb`` is
        then what it held after the span. A peak no sample saw leaves it untimed."""
        samples = self._samples
        top = max((total for _, total in samples), default=0.0)
        if top <= 0 or self.peak_mb > top * MISSED_PEAK:
            return
        high = [k for k, (_, total) in enumerate(samples) if total >= HIGH_SHARE * top]
        first, last = high[0], high[-1]
        start = samples[first - 1][0] if first > 0 else 0.0
        end = samples[last + 1][0] if last + 1 < len(samples) else max(seconds, samples[last][0])
        self.before_mb = max((total for _, total in samples[:first]), default=0.0)
        self.after_mb = max((total for _, total in samples[last + 1 :]), default=0.0)
        self.peak_from_s = start
        self.peak_for_s = end - start

    def report(self) -> str:
        """``BEFORE FROM FOR`` of the ``d`` line the broker reads (``- - -`` untimed)."""
        if self.before_mb is None or self.peak_from_s is None or self.peak_for_s is None:
            return "- - -"
        return f"{self.before_mb:.0f} {self.peak_from_s:.1f} {self.peak_for_s:.1f}"


def _connect(sock_path: str, hello: str) -> tuple[socket.socket, str, bool]:
    """Wait for the broker to admit this compile; the connection, the broker's answer (its expectation) and
    whether the compile runs on the cluster (``@``) rather than here (``+``)."""
    conn = socket.socket(socket.AF_UNIX)
    conn.connect(sock_path)
    conn.sendall(hello.encode() + b"\n")
    answer = _line(conn)
    if not answer.startswith((b"+", b"@")):
        sys.exit("reprostack gate: the run's job broker refused the compile: " + answer.decode(errors="replace"))
    os.set_inheritable(conn.fileno(), True)
    return conn, answer[1:].decode(errors="replace").strip(), answer.startswith(b"@")


def _line(conn: socket.socket) -> bytes:
    """One line from the broker (read a byte at a time: what follows it is not the gate's to read yet)."""
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            sys.exit("reprostack gate: the run's job broker is gone")
        answer += chunk
    return answer


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(min(1 << 20, size - len(data)))
        if not chunk:
            sys.exit("reprostack gate: the run's job broker is gone")
        data += chunk
    return data


def _tell(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(line.encode() + b"\n")
    except OSError:
        pass


def run_once(conn: socket.socket, args: list[str], expect_peak_in: str) -> tuple[int, Unit, bool, float]:
    """Run the compiler once under the gate's watch: (exit status as a shell gives it, its memory,
    whether it was killed for memory, seconds)."""
    before = oom_kills()
    start = time.monotonic()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the compiler; it inherits the connection, so the token stays held while it lives
        try:
            import ctypes  # the gate killed takes its compiler with it (PR_SET_PDEATHSIG, SIGKILL)

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
            if os.getppid() != parent:  # the gate is gone already
                os._exit(137)
        except (ImportError, OSError, AttributeError):
            pass
        try:
            os.execvp(args[0], args)
        except OSError as exc:
            os.write(2, f"reprostack gate: cannot run {args[0]}: {exc}\n".encode())
        os._exit(127)
    told = [0.0, False]  # what the broker was last told: MB held, past the peak's process

    def report(total: float, past: bool) -> None:
        if abs(total - told[0]) >= REPORT_STEP_MB or past != told[1]:
            _tell(conn, f"m {total:.0f} {1 if past else 0}")
            told[:] = [total, past]

    code, unit = watch(pid, expect_peak_in, report)
    code, killed = _ended(code, before)
    return code, unit, killed, time.monotonic() - start


def watch(pid: int, expect_peak_in: str, report: Callable[[float, bool], None] | None = None) -> tuple[int, Unit]:
    """Wait for the child ``pid``, sampling its process tree's memory, more seldom as it runs; its exit code
    (``os.waitstatus_to_exitcode``'s) and its memory. ``report`` gets each sample's total (MB) and whether
    the process the unit's peak is expected in (``expect_peak_in``) has run and ended."""
    unit = Unit()
    seen = past = False
    interval = FIRST_INTERVAL
    start = time.monotonic()
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # Python without it, or an old kernel: sleep instead
        pidfd = -1
    while True:
        if pidfd >= 0:
            select.select([pidfd], [], [], interval)
        else:
            time.sleep(interval)
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:  # its largest process, from the kernel: a compile shorter than a sample is measured too
            unit.peak_mb = max(unit.peak_mb, usage.ru_maxrss / 1024)
            unit.cpu_s = usage.ru_utime + usage.ru_stime
            break
        total, by_name = sample(pid)
        unit.add(total, by_name, time.monotonic() - start)
        if expect_peak_in and not past:  # the process the broker expects the unit's peak in has run and ended
            seen = seen or expect_peak_in in by_name
            past = seen and expect_peak_in not in by_name
        if report is not None:
            report(total, past)
        interval = min(MAX_INTERVAL, interval * 2)
    if pidfd >= 0:
        os.close(pidfd)
    unit.timed(time.monotonic() - start)
    return os.waitstatus_to_exitcode(status), unit


def _ended(code: int, oom_kills_before: int) -> tuple[int, bool]:
    """A compile's exit code as a shell gives it, and whether it was killed for memory (SIGKILL, or the
    kernel's OOM counter rose while it ran)."""
    killed = code == -signal.SIGKILL or (code != 0 and oom_kills() > oom_kills_before)
    return (128 - code if code < 0 else code), killed


def run_remote(conn: socket.socket, args: list[str], expect_peak_in: str) -> tuple[int, Unit, bool, float]:
    """Run the compiler on the cluster node the broker chose (:func:`run_once`'s answer, from there).

    The broker answers ``r {json}`` and then the compiler's standard output and error, as many bytes as
    the JSON says; ``{"local": true}`` (no node of the cluster could take it any more) runs it here.
    """
    import json  # (here: a local compile's gate imports no more than it needs, once per compile)

    job = {"argv": args, "cwd": os.getcwd(), "env": dict(os.environ), "expect": expect_peak_in}
    conn.sendall(b"x " + json.dumps(job).encode() + b"\n")
    header = _line(conn)
    result = json.loads(header[2:])
    if result.get("local"):
        return run_once(conn, args, expect_peak_in)
    for fd, key in ((1, "out"), (2, "err")):
        data = _exactly(conn, int(result.get(key, 0)))
        while data:
            data = data[os.write(fd, data) :]
    unit = Unit()
    unit.peak_mb = float(result.get("peak_mb", 0.0))
    unit.peak_in = str(result.get("peak_in", ""))
    unit.after_mb = float(result.get("after_mb", 0.0))
    if result.get("peak_for_s") is not None:
        unit.before_mb = float(result.get("before_mb", 0.0))
        unit.peak_from_s = float(result.get("peak_from_s", 0.0))
        unit.peak_for_s = float(result["peak_for_s"])
    unit.cpu_s = float(result.get("cpu_s", 0.0))
    return int(result["code"]), unit, bool(result.get("killed")), float(result.get("seconds", 0.0))


#: Run by :func:`run_captured` in front of the compiler: it dies with the process that started it (a Ray
#: worker that is lost takes its compile with it; a copy run elsewhere then writes the unit's files alone).
_TRAMPOLINE = (
    "import ctypes, os, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, 9)\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() == int(sys.argv[1]):\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "os._exit(137)\n"
)


def run_captured(job: dict[str, object]) -> dict[str, object]:
    """Run one compile of :func:`run_remote`'s ``job`` (``argv``, ``cwd``, ``env``, ``expect``) here, on a
    cluster node: its exit status, memory figures, seconds and what it wrote (tasks/engine/cluster.py sends them
    back). Safe in a threaded process (a Ray worker): the compiler starts through ``subprocess``."""
    import subprocess
    import tempfile

    argv = [str(a) for a in job["argv"]]  # type: ignore[attr-defined]
    env = {str(k): str(v) for k, v in job["env"].items()}  # type: ignore[attr-defined]
    expect_peak_in = str(job.get("expect") or "")
    before = oom_kills()
    start = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            child = subprocess.Popen(
                [sys.executable, "-IS", "-c", _TRAMPOLINE, str(os.getpid()), *argv],
                cwd=str(job["cwd"]), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
            )  # fmt: skip
        except OSError as exc:
            message = f"reprostack gate: cannot run {argv[0]} in {job['cwd']}: {exc}\n".encode()
            return {"code": 127, "seconds": 0.0, "out_bytes": b"", "err_bytes": message}
        code, unit = watch(child.pid, expect_peak_in)
        child.returncode = code
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    code, killed = _ended(code, before)
    return {
        "code": code,
        "peak_mb": unit.peak_mb,
        "peak_in": unit.peak_in,
        "after_mb": unit.after_mb,
        "before_mb": unit.before_mb,
        "peak_from_s": unit.peak_from_s,
        "peak_for_s": unit.peak_for_s,
        "cpu_s": unit.cpu_s,
        "killed": killed,
        "seconds": time.monotonic() - start,
        "out_bytes": stdout,
        "err_bytes": stderr,
    }


def main(sock_path: str, args: list[str]) -> int:
    if not args:
        print("usage: gate COMMAND [ARGS...]", file=sys.stderr)
        return 2
    # Marks the compiler and what it starts as run by a gate (tasks/env/compilers.py's watch looks for it).
    os.environ[ENV_GATED] = "1"
    if os.environ.get(ENV_HELD):  # a compiler started by one holding a token runs on it
        os.execvp(args[0], args)
    unit = unit_name(args)
    if not unit:  # not a compile: a version query takes no token and no room
        os.execvp(args[0], args)
    prio = os.environ.get(ENV_PRIORITY, "0") or "0"
    package = os.environ.get(ENV_PACKAGE, "") or "-"
    here = "" if compiles(args) else " here"  # a link or a preprocessor run stays on this host
    conn, expect, remote = _connect(sock_path, f"{prio} {package} {unit}{here}")
    os.environ[ENV_HELD] = "1"
    code, mem, killed, seconds = (run_remote if remote else run_once)(conn, args, expect)
    if killed:
        need = max(2 * mem.peak_mb, 1024.0)
        print(
            f"reprostack gate: {unit} ({package}) was killed for memory at {mem.peak_mb / 1024:.1f} GB; "
            f"running it once more with room for {need / 1024:.1f} GB",
            file=sys.stderr,
            flush=True,
        )
        _tell(conn, f"k {mem.peak_mb:.0f}")
        conn.close()
        conn, expect, remote = _connect(sock_path, f"{prio} {package} {unit} {need:.0f}{here}")
        first = mem
        code, mem, killed, more = (run_remote if remote else run_once)(conn, args, expect)
        mem.peak_mb = max(mem.peak_mb, first.peak_mb)
        mem.cpu_s += first.cpu_s
        seconds += more
    _tell(
        conn,
        f"d {mem.peak_mb:.0f} {mem.peak_in or '-'} {mem.after_mb:.0f} {seconds:.1f} {code} {mem.report()} "
        f"{mem.cpu_s:.1f}",
    )
    return code
