"""One run at a time in a workspace, and what a killed run left behind cleaned up by the next.

A workspace is the build directory of the directory doit runs in (``builddir=``, default ``build``).
A run that can change it (every doit command but list, info, help, dumpdb, tabcompletion) takes
``<builddir>/workspace.lock`` when dodo.py is loaded, before doit opens its state database, and then
``.doit.db.lock`` beside that database (one per directory, whatever ``builddir=``), so a second run
refuses at once with one line naming the first, instead of failing later with sqlite's "database is
locked" or deleting the first run's staging trees.

While it runs, ``<builddir>/run/<pid>.json`` lists the sessions of the commands it started (each
build runs in a session of its own: tasks/core/proc.py) and the temporary trees it is writing. A run that
ended without cleaning up (SIGKILL, a crash, a closed terminal on an old version) leaves that file
behind; the next run that takes the lock stops what is left of those sessions (TERM, then KILL) and
removes those trees, and says so in one line. A run that ends at once (a second Ctrl-C,
tasks/core/proc.py) removes its listed trees itself first (:func:`abandon`) and leaves the file only for
what it could not remove or stop.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from tasks.core import procfs

#: doit's commands that only read: they neither take the workspace nor clean up.
READ_ONLY = frozenset({"list", "info", "help", "dumpdb", "tabcompletion"})
#: doit's own commands (anything else on the command line is a task of `doit run`).
DOIT_COMMANDS = READ_ONLY | frozenset({"run", "clean", "forget", "ignore", "reset-dep", "strace", "auto"})
#: doit's options that take their value as the next argument.
VALUE_OPTIONS = frozenset(
    {"-f", "--file", "-d", "--dir", "-n", "--process", "-P", "--parallel-type", "--db-file", "--dep-file",
     "--backend", "--check_file_uptodate", "-v", "--verbosity", "-r", "--reporter", "-o", "--output-file",
     "-s", "--seek-file", "--pdb", "-k"}
)  # fmt: skip


def command(argv: list[str]) -> str:
    """The doit command that ``argv`` (without the program) runs."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in VALUE_OPTIONS:
            skip = True
            continue
        if arg.startswith("-") or "=" in arg:
            continue
        return arg if arg in DOIT_COMMANDS else "run"
    return "run"


def _start_time(pid: int) -> str:
    """The kernel's start time of ``pid`` (clock ticks since boot), '' when it does not run."""
    found = procfs.process(pid)
    return found.start if found is not None else ""


def _session_members(sid: int) -> list[int]:
    return [p.pid for p in procfs.processes() if p.sid == sid]


