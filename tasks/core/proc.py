"""The one way this project runs a subprocess.

Explicit environment, stdin from /dev/null, its own process group, merged
output appended to a log file, the command echoed at the top of the log. On
failure the error carries the log's first error lines (compiler errors,
ninja's FAILED) where its tail lacks them, its last lines and its path; on Ctrl-C
(or any exception) the whole process group is stopped, TERM then KILL.

Two entry points, each with keyword arguments for how a failure is told: :func:`run` (a logged command:
a build step that raises on failure, or with ``check=False`` a :class:`Completed` the caller judges) and
:func:`query` (a short command whose output the caller reads: exceptions as ``subprocess.run`` raises
them, ``error=`` to raise one of ours on any failure, ``tolerant=`` to raise none); and :func:`stream`
for a conversation over stdin and stdout (``git cat-file --batch``). Every one runs the command in its
own session, which the interrupt handler stops on Ctrl-C. Only the files that run elsewhere with the
standard library alone start processes themselves (tests/unit/test_one_way_out.py).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, overload

from tasks.core import procfs, workspace
from tasks.core.errors import Interrupted, ReproError

TAIL_LINES = 40
#: What :func:`query` raises when its command outlives its timeout (subprocess's own: its message names the
#: command and the seconds).
TimeoutExpired = subprocess.TimeoutExpired
#: The shape of :func:`query` returning bytes: what a caller that lets tests answer for git or docker takes.
Query = Callable[..., subprocess.CompletedProcess[bytes]]

#: Process groups started by run() and still running, for the interrupt handler.
_live: set[subprocess.Popen[Any]] = set()
#: Commands being started (forked, not yet in _live); both under _live_lock, which run() holds from its
#: interrupted-check to the command's registration, so the handler waits for a command another thread
#: is starting and then sees it. Reentrant: the handler may run in the thread that holds it.
_starting = 0
#: Commands that ended after the interrupt flag was set (under _live_lock): their threads see the interrupt
#: too. A thread that stopped its own command for the flag could end it before the handler looked.
_ended_interrupted = 0
_live_lock = threading.RLock()
_interrupted = threading.Event()
#: The first stop signal's number, once one came (the run's exit status is 128 + it).
_stop_signal: list[int] = []
#: In-process work the handler lets clean up, as it does a command (:func:`in_process`: a download, a
#: fetch's hash and unpack): token -> (its thread, what stops it at once, or None). Under _live_lock.
_work: dict[object, tuple[int, Callable[[], None] | None]] = {}
#: Seconds the first Ctrl-C leaves running builds to clean up before the process exits anyway.
FORCE_EXIT_AFTER = 60.0
#: The signals that stop a run (install_interrupt_handler).
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


#: The signal that wakes the main thread for the relay (its handler does nothing; ignored by default).
_POKE = signal.SIGURG
#: The relay's socket pair, kept open for the life of the process (install_interrupt_handler).
_relay: tuple[socket.socket, socket.socket] | None = None


def _relay_stop_signals() -> None:
    """Wake the main thread for a stop signal the kernel handed to another thread.

    The kernel delivers a process's signal to any thread that does not block it. Python's C-level
    handler only notes it there; the Python handler runs when the main thread next runs bytecode. A
    main thread blocked on a lock (doit's runner waiting for a task, a test's queue) slept through the
    Ctrl-C until a task ended: the Ctrl-C tests hung in about 1 run of 40 on a loaded host. Python
    writes each signal's number to its wakeup fd from whichever thread took it; a daemon thread reads
    them and pokes the main thread with a signal of its own, which breaks the wait (EINTR) and runs the
    pending handlers there. A poke after the main thread handled the signal itself runs a no-op.
    """
    global _relay
    if _relay is not None:
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if previous != -1:  # someone else's wakeup fd (an event loop, say): theirs to serve
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return
    _relay = (reader, writer)
    signal.signal(_POKE, lambda signum, frame: None)
    main = threading.main_thread().ident
    assert main is not None
    stops = {int(sig) for sig in STOP_SIGNALS}

    def relay() -> None:
        while True:
            if stops.intersection(reader.recv(256)):
                with contextlib.suppress(OSError):  # the main thread is gone: the process is ending
                    signal.pthread_kill(main, _POKE)

    threading.Thread(target=relay, name="signal-relay", daemon=True).start()


def install_interrupt_handler() -> None:
    """Make Ctrl-C (and TERM, HUP) stop every running command's process group, from any thread.

    Builds run in doit's worker threads, where Python never delivers KeyboardInterrupt; this handler
    (installed from the main thread, before doit's runner starts) sends TERM to their process groups at
    once and leaves a thread to KILL what is still there 2 s later. The threads that ran them fail their
    tasks the normal way (log marked, temporary files removed) and doit ends on that failure; no new
    command starts. A second signal, FORCE_EXIT_AFTER seconds later, or a first one that finds nothing to
    wait for ends the process at once (:func:`_exit_now`). No signal raises KeyboardInterrupt or SystemExit
    into the thread it lands in: in doit's runner that was a traceback, with its threads cut off in the
    middle of their clean-up.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    _relay_stop_signals()
    # SIGHUP (a closed terminal, a dropped ssh session) is a stop like SIGTERM: builds are not left running.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if not getattr(signal.getsignal(sig), "_repro_handler", False):
            signal.signal(sig, _handler)


#: Stop signals not yet handled, in order, and whether the handler is handling one: Python runs a handler
#: again, nested, when a signal comes while it runs (a second Ctrl-C 0.1 s after the first); the nested call
#: leaves it to the outer one, which takes the signals in turn.
_queued: list[int] = []
_handling: list[bool] = []
#: Whether the first signal's ``interrupted:`` line was written (the run writes one).
_said: list[bool] = []
#: Held by whoever ends the process at once (a signal, or the timer), until it ends.
_exiting = threading.Lock()
#: Seconds the at-once ending waits for the killed commands to be gone, and then for the temporary trees
#: to be removed; what is not removed by then stays in the run record, and the next run removes it.
KILL_WAIT = 2.0
REMOVE_WITHIN = 3.0


def _handler(signum: int, frame: object) -> None:
    _queued.append(signum)
    if _handling:
        return  # nested in the handling of an earlier signal, which takes this one next
    _handling.append(True)
    try:
        while _queued:
            _stop(_queued.pop(0))
    finally:
        _handling.clear()


_handler._repro_handler = True  # type: ignore[attr-defined]


def _say(text: str) -> None:
    """``text`` on standard error in one write to its descriptor: the handler may run on top of a thread
    holding the console's lock (tasks/core/console.py), and after SIGHUP the terminal may be gone."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode())


def _stop(signum: int) -> None:
    """One stop signal: the first stops what runs and lets it clean up; the next ends the process at once."""
    if _interrupted.is_set():
        _exit_now("second signal")
        return  # the timer is ending it
    _stop_signal.append(signum)
    _interrupted.set()
    with _live_lock:
        running = list(_live)
        starting = _starting  # in this (the main) thread: it stops its command itself once started
        ended = _ended_interrupted
        work = list(_work.values())
    for p in running:
        if not _ended(p):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
    for _thread_id, stop in work:
        if stop is not None:
            with contextlib.suppress(OSError):
                stop()
    if not (running or starting or ended or work):
        _exit_now("")  # nothing to let clean up
        return
    if running:  # KILL what TERM left, without holding up the thread the handler runs in
        threading.Thread(target=_stop_groups, args=(running,), name="stop-commands", daemon=True).start()
    # Let the threads that ran them see their commands fail: they mark their logs and remove their
    # temporary files, and doit stops for the failure. A second signal, or the timer, exits at once.
    commands = len(running) + starting + ended
    downloads = len({thread_id for thread_id, _stop in work})  # a fetch and its download: one
    stopped = " and ".join(
        [f"{commands} running command(s)"] * bool(commands or not downloads)
        + [f"{downloads} download(s)"] * bool(downloads)
    )
    _say(
        f"\ninterrupted: stopped {stopped}, cleaning up"
        f" (signal again to exit now; forced in {FORCE_EXIT_AFTER:.0f} s)\n"
    )
    _said.append(True)
    timer = threading.Timer(FORCE_EXIT_AFTER, _exit_now, args=(f"no exit {FORCE_EXIT_AFTER:.0f} s after the signal",))
    timer.daemon = True
    timer.start()


def _stop_groups(running: list[subprocess.Popen[Any]]) -> None:
    for p in running:
        stop_group(p, grace=2.0, reap=False)


def _exit_now(why: str) -> None:
    """End the process at once, with the first signal's status (130 for Ctrl-C): KILL every command's
    session, remove the temporary trees the run record lists (build/stage's, the cache's; tasks/core/workspace.py
    ``abandon``), one line, ``os._exit``. The threads still cleaning up are cut off where they are: what
    they had not removed is removed here, or, past REMOVE_WITHIN seconds, by the next run. Returns only when
    the other caller (the timer, a signal) is ending the process already."""
    if not _exiting.acquire(blocking=False):
        return
    status = 128 + (stop_signal() or signal.SIGINT)
    # Kept until the process ends: no command starts after this (each starts under it). A thread starting
    # one holds it for the fork; the thread this runs on top of may hold it (reentrant).
    _live_lock.acquire(timeout=2.0)
    sessions = {p.pid for p in list(_live)}
    gone = _kill_sessions(sessions)
    removed, left = workspace.abandon(stopped=gone, within=REMOVE_WITHIN)
    done = [f"killed {len(sessions)} command(s)"] if sessions else []
    if removed:
        done.append(f"removed {removed} temporary tree(s)")
    if left:
        done.append(f"left {left} temporary tree(s) for the next run to remove")
    text = f"exiting now ({why})" if _said else "\ninterrupted: exiting now"
    for stream in (sys.__stdout__, sys.__stderr__):  # what was written before this, first
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    _say(f"{text}{': ' if done else ''}{', '.join(done)}\n")
    os._exit(status)


def _kill_sessions(sessions: set[int]) -> set[int]:
    """KILL every process of the commands' sessions (each runs in its own); those found gone within KILL_WAIT."""
    deadline = time.monotonic() + KILL_WAIT
    while True:
        alive = [p for p in procfs.processes() if p.sid in sessions and p.state != "Z"]
        for p in alive:  # again on each look: a process its parent forked since
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signal.SIGKILL)
        if not alive or time.monotonic() >= deadline:
            return sessions - {p.sid for p in alive}
        time.sleep(0.02)


