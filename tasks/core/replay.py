"""The no-op replayed: `doit wheels` with nothing to do answers from a record, without loading doit.

The no-op is the command users run most (docs/building.md, "The no-op"), and most of its time is start-up:
Python, doit, the task graph, the lock. This module lets the commands of tasks/cli/main.py answer it from
``.doit.db.noop`` (beside doit's database) when nothing it depends on has changed since a run that found
everything up to date, and only then.

What a run depends on is what it read, so a run that may become the record traces its reads while it runs
(:func:`start`): the files it opens (Python's ``open`` audit events), the directories it lists, the paths it
``os.stat``\\ s or ``os.lstat``\\ s (the up-to-date checks' existence and size checks, ``shutil.which``'s search of
``PATH``), doit's sqlite database, and at the end the source file of every module it imported. The record keeps
each file's ``stat`` (mode, inode, device, size, mtime and ctime in nanoseconds: a change of content changes the
ctime, which nothing can set back), each directory's mode and names, the command line, the working directory, the
interpreter and its path, the user, which streams are terminals and a digest of the whole environment, and what the
run printed on stdout and stderr, in order. A later run with the same command line replays that output and exits 0
when every one of those reads the same; otherwise it runs as before (and traces, to write a new record).

What is not a file's stat is handled as what it is: a directory is kept as its names (another process's
temporary file that came and went beside it moves its mtime, not what the run saw), without the run's own
files where the run itself wrote into it (its claim in ``build/run``), so that another run's claim there sends
the next run the slow way; ``/proc/sys`` and ``/sys`` files by content; a namespace
(``/proc/self/ns/*``) by its inode; the rest of ``/proc`` (this process's own state, uptime) is not an input.
What the tracing cannot see is no input: a file C code reads other than through ``open`` (sqlite's journal
beside doit's database), and the entries of a directory listed with ``os.scandir`` whose ``DirEntry`` stats
are read (the listing itself is an input; the no-op's one scan, of ``build/run``, reads the entries it
finds with ``open``). A check that comes to read either has to read it another way too. Files the run wrote
are not inputs; the lock files among them (the workspace's, doit's database's) must be free of other
processes' locks for a replay. A run is never recorded when it started a process, ran a task's action,
failed, or printed more than :data:`MAX_OUTPUT` characters.

A record answers only once a second run has confirmed it: the same reads, the same output, and no file among
them modified in the :data:`RACY_SECONDS` before (a change within a file system's timestamp granularity could
otherwise hide). A run that says a line once (a skipped optional package) prints differently the next time;
that next run's record is the one replayed.

A record is used only where it holds up (:func:`_holds`): each field of its type, each path absolute and of
its kind, and the lock and wheelhouse manifest it was made from among its inputs; it is read only as a
regular file, and so is every file it names by content (a fifo or a device is no file). Anything else is no
record: the run takes the long way.

Only the command lines of :func:`eligible` are recorded (``wheels`` or no task, with variables, no options):
an option can move the workspace (``-d``), the database (``--db-file``) or the output. ``REPRO_NOOP_REPLAY=off``
turns it off (the environment is part of the record's key, so it also ends any replay in force).
"""

from __future__ import annotations

import json
import os
import stat
import sys

TYPE_CHECKING = False  # typing and what it imports: 9 ms of a replay on Debian's Python 3.11; mypy reads this
if TYPE_CHECKING:
    from typing import Any

