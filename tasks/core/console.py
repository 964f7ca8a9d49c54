"""Whole lines on the console while tasks run in threads.

``print(x)`` writes ``x`` and the newline in two calls, so two threads
printing at once can merge their lines ("fetch a (git)fetch b (git)").
:func:`install` (called by dodo.py, only in a doit process) puts a writer in
front of stdout and stderr that keeps each thread's text until its line is
complete and then writes the line in one call, under a lock. On a terminal, a run's
status line (:class:`Live`, tasks/engine/progress.py) stays below those lines.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, TextIO

#: One console: stdout's and stderr's writers and the status line take turns on it.
_LOCK = threading.Lock()
#: Clear from the cursor to the end of the line (ECMA-48 EL), after a carriage return: the line rewritten.
CLEAR = "\x1b[K"


def warn(message: str) -> None:
    """One ``WARNING:`` line on stderr."""
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


class LineWriter:
    """A text stream that forwards whole lines, one thread's at a time."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._local = threading.local()

    def write(self, text: str) -> int:
        pending: str = getattr(self._local, "pending", "") + text
        head, newline, tail = pending.rpartition("\n")
        self._local.pending = tail
        if newline:
            with _LOCK:
                status = _live if _live is not None and _live.text else None
                if status is not None:  # the lines go above the status line, which is drawn again below them
                    status.erase()
                self._stream.write(head + newline)
                self._stream.flush()
                if status is not None:
                    status.draw()
        return len(text)

    def flush(self) -> None:
        # A line still being written stays with its thread until its newline:
        # writing it now would let another thread's line land in its middle.
        with _LOCK:
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._stream, name)


def install() -> None:
    if not isinstance(sys.stdout, LineWriter):
        sys.stdout = LineWriter(sys.stdout)
    if not isinstance(sys.stderr, LineWriter):
        sys.stderr = LineWriter(sys.stderr)


class Live:
    """The one status line at the foot of a terminal, rewritten in place (a carriage return, the text cut to
    the terminal's width, and clear-to-end of line, as cargo and ninja draw theirs); whole lines written
    meanwhile through :class:`LineWriter` go above it."""

    def __init__(self, stream: TextIO, width: int | None = None) -> None:
        self.stream = stream
        self.text = ""
        self._width = width

    def show(self, text: str) -> None:
        with _LOCK:
            self.text = text
            self.draw()

    def clear(self) -> None:
        """Take the line off the terminal (the run's builds have ended)."""
        with _LOCK:
            if self.text:
                self.erase()
                self.text = ""

    def draw(self) -> None:
        """(With the console's lock held.)"""
        self.stream.write("\r" + self.text[: max(1, self._columns() - 1)] + CLEAR)
        self.stream.flush()

    def erase(self) -> None:
        """(With the console's lock held.)"""
        self.stream.write("\r" + CLEAR)
        self.stream.flush()

    def _columns(self) -> int:
        if self._width is not None:
            return self._width
        try:
            return os.get_terminal_size(self.stream.fileno()).columns or 80
        except (OSError, ValueError, AttributeError):
            return 80


_live: Live | None = None


def live() -> Live | None:
    """The status line of this process's terminal, or None where stdout is no terminal behind
    :func:`install`'s writer: a log, a pipe, CI, ``TERM`` unset or ``dumb`` (ninja's rule) get whole lines."""
    global _live
    out = sys.stdout
    if _live is None and isinstance(out, LineWriter) and os.environ.get("TERM", "dumb") != "dumb":
        try:
            tty = out.isatty()
        except (OSError, ValueError):
            tty = False
        if tty:
            _live = Live(out._stream)
    return _live