def stop_signal() -> int | None:
    """The signal that interrupted this run (SIGINT, SIGTERM, SIGHUP), or None while none did."""
    return _stop_signal[0] if _stop_signal else (signal.SIGINT if _interrupted.is_set() else None)


def check_interrupted(what: str) -> None:
    """Raise :class:`Interrupted` for ``what`` once the run was interrupted (a checkpoint of in-process work)."""
    signum = stop_signal()
    if signum is not None:
        raise Interrupted(f"{what} interrupted; nothing partial was kept", signum=signum)


@contextlib.contextmanager
def in_process(what: str, stop: Callable[[], None] | None = None) -> Iterator[None]:
    """Register in-process work (a download, a fetch's hash and unpack) with the interrupt handler.

    A command runs in a process group the handler stops; a download runs in this process, in one of
    doit's threads, where Python never raises KeyboardInterrupt. While registered, the first stop
    signal calls ``stop`` (a download shuts its socket, so a blocked read returns at once) and leaves
    the work's thread to reach its next :func:`check_interrupted`, which raises :class:`Interrupted`;
    its ``finally`` blocks remove its temporary files, as a command's thread does. Unregistered, the
    signal ended the process under it (SIGTERM: exit 143, no message, its temporary tree left behind)
    or raised KeyboardInterrupt with a traceback. Refused (Interrupted) once the run was interrupted.
    """
    global _ended_interrupted
    token = object()
    with _live_lock:
        check_interrupted(what)
        _work[token] = (threading.get_ident(), stop)
    try:
        yield
    finally:
        with _live_lock:
            del _work[token]
            if _interrupted.is_set():
                _ended_interrupted += 1