class Registry:
    """This run's record of live sessions and temporary trees (``<builddir>/run/<pid>.json``)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"{os.getpid()}.json"
        self._lock = threading.Lock()
        self._doc: dict[str, Any] = {
            "pid": os.getpid(),
            "start": _start_time(os.getpid()),
            "argv": sys.argv,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "sessions": {},
            "paths": [],
        }

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self._doc, indent=1))
        os.replace(tmp, self.path)

    def session(self, pid: int, live: bool) -> None:
        with self._lock, contextlib.suppress(OSError):  # the record is a help for the next run, never fatal
            if live:
                self._doc["sessions"][str(pid)] = _start_time(pid)
            else:
                self._doc["sessions"].pop(str(pid), None)
            self._write()

    def tree(self, path: Path, live: bool) -> None:
        with self._lock, contextlib.suppress(OSError):
            paths: list[str] = self._doc["paths"]
            if live:
                paths.append(str(path.absolute()))
            elif str(path.absolute()) in paths:
                paths.remove(str(path.absolute()))
            self._write()

    def abandon(self, stopped: Collection[int], within: float) -> tuple[int, int]:
        """See :func:`abandon`."""
        from tasks.core.fsutil import rmtree

        # Kept until the process ends: no thread writes the record after this. Where the thread this runs
        # on top of holds it (a signal's handler), the record is this one's to write all the same.
        self._lock.acquire(timeout=1.0)
        paths = [Path(p) for p in self._doc["paths"]]

        def remove() -> None:
            for path in paths:
                with contextlib.suppress(OSError):
                    rmtree(path)

        remover = threading.Thread(target=remove, name="remove-trees", daemon=True)
        remover.start()
        remover.join(within)
        # Looked at last: a thread still copying a tree may have made part of it again.
        self._doc["paths"] = [str(p) for p in paths if os.path.lexists(p)]
        for pid in stopped:
            self._doc["sessions"].pop(str(pid), None)
        with contextlib.suppress(OSError):
            if self._doc["paths"] or self._doc["sessions"]:
                self._write()
            else:
                self.path.unlink()
        return len(paths) - len(self._doc["paths"]), len(self._doc["paths"])

    def close(self) -> None:
        """At exit: the record goes, unless it still lists trees or sessions (a stop signal ended the
        process under a thread that was writing one): the next run then removes them."""
        with self._lock, contextlib.suppress(OSError):
            if not self._doc["paths"] and not self._doc["sessions"]:
                self.path.unlink()


#: The registry of this process, once it holds its workspace (None for read-only commands).
current: Registry | None = None
_held: list[FileLock] = []


def session(pid: int, live: bool) -> None:
    if current is not None:
        current.session(pid, live)


def tree(path: Path, live: bool) -> None:
    if current is not None:
        current.tree(path, live)


def abandon(stopped: Collection[int], within: float) -> tuple[int, int]:
    """The end of a run that exits at once (tasks/core/proc.py): remove the temporary trees its record lists
    (the builds' stages, the cache's temporaries) for at most ``within`` seconds, forget the sessions
    ``stopped`` (killed, and gone), and drop the record, or keep in it what is left for the next run to stop
    and remove. How many trees were removed, and how many were left."""
    if current is None:
        return 0, 0
    return current.abandon(stopped, within)


def claim(builddir: Path, argv: list[str]) -> str:
    """Take the workspace for this run; return a line on what an earlier, killed run left, or ''.

    Raises ReproError (one line naming the run that holds it) when another run holds it.
    """
    global current
    from tasks.core.errors import ReproError

    if command(argv) in READ_ONLY or current is not None:
        return ""
    try:
        builddir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReproError(f"builddir={builddir}: cannot create the build directory ({exc.strerror})") from None
    lock = FileLock(str(builddir / "workspace.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ReproError(
            f"{builddir.absolute()} is in use by {_holder(builddir)}; wait for it to end, or stop it"
        ) from None
    except OSError as exc:
        raise ReproError(f"builddir={builddir}: cannot lock {builddir / 'workspace.lock'} ({exc.strerror})") from None
    # doit's database belongs to the directory, not to the build directory: two runs here with two
    # builddir= would still meet in it ("database is locked").
    database = dep_file(argv)
    shared = FileLock(f"{database}.lock")
    try:
        shared.acquire(timeout=0)
    except Timeout:
        lock.release()
        raise ReproError(
            f"{database.absolute()}, doit's database of this directory, is in use by another doit run (with another "
            "builddir=); wait for it to end, or run this one in another directory"
        ) from None
    except OSError as exc:
        lock.release()
        raise ReproError(f"cannot lock {database}.lock ({exc.strerror})") from None
    _held[:] = [lock, shared]
    note = cleanup(builddir / "run")
    current = Registry(builddir / "run")
    current._write()
    atexit.register(current.close)
    return note


def dep_file(argv: list[str]) -> Path:
    """doit's state database for ``argv``: ``--db-file``/``--dep-file`` where given, else dodo.py's ``.doit.db``."""
    for i, arg in enumerate(argv[:-1]):
        if arg in ("--db-file", "--dep-file"):
            return Path(argv[i + 1])
    for arg in argv:
        for option in ("--db-file=", "--dep-file="):
            if arg.startswith(option):
                return Path(arg.removeprefix(option))
    return Path(".doit.db")


def _holder(builddir: Path) -> str:
    """The run holding ``builddir``, as its record names it."""
    for record in sorted((builddir / "run").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(record.read_text())
            if _start_time(int(doc["pid"])) == doc["start"]:
                return f"another doit run (pid {doc['pid']}, `{shlex.join(doc['argv'])}`, since {doc['since']})"
    return "another doit run"


def cleanup(directory: Path) -> str:
    """Stop the sessions and remove the trees that runs which are gone left in ``directory``."""
    from tasks.core.fsutil import rmtree

    stopped = trees = 0
    runs = []
    for record in sorted(directory.glob("*.json")):
        try:
            doc = json.loads(record.read_text())
            pid = int(doc["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            record.unlink(missing_ok=True)
            continue
        if pid == os.getpid() or (_start_time(pid) and _start_time(pid) == doc.get("start")):
            continue  # alive (it would hold the lock: a record of ours, or a race with its exit)
        runs.append(str(pid))
        for sid_text, start in doc.get("sessions", {}).items():
            sid = int(sid_text)
            if _start_time(sid) not in ("", start):
                continue  # the pid is another process's now: not ours to stop
            stopped += _stop_session(sid)
        for path in doc.get("paths", []):
            if Path(path).exists():
                rmtree(Path(path))
                trees += 1
        record.unlink(missing_ok=True)
    if not runs or not (stopped or trees):
        return ""
    return (
        f"cleaned up after an earlier run that ended without cleaning up (pid {', '.join(runs)}): "
        f"stopped {stopped} process(es) it left running, removed {trees} temporary tree(s)"
    )


def _stop_session(sid: int) -> int:
    """TERM, then KILL, every process of session ``sid``; how many there were."""
    return procfs.stop(lambda: _session_members(sid), grace=5.0)
