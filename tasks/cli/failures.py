"""How a run presents its failures: one line per expected failure, the exit status it asks for.

The library raises (:class:`~tasks.core.errors.ReproError` and its subclasses, an ``OSError`` of the
environment); the command presents, as pypa/build's ``__main__`` does: :func:`guarded` wraps each task's
action, prints the failure once (parallel tasks hitting one cause say it in full once, then point to it),
fails the task without doit's own report, and keeps the first failure's status, which :func:`install`
applies when the process ends (docs/tasks.md, "Exit statuses"). A stop signal wins: 128 + its number.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import os
import re
import shutil
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from doit.exceptions import TaskFailed

from tasks.core.errors import ReproError, debug_enabled

if TYPE_CHECKING:
    from tasks.core.settings import Settings

#: Where the run's settings come from, for a full disk's message (set by the task graph: its Context's).
_settings: list[Callable[[], Settings]] = []


def settings_from(get: Callable[[], Settings]) -> None:
    """Name where the run's settings come from (the full-disk message names the fullest output)."""
    _settings[:] = [get]


#: The exit status the first expected failure asked for (see :func:`guarded`); applied when the process ends.
_exit_status: list[int] = []


def _exit_with_status() -> None:
    proc = sys.modules.get("tasks.core.proc")
    signum = proc.stop_signal() if proc is not None else None
    if signum is not None:  # interrupted: whatever failed, and also when the work still running finished
        _exit_status[:] = [128 + signum]
    if _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[0])


def install() -> None:
    """Apply the first expected failure's exit status when the process ends. Called by the run's
    preparation (tasks/cli/dodo.py ``prepare_run``) before any other exit handler of ours is registered,
    so that it runs last (it ends the process with ``os._exit``)."""
    if not _installed:
        _installed.append(True)
        atexit.register(_exit_with_status)


_installed: list[bool] = []


#: Expected failures already reported in this run: their text without the package's name -> the first one's.
_reported: dict[str, str] = {}
_reported_lock = threading.Lock()
_SUBJECT = re.compile(r"^(?:package|source) \S+: ")


def _once(message: str) -> str:
    """``message``, or a pointer to the same error reported by an earlier task of this run.

    Parallel tasks hit the same cause (no nvcc, no network, a torch the lock does not expect) at
    once; the first says it in full, the others in one line.
    """
    subject = _SUBJECT.match(message)
    core = message[subject.end() :] if subject else message
    with _reported_lock:
        first = _reported.setdefault(core, message)
    if first is message:
        return message
    before = _SUBJECT.match(first)
    if before:  # "source apex: the same error as source flash-attention, above"
        return f"{subject.group(0) if subject else ''}the same error as {before.group(0)[:-2]}, above"
    return f"{subject.group(0) if subject else ''}the same error as above ({first.splitlines()[0][:120]})"


def _guard(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from tasks.core import proc

        if proc.stop_signal() is not None:  # no new task after a stop signal (said once, by the handler)
            return TaskFailed("not started: the run was interrupted", report=False)
        try:
            try:
                fn(*args, **kwargs)
            except OSError as exc:  # the environment: a full disk, a path that is a file, no permission
                raise environment_error(exc) from exc
        except ReproError as exc:
            if debug_enabled():
                traceback.print_exc()
            message = f"{exc.__class__.__name__}: {_once(exc.message)}"
            # doit runs the task in a worker thread, where SystemExit would not
            # end the process: fail the task, apply the error's own status at exit
            # (the first failure's, when several tasks fail).
            print(message, file=sys.stderr, flush=True)
            # In an interrupted run, whatever failed failed for the interrupt: the signal's status (Interrupted).
            signum = proc.stop_signal()
            code = 128 + signum if signum is not None else exc.exit_code
            with _reported_lock:
                if not _exit_status:
                    _exit_status.append(code)
            # Said above, once: doit's own report of the failure would repeat it for every task.
            return TaskFailed(f"{exc.__class__.__name__} (exit status {code})", report=False)
        return None

    return wrapper


def environment_error(exc: OSError) -> ReproError:
    """One clear line for an operating-system error that reached a task (no traceback)."""
    where = f": {exc.filename}" if exc.filename else ""
    if not where and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        where = _fullest_output()  # a write on a full disk names no file
    reason = exc.strerror or str(exc)
    hint = {
        errno.ENOSPC: "free some space there (or point cache=/builddir=/wheels= at another disk) and rerun",
        errno.EDQUOT: "free some space there (or point cache=/builddir=/wheels= at another disk) and rerun",
        errno.ENOTDIR: "a path that should be a directory is a file: check cache=, builddir= and wheels=",
        errno.EEXIST: "a path that should be a directory is a file: check cache=, builddir= and wheels=",
        errno.EACCES: "that path is not writable for this user: choose another (cache=, builddir=, wheels=)",
        errno.EROFS: "that file system is read-only: choose another place (cache=, builddir=, wheels=)",
    }.get(exc.errno or 0, "check that path and rerun")
    # True of every output: the cache publishes whole entries, wheels/ and the lock are written through
    # temporary files, and wheels/ has no manifest until it is complete (docs/security.md).
    return ReproError(f"{reason}{where}; {hint}. Nothing partial was kept in the cache or wheels/.")


def _fullest_output() -> str:
    """Of this run's output directories, the one whose file system has the least room left."""
    try:
        settings = _settings[0]() if _settings else None
    except BaseException:
        return ""
    if settings is None:
        return ""
    room = []
    for setting, path in (("builddir", settings.builddir), ("cache", settings.cache), ("wheels", settings.wheels)):
        probe = path
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        with contextlib.suppress(OSError):
            room.append((shutil.disk_usage(probe).free, setting, path))
    if not room:
        return ""
    free, setting, path = min(room)
    return f" under {setting}={path} ({free // 1024} KiB free there)"


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Report an expected failure as one clear message (a traceback only with REPRO_DEBUG=1) and make
    doit exit with the error's own status (docs/tasks.md, "Exit statuses")."""
    return _guard(fn)
