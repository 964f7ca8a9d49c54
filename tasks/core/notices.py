"""Messages said once per change: a line that would repeat on every run is printed when it is new.

A skipped optional package's reason (tasks/cli/graph.py) is the same on every run of a host without
nvcc; printed each time, a no-op run would repeat it. :func:`say_once` prints a message the first
time, and again only when it changes; ``build/notices.json`` keeps what was said, per key, for the
workspace (one run at a time per workspace, tasks/core/workspace.py; threads of the run share a lock).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from tasks.core.fsutil import write_atomic

FILE = "notices.json"
_lock = threading.Lock()


def _read(path: Path) -> dict[str, str]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in doc.items()} if isinstance(doc, dict) else {}


def say_once(builddir: Path, key: str, message: str) -> bool:
    """Print ``message`` unless it is what was said last for ``key`` in this workspace; whether it was printed."""
    path = builddir / FILE
    with _lock:
        said = _read(path)
        if said.get(key) == message:
            return False
        print(message, flush=True)
        said[key] = message
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(said, indent=1, sort_keys=True) + "\n")
        return True


def said(builddir: Path, key: str) -> str | None:
    """What was said last for ``key`` in this workspace (None: nothing, or it was forgotten)."""
    with _lock:
        return _read(builddir / FILE).get(key)


def forget(builddir: Path, key: str) -> None:
    """Drop what was said for ``key``: the next message for it is printed (the condition ended)."""
    path = builddir / FILE
    with _lock:
        said = _read(path)
        if key in said:
            del said[key]
            write_atomic(path, json.dumps(said, indent=1, sort_keys=True) + "\n")