#: The record, beside doit's database (tasks/cli/dodo.py's ``dep_file``) in the directory the command runs in.
RECORD = ".doit.db.noop"
#: The record's format; a record of another is no record.
FORMAT = 2
#: A record larger than this is no record (one of the stack's no-ops is about 100 KB).
MAX_RECORD = 16 << 20
#: Variables that change from one command to the next in the same shell without meaning anything to a run.
VOLATILE_ENV = frozenset({"_", "OLDPWD"})
#: A run that printed more than this is not a no-op worth keeping.
MAX_OUTPUT = 65536
#: A file modified this recently when a record is confirmed leaves it unconfirmed (see the module's docstring).
RACY_SECONDS = 2.0
#: Audit events that start another process: a run that did is not recorded (its output is not all ours).
SPAWN_EVENTS = frozenset({"subprocess.Popen", "os.posix_spawn", "os.exec", "os.fork", "os.forkpty", "os.spawn",
                          "os.system", "os.startfile"})  # fmt: skip
#: Audit events that write at the path of their first argument: a name comes or goes in its directory.
NAME_EVENTS = frozenset({"os.remove", "os.rmdir", "shutil.rmtree"})
#: ... at both their paths, source and destination.
TWO_NAME_EVENTS = frozenset({"os.rename", "os.link", "os.symlink", "shutil.copyfile", "shutil.move"})
#: ... at their path's content or metadata, adding no name (``os.mkdir`` adds one only where there was none).
CONTENT_EVENTS = frozenset({"os.mkdir", "os.truncate", "os.chmod", "os.chown", "os.utime"})
#: ``os.open`` flags that write.
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
#: The functions :func:`start` puts tracing wrappers in front of, and :func:`spoil` puts back.
_os_stat, _os_lstat = os.stat, os.lstat


def eligible(argv: list[str]) -> bool:
    """Whether this command line's run may be recorded and replayed: ``wheels``, ``run wheels``, or no task at
    all (the graph's default task is ``wheels``: README's ``.venv/bin/doit``), with ``name=value`` variables and
    nothing else. A run of another default task is never recorded (tasks/cli/graph.py's Reporter)."""
    words = [a for a in argv[1:] if "=" not in a or a.startswith("-")]
    return words in ([], ["run"], ["wheels"], ["run", "wheels"]) and os.environ.get("REPRO_NOOP_REPLAY", "") != "off"


def _key(argv: list[str]) -> dict[str, Any]:
    import hashlib

    env = sorted((k, v) for k, v in os.environ.items() if k not in VOLATILE_ENV)
    return {
        "format": FORMAT,
        "argv": [os.path.basename(argv[0]), *argv[1:]],
        "cwd": os.getcwd(),
        "python": [sys.executable, sys.version, list(sys.path)],
        "uid": os.getuid(),
        "tty": [os.isatty(0), os.isatty(1), os.isatty(2)],
        "env": hashlib.sha256(json.dumps(env).encode()).hexdigest(),
    }