@dataclass(frozen=True)
class Usage:
    """Resources a finished command and its waited-for descendants used."""

    cpu_seconds: float
    max_rss_mb: float


#: Lines that say what went wrong in a compiler, ninja, cmake or linker log (pip's own summary says only that).
_ERROR_LINE = re.compile(
    r"^\s*FAILED: |: (fatal )?error[: ]|^\s*CMake Error|internal compiler error|Killed signal terminated"
    r"|undefined reference to|^\s*error: |No space left on device|Cannot allocate memory"
)
ERROR_LINES = 12
ERROR_LINE_CHARS = 400


def error_lines(path: Path, limit: int = ERROR_LINES) -> list[str]:
    """The first lines of a log that look like the cause of a failure (compiler errors, ninja's FAILED)."""
    found: list[str] = []
    try:
        with path.open("rb") as fh:
            for raw in fh:
                line = raw.decode("utf-8", "replace").rstrip()
                if _ERROR_LINE.search(line):
                    found.append(line if len(line) <= ERROR_LINE_CHARS else line[:ERROR_LINE_CHARS] + " …")
                    if len(found) >= limit:
                        break
    except FileNotFoundError:
        pass
    return found


def failure_report(log: Path) -> str:
    """What a failed command's error shows: the log's error lines (where the tail lacks them) and its tail."""
    last = tail(log)
    errors = [line for line in error_lines(log) if line not in last]
    head = f"--- first error lines of {log} ---\n" + "\n".join(errors) + "\n" if errors else ""
    return f"{head}--- last lines of {log} ---\n{last}\n--- full log: {log}"


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


