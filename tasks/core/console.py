"""Whole lines on the console while tasks run in threads.

``print(x)`` writes ``x`` and the newline in two calls, so two threads
printing at once can merge their lines ("fetch a (git)fetch b (git)").
:func:`install` (called by dodo.py, only in a doit process) puts a writer in
front of stdout and stderr that keeps each thread's text until its line is
complete and then writes the line in one call, under a lock.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, TextIO


def warn(message: str) -> None:
    """One ``WARNING:`` line on stderr."""
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


class LineWriter:
    """A text stream that forwards whole lines, one thread's at a time."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._local = threading.local()

    def write(self, text: str) -> int:
        pending: str = getattr(self._local, "pending", "") + text
        head, newline, tail = pending.rpartition("\n")
        self._local.pending = tail
        if newline:
            with self._lock:
                self._stream.write(head + newline)
                self._stream.flush()
        return len(text)

    def flush(self) -> None:
        # A line still being written stays with its thread until its newline:
        # writing it now would let another thread's line land in its middle.
        with self._lock:
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._stream, name)


def install() -> None:
    if not isinstance(sys.stdout, LineWriter):
        sys.stdout = LineWriter(sys.stdout)
    if not isinstance(sys.stderr, LineWriter):
        sys.stderr = LineWriter(sys.stderr)