def _stat(path: str, follow: bool = True) -> list[int] | None:
    try:
        st = _os_stat(path, follow_symlinks=follow)
    except (OSError, ValueError):
        return None
    if not follow and stat.S_ISDIR(st.st_mode):  # a step of a path's resolution (``realpath``): which directory,
        return [st.st_mode, st.st_ino, st.st_dev]  # not what it holds (its mtime moves with every file in /tmp)
    return [st.st_mode, st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _regular(path: str, limit: int) -> bytes | None:
    """The bytes of the regular file ``path`` (at most ``limit``), or None: opened without blocking and without
    following a last link, so a fifo, a device or a link put in a file's place is read as no file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with open(fd, "rb", closefd=False) as f:
            return f.read(limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _content(path: str) -> str | None:
    data = _regular(path, 65536)
    return None if data is None else data.decode("utf-8", errors="replace")


def _names(path: str, own: set[str]) -> list[Any] | None:
    """A directory as its mode and its names (without the files in ``own``): what a run that listed it, or
    looked at it to know whether it changed (importlib's caches of ``sys.path`` keyed by its mtime), saw.
    Its mtime moves with any name that comes and goes, such as another process's temporary file in a
    checkout on ``sys.path``; the names are what the run's answer depends on."""
    try:
        st = _os_stat(path)
        if not stat.S_ISDIR(st.st_mode):
            return None
        return [st.st_mode, sorted(n for n in os.listdir(path) if os.path.join(path, n) not in own)]
    except (OSError, ValueError):
        return None


def _read(kind: str, path: str, own: set[str]) -> Any:
    """What path reads as now, as an input of ``kind``: s (stat), l (lstat), c (content), n (namespace), d
    (a directory: its mode and names, without the files in ``own``)."""
    if kind == "s":
        return _stat(path)
    if kind == "l":
        return _stat(path, follow=False)
    if kind == "c":
        return _content(path)
    if kind == "n":
        st = _stat(path)
        return None if st is None else st[1:3]
    return _names(path, own)


def _kind(path: str, follow: bool) -> str | None:
    """How a path the run read is kept (:func:`_read`), or None when it is no input."""
    if path.startswith(("/proc/sys/", "/sys/")):
        return "c"
    if path.startswith("/proc/self/ns/"):
        return "n"
    if path == "/proc" or path.startswith("/proc/"):
        return None  # this process's own state, the uptime: what a run reads to describe itself
    return "s" if follow else "l"


# --------------------------------------------------------------------------- replaying


def replay(argv: list[str]) -> bool:
    """Print the record's output and return True when it answers this command line; else start tracing
    this run where it may become the record (:func:`start`) and return False."""
    if not eligible(argv):
        return False
    record = _load()
    key = _key(argv)
    if record is not None and record["key"] == key and _unchanged(record):
        if record.get("confirmed") is True:
            for stream, text in record["output"]:
                out = sys.stdout if stream == 1 else sys.stderr
                out.write(text)
                out.flush()
            return True
        start(key, record)  # the second run: the same again confirms it
    else:
        start(key, None)
    return False


def _load() -> dict[str, Any] | None:
    """The record in this directory, or None where there is none that holds up (:func:`_holds`)."""
    data = _regular(RECORD, MAX_RECORD + 1)
    if data is None or len(data) > MAX_RECORD:
        return None
    try:
        record = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return record if _holds(record) else None


def _is_path(p: Any) -> bool:
    return isinstance(p, str) and p.startswith("/") and "\0" not in p and os.path.normpath(p) == p


def _ints(v: Any, *sizes: int) -> bool:
    return isinstance(v, list) and len(v) in sizes and all(type(x) is int for x in v)


#: What each kind of input may be kept as (None: the path was not there), and under which paths (:func:`_kind`).
_VALUES = {
    "s": lambda v: _ints(v, 3, 6),
    "l": lambda v: _ints(v, 3, 6),
    "c": lambda v: isinstance(v, str),
    "n": lambda v: _ints(v, 2),
    "d": lambda v: (
        isinstance(v, list)
        and len(v) == 2
        and type(v[0]) is int
        and isinstance(v[1], list)
        and all(isinstance(n, str) for n in v[1])
    ),
}


def _holds(record: Any) -> bool:
    """Whether ``record`` is one this module wrote: every field of its type, every path absolute, every input
    of a kind that :func:`_kind` gives its path, and the lock and the wheelhouse's manifest it was made from
    among its inputs, each a regular file. Anything else is no record: the run takes the long way."""
    if not isinstance(record, dict) or not isinstance(record.get("key"), dict):
        return False
    output, own, inputs = record.get("output"), record.get("own"), record.get("inputs")
    if not (isinstance(output, list) and isinstance(own, list) and isinstance(inputs, list)):
        return False
    if not all(isinstance(x, list) and len(x) == 2 and x[0] in (1, 2) and isinstance(x[1], str) for x in output):
        return False
    if not all(_is_path(p) for p in own) or not isinstance(record.get("confirmed"), bool):
        return False
    files = set()
    for row in inputs:
        if not (isinstance(row, list) and len(row) == 3 and row[0] in _VALUES and _is_path(row[1])):
            return False
        kind, path, value = row
        if value is not None and not _VALUES[kind](value):
            return False
        where = _kind(path, True)  # what a path there is kept as: None under /proc (no input)
        if where is None or (where != kind if kind in "cn" else where == "n"):
            return False
        if kind == "s" and value is not None and stat.S_ISREG(value[0]):
            files.add(path)
    made_from = record.get("made_from")
    return (
        isinstance(made_from, dict)
        and set(made_from) == {"lock", "manifest"}
        and all(_is_path(p) and p in files for p in made_from.values())
    )


def _unchanged(record: dict[str, Any]) -> bool:
    own = set(record["own"])
    inputs = all(_read(kind, path, own) == value for kind, path, value in record["inputs"])
    return inputs and all(_free(p) for p in own if p.endswith(".lock"))


def _free(path: str) -> bool:
    """Whether no process holds the lock file ``path`` (the workspace's, doit's database's: the run that wrote
    the record took them; a run holding one now, with another ``builddir=`` too, makes this one the slow one)."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return True  # no lock file: nobody holds it
    except OSError:
        return False  # cannot tell
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False  # not a lock file of ours: cannot tell
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # and with it the shared lock


# --------------------------------------------------------------------------- tracing


class _Trace:
    def __init__(self, key: dict[str, Any], previous: dict[str, Any] | None) -> None:
        self.key = key
        self.previous = previous
        self.read: set[tuple[str, str]] = set()  # (kind, path): a path read as a file and as a step of another's
        self.listed: set[str] = set()
        self.written: set[str] = set()  # not inputs: what the run wrote
        self.changed: set[str] = set()  # directories in which the run created, renamed or removed names
        self.output: list[list[Any]] = []
        self.size = 0


_trace: _Trace | None = None
_hooked = False


def _path(p: Any) -> str | None:
    if isinstance(p, int):
        return None
    try:
        return os.path.abspath(os.fsdecode(p))
    except (TypeError, ValueError):
        return None


def _note(path: Any, follow: bool) -> None:
    trace = _trace
    p = _path(path)
    if trace is None or p is None:
        return
    kind = _kind(p, follow)
    if kind is not None:
        trace.read.add((kind, p))


def _audit(event: str, args: tuple[Any, ...]) -> None:
    trace = _trace
    if trace is None:
        return
    if event == "open":
        path, mode, flags = (*args, None, None)[:3]
        writes = (
            any(c in mode for c in "wax+")
            if isinstance(mode, str)
            else isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
        )
        p = _path(path)
        if p is not None:
            if writes:
                _wrote(trace, p)
            else:
                _note(p, True)
    elif event in ("os.listdir", "os.scandir"):
        p = _path(args[0] if args and args[0] is not None else ".")
        if p is not None:
            trace.listed.add(p)
    elif event == "sqlite3.connect":
        _note(args[0], True)
    elif event in NAME_EVENTS or event in TWO_NAME_EVENTS or event in CONTENT_EVENTS:
        for a in args[:2] if event in TWO_NAME_EVENTS else args[:1]:
            p = _path(a)
            if p is not None:
                _wrote(trace, p, always=event not in CONTENT_EVENTS)
    elif event in SPAWN_EVENTS:
        spoil()


def _wrote(trace: _Trace, path: str, always: bool = False) -> None:
    """``path`` is written: not an input; its directory changes where a name comes or goes (an open for
    writing or a ``mkdir`` of what exists already adds none: ``mkdir(exist_ok=True)``, a lock file)."""
    trace.written.add(path)
    if not always:
        try:
            _os_lstat(path)
            return
        except OSError:
            pass
    trace.changed.add(os.path.dirname(path))


def _stat_traced(path: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("dir_fd") is not None:
        spoil()  # a path relative to a directory descriptor: not one this module can read again
    else:
        _note(path, kwargs.get("follow_symlinks", True))
    return _os_stat(path, *args, **kwargs)


def _lstat_traced(path: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("dir_fd") is not None:
        spoil()
    else:
        _note(path, False)
    return _os_lstat(path, *args, **kwargs)


class _Tee:
    """A stream that keeps what goes through it, for the record, while the run may become one."""

    def __init__(self, stream: Any, number: int) -> None:
        self._stream = stream
        self._number = number

    def write(self, text: str) -> int:
        trace = _trace
        if trace is not None and text:
            trace.size += len(text)
            if trace.size > MAX_OUTPUT:
                spoil()
            elif trace.output and trace.output[-1][0] == self._number:
                trace.output[-1][1] += text
            else:
                trace.output.append([self._number, text])
        self._stream.write(text)
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding, ...
        return getattr(self._stream, name)


def start(key: dict[str, Any], previous: dict[str, Any] | None) -> None:
    """Trace this run's reads and keep its output, for :func:`finish`."""
    global _trace, _hooked
    if sys.stdout is None or sys.stderr is None:
        return  # no console to replay to
    _trace = _Trace(key, previous)
    if not _hooked:
        sys.addaudithook(_audit)
        _hooked = True
    os.stat, os.lstat = _stat_traced, _lstat_traced
    if not isinstance(sys.stdout, _Tee):
        sys.stdout = _Tee(sys.stdout, 1)
    if not isinstance(sys.stderr, _Tee):
        sys.stderr = _Tee(sys.stderr, 2)


def _stop() -> _Trace | None:
    global _trace
    trace, _trace = _trace, None
    if os.stat is _stat_traced:
        os.stat, os.lstat = _os_stat, _os_lstat
    return trace


def spoil() -> None:
    """This run is not a no-op (it runs a task, starts a process, failed): stop tracing, record nothing."""
    _stop()


def finish(lock: str, manifest: str) -> None:
    """At the end of a run that found everything up to date: write the record (tasks/cli/graph.py's Reporter),
    made from ``lock`` and the wheelhouse's ``manifest``, which the run must have read; else write none."""
    import time

    trace = _stop()
    if trace is None:
        return
    own = trace.written | {os.path.abspath(RECORD)}
    changed = trace.changed | {os.getcwd()}
    inputs: dict[tuple[str, str], Any] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str):
            trace.read.add(("s", os.path.abspath(file)))
    for kind, path in trace.read:
        if path not in own:  # a directory looked at is kept as its names (_names)
            is_dir = path in changed or (kind == "s" and os.path.isdir(path))
            inputs[(("d" if is_dir else kind), path)] = None
    for path in trace.listed:  # also one the run wrote into (build/run): its names but the run's own
        if _kind(path, True) is not None:
            inputs[("d", path)] = None
    rows = [[kind, path, _read(kind, path, own)] for kind, path in sorted(inputs)]
    made_from = {"lock": os.path.abspath(lock), "manifest": os.path.abspath(manifest)}
    if not all(["s", p, _read("s", p, own)] in rows for p in made_from.values()):
        return  # not a no-op of this lock and wheelhouse: no record
    racy = time.time_ns() - int(RACY_SECONDS * 1e9)
    fresh = any(kind in "sl" and isinstance(v, list) and len(v) > 5 and max(v[4], v[5]) > racy for kind, _, v in rows)
    previous = trace.previous
    confirmed = (
        previous is not None and not fresh and previous.get("inputs") == rows and previous.get("output") == trace.output
    )
    doc = {"key": trace.key, "confirmed": confirmed, "made_from": made_from, "own": sorted(own), "inputs": rows,
           "output": trace.output}  # fmt: skip
    if not _holds(doc):
        return  # (a path this module cannot keep: no record)
    import contextlib
    from pathlib import Path

    from tasks.core.fsutil import write_atomic

    with contextlib.suppress(OSError):  # a directory the record cannot be written in: no replay, the run stands
        write_atomic(Path(RECORD), json.dumps(doc))