def _ended(proc: subprocess.Popen[Any]) -> bool:
    """Whether the command's leader has ended, without reaping it: the thread in :func:`run` waits for it."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def stop_group(proc: subprocess.Popen[Any], grace: float = 5.0, *, reap: bool = True) -> None:
    """TERM, then KILL after ``grace`` seconds, the command's process group.

    With ``reap=False`` (the interrupt handler, a timeout's timer) the leader is left for the thread that
    waits for it: reaping it here made that thread's ``wait4`` fail with ECHILD, and its task end with a
    traceback instead of "interrupted".
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if _ended(proc):
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not _ended(proc):
            time.sleep(0.05)
    if reap:
        proc.wait()


@overload
def run(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    log: Path,
    cwd: Path | None = None,
    error: type[ReproError] = ReproError,
    what: str = "",
    on_line: Callable[[str], None] | None = None,
    stdout: Path | None = None,
    on_start: Callable[[int], None] | None = None,
    timeout: float | None = None,
    check: Literal[True] = True,
) -> Usage: ...
@overload
def run(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    log: Path,
    cwd: Path | None = None,
    timeout: float | None = None,
    check: Literal[False],
) -> Completed: ...
def run(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    log: Path,
    cwd: Path | None = None,
    error: type[ReproError] = ReproError,
    what: str = "",
    on_line: Callable[[str], None] | None = None,
    stdout: Path | None = None,
    on_start: Callable[[int], None] | None = None,
    timeout: float | None = None,
    check: bool = True,
) -> Usage | Completed:
    """Run ``cmd`` to completion: stdin from /dev/null, its own process group, its output appended to ``log``
    after the echoed command; on a timeout or Ctrl-C the whole process group is stopped (TERM, then KILL).

    With ``check`` (the default) it raises ``error`` naming ``what`` with the tail of the log when the
    command fails or cannot be started, and returns its resource usage. With ``stdout``, the command's
    standard output is data (a tar, say): it is written to that file instead, and only its standard error
    goes to the log. With ``check=False`` it raises nothing and returns a :class:`Completed`: the exit
    status and this command's part of the log (a command that cannot start is status 127, its reason in
    the log).
    """
    if not check:
        return _run_unchecked(cmd, log=log, env=env, cwd=cwd, timeout=timeout)
    global _starting, _ended_interrupted
    if stdout is not None and on_line is not None:
        raise ValueError("run(): stdout= and on_line= exclude each other")
    label = what or shlex.join(cmd)
    if _interrupted.is_set():
        raise error(f"{label}: not started, the run was interrupted")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out, stdout.open("wb") if stdout else contextlib.nullcontext() as data:
        out.write(f"$ {shlex.join(cmd)}{f' > {stdout}' if stdout else ''}\n".encode())
        if cwd is not None:
            out.write(f"# in {cwd}\n".encode())
        out.flush()
        # Checked, started and registered as one step for the interrupt handler: a Ctrl-C between the
        # fork and the registration found nothing running, raised KeyboardInterrupt and left the command
        # running in its own session.
        with _live_lock:
            if _interrupted.is_set():  # since the check above
                raise error(f"{label}: not started, the run was interrupted")
            _starting += 1
            try:
                proc = subprocess.Popen(
                    list(cmd),
                    env=dict(env),
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=data if data is not None else subprocess.PIPE if on_line else out,
                    stderr=out if data is not None else subprocess.STDOUT,
                    start_new_session=True,
                )
                _live.add(proc)
            except OSError as exc:
                raise error(f"{label}: cannot start {cmd[0]!r}: {exc.strerror}") from None
            finally:
                _starting -= 1
        expired = threading.Event()
        timer = None
        try:
            workspace.session(proc.pid, live=True)  # for the next run, should this one be killed
            if on_start is not None:
                on_start(proc.pid)  # the leader of the command's own session
            if timeout is not None:

                def expire(p: subprocess.Popen[bytes] = proc) -> None:
                    expired.set()
                    stop_group(p, grace=2.0, reap=False)

                timer = threading.Timer(timeout, expire)
                timer.daemon = True
                timer.start()
            if _interrupted.is_set():  # the handler ran in this thread while it started the command
                stop_group(proc, grace=2.0, reap=False)
            if on_line is not None:
                assert proc.stdout is not None
                for raw in proc.stdout:
                    out.write(raw)
                    out.flush()
                    on_line(raw.decode("utf-8", "replace"))
            _pid, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = code = os.waitstatus_to_exitcode(status)
        except BaseException:
            stop_group(proc)
            with log.open("ab") as again:
                again.write(b"\n# interrupted: process group stopped\n")
            raise
        finally:
            if timer is not None:
                timer.cancel()
            with _live_lock:
                _live.discard(proc)
                if _interrupted.is_set():
                    _ended_interrupted += 1
            workspace.session(proc.pid, live=False)
    if expired.is_set():
        with log.open("ab") as again:
            again.write(f"\n# timed out after {timeout:g} s: process group stopped\n".encode())
        raise error(f"{label} timed out after {timeout:g} s; its process group was stopped. Full log: {log}")
    if code != 0 and _interrupted.is_set():
        with log.open("ab") as again:
            again.write(b"\n# interrupted: process group stopped\n")
        raise error(f"{label} interrupted; process group stopped. Full log: {log}")
    if code != 0:
        reason = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        if code == -signal.SIGKILL:
            reason += " (possibly out of memory: check `dmesg` and lower jobs=)"
        raise error(f"{label} failed ({reason}).\n{failure_report(log)}")
    # ru_maxrss: the largest resident set of the process or any descendant it waited for (KiB).
    return Usage(cpu_seconds=usage.ru_utime + usage.ru_stime, max_rss_mb=usage.ru_maxrss / 1024)


@contextlib.contextmanager
def _started(cmd: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """``cmd`` started in its own session and known to the interrupt handler until the caller is done with
    it (the caller waits for it); an exception on the way out (Ctrl-C, a timeout) stops its process group.
    Raises OSError when it cannot start; :class:`Interrupted` when a stop signal came while it ran and it
    failed (the handler stopped it), as :func:`run` reports it."""
    global _starting, _ended_interrupted
    with _live_lock:
        before = _interrupted.is_set()  # a command started after the interrupt (cleaning up) is left to run
        _starting += 1
        try:
            process = subprocess.Popen(list(cmd), start_new_session=True, **popen)
            _live.add(process)
        finally:
            _starting -= 1
    try:
        if _interrupted.is_set() and not before:  # the handler ran in this thread while it started the command
            stop_group(process, grace=2.0, reap=False)
        yield process
    except BaseException:
        stop_group(process)
        raise
    finally:
        with _live_lock:
            _live.discard(process)
            if _interrupted.is_set():
                _ended_interrupted += 1
    signum = stop_signal()
    if signum is not None and not before and process.returncode != 0:
        raise Interrupted(f"{shlex.join(cmd)} interrupted; process group stopped", signum=signum)


@overload
def query(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
    text: Literal[False] = False,
    input: bytes | None = None,
    error: type[ReproError] | None = None,
    what: str = "",
    tolerant: bool = False,
) -> subprocess.CompletedProcess[bytes]: ...
@overload
def query(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
    text: Literal[True],
    input: bytes | None = None,
    error: type[ReproError] | None = None,
    what: str = "",
    tolerant: bool = False,
) -> subprocess.CompletedProcess[str]: ...
def query(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
    text: bool = False,
    input: bytes | None = None,
    error: type[ReproError] | None = None,
    what: str = "",
    tolerant: bool = False,
) -> subprocess.CompletedProcess[Any]:
    """Run a short command whose output the caller needs: stdin from /dev/null (or ``input``), stdout and
    stderr captured apart (decoded with ``text``), the environment ``env`` (None: this process's), its own
    process group, known to the interrupt handler.

    How it fails is the caller's choice:

    - by default it raises OSError when it cannot start and :data:`TimeoutExpired` after ``timeout``
      seconds (its process group stopped), as ``subprocess.run`` does, and returns any exit status;
    - with ``error``, every failure (cannot start, timeout, a non-zero exit status) raises ``error`` naming
      ``what`` (else the command) with the command's standard error;
    - with ``tolerant``, nothing raises: a command that cannot start is status 127, one that timed out -9.

    :class:`Interrupted` when a stop signal stopped it, in every case.
    """
    label = what or shlex.join(cmd)
    try:
        with _started(
            cmd,
            env=None if env is None else dict(env),
            cwd=cwd,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=text,
        ) as process:
            try:
                out, err = process.communicate(input=input, timeout=timeout)
            finally:
                for pipe in (process.stdin, process.stdout, process.stderr):
                    if pipe is not None:
                        pipe.close()
    except OSError as exc:
        if error is not None:
            raise error(f"{what or cmd[0]}: cannot start {cmd[0]!r}: {exc.strerror}") from None
        if tolerant:
            empty: Any = "" if text else b""
            return subprocess.CompletedProcess(list(cmd), 127, empty, str(exc) if text else str(exc).encode())
        raise
    except TimeoutExpired:
        if error is not None:
            raise error(f"{label}: no answer within {timeout:g} s (REPRO_NET_TIMEOUT for network)") from None
        if tolerant:
            empty = "" if text else b""
            return subprocess.CompletedProcess(list(cmd), -signal.SIGKILL, empty, empty)
        raise
    done = subprocess.CompletedProcess(list(cmd), process.returncode, out, err)
    if error is not None and done.returncode != 0:
        msg = err.strip() if text else err.decode("utf-8", "replace").strip()
        raise error(f"{label} failed (exit status {done.returncode}): {msg}")
    return done


@contextlib.contextmanager
def stream(cmd: Sequence[str], *, env: Mapping[str, str] | None = None) -> Iterator[tuple[IO[bytes], IO[bytes]]]:
    """A conversation with ``cmd`` (``git cat-file --batch``): its stdin and stdout, its stderr this process's.

    On the way out its stdin is closed and the command waited for; on an exception its process group is
    stopped. Raises OSError when it cannot start.
    """
    with _started(cmd, env=None if env is None else dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE) as p:
        assert p.stdin is not None and p.stdout is not None
        try:
            yield p.stdin, p.stdout
            p.stdin.close()
            p.wait()
        finally:
            p.stdin.close()
            p.stdout.close()


def signal_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


@dataclass(frozen=True, kw_only=True)
class Completed:
    """A command ``run(..., check=False)`` ran: its exit status and its part of the log."""

    argv: tuple[str, ...]
    returncode: int
    output: str
    log: Path
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def tail(self, lines: int = 12) -> str:
        return "\n".join(self.output.rstrip().splitlines()[-lines:])

    def failure(self, what: str) -> str:
        why = "timed out" if self.timed_out else signal_text(self.returncode)
        return f"{what} failed ({why}); log: {self.log}\n{self.tail()}"


def _run_unchecked(
    argv: Sequence[str], *, log: Path, env: Mapping[str, str], cwd: Path | None = None, timeout: float | None = None
) -> Completed:
    """:func:`run` with ``check=False``: the exit status and this command's part of the log, never raised."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as fh:
        fh.write(f"$ {shlex.join(argv)}\n".encode())
        if cwd is not None:
            fh.write(f"# cwd: {cwd}\n".encode())
        fh.flush()
        start = fh.tell()
        timed_out = False
        with contextlib.ExitStack() as stack:
            try:
                process = stack.enter_context(
                    _started(
                        argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, env=dict(env), cwd=cwd
                    )
                )
            except OSError as exc:
                fh.write(f"cannot run {argv[0]}: {exc}\n".encode())
                return Completed(argv=tuple(argv), returncode=127, output=str(exc), log=log)
            try:
                returncode = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_group(process)
                returncode = process.returncode if process.returncode is not None else -signal.SIGKILL
                timed_out = True
                fh.write(f"\n# timed out after {timeout} s: process group stopped\n".encode())
        fh.flush()
    with log.open("rb") as fh:
        fh.seek(start)
        output = fh.read().decode("utf-8", errors="replace")
    return Completed(argv=tuple(argv), returncode=returncode, output=output, log=log, timed_out=timed_out)
