"""What every command does before doit starts, below the task graph (tasks/cli/dodo.py) and the commands
(tasks/cli/main.py), which both call it.

:func:`fast_start` trims doit's start-up (tasks/cli/main.py says what it saves); :func:`requested_tasks` reads
which tasks a command line asks for, before doit parses it (tasks/cli/dodo.py, tasks/stages/context.py and
tasks/cli/graph.py decide from it what a run needs).
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import os
import re
import sys
import types
from typing import Any


def _first_line(obj: Any) -> tuple[list[str], int]:
    """``inspect.getsourcelines`` for what doit asks of it: the line a task creator starts on."""
    code = getattr(obj, "__code__", None)
    if code is None:
        return inspect.getsourcelines(obj)
    return [], int(code.co_firstlineno)


def _dist_name(entry: str) -> str:
    """A distribution's name from its ``.dist-info`` / ``.egg-info`` folder, as importlib.metadata normalises
    it to drop a later copy of the same distribution on the path."""
    return re.sub(r"[-_.]+", "_", entry.rsplit(".", 1)[0].split("-", 1)[0]).lower()


@functools.cache
def doit_entry_points() -> importlib.metadata.EntryPoints:
    """The entry points of doit's plugin groups (``doit.COMMAND``, ``doit.LOADER``, ...) of the distributions
    on ``sys.path``, as ``importlib.metadata.entry_points()`` finds them (the first distribution of a name
    wins), read once. Only an ``entry_points.txt`` that names a ``[doit.`` group is parsed: a GPU host's
    environment sees a torch venv's 200 distributions, whose entry points importlib.metadata would parse all."""
    found, seen = [], set()
    for folder in sys.path:
        try:
            entries = os.listdir(folder or ".")
        except OSError:
            continue  # a zip, or gone
        for entry in entries:
            if not entry.endswith((".dist-info", ".egg-info")) or _dist_name(entry) in seen:
                continue
            seen.add(_dist_name(entry))
            try:
                with open(os.path.join(folder or ".", entry, "entry_points.txt"), "rb") as f:
                    text = f.read()
            except OSError:
                continue
            if b"[doit." not in text:
                continue
            group = ""
            for line in text.decode("utf-8", "replace").splitlines():
                line = line.strip()
                if line.startswith("[") and line.endswith("]"):
                    group = line[1:-1].strip()
                elif group.startswith("doit.") and "=" in line and not line.startswith(("#", ";")):
                    name, value = (part.strip() for part in line.split("=", 1))
                    found.append(importlib.metadata.EntryPoint(name=name, value=value, group=group))
    return importlib.metadata.EntryPoints(found)


def fast_start() -> None:
    """Make doit read plugins once and find its task creators' lines without reading their source."""
    import doit.loader
    import doit.plugin

    if isinstance(doit.loader.inspect, types.SimpleNamespace):
        return  # done already (the venv's `doit`, then dodo.py)

    def entry_points(group: str) -> importlib.metadata.EntryPoints:
        if not group.startswith("doit."):
            return importlib.metadata.entry_points(group=group)
        return doit_entry_points().select(group=group)

    doit.plugin.entry_points_impl = lambda: entry_points
    # doit.loader calls ``inspect.getsourcelines(ref)[1]``: the loader alone sees this namespace.
    shim = types.SimpleNamespace(**{k: getattr(inspect, k) for k in dir(inspect) if not k.startswith("__")})
    shim.getsourcelines = _first_line
    doit.loader.inspect = shim


#: Tasks that need no lock: on the air-gapped host, `reprostack unbundle` runs before there is one.
LOCK_FREE = frozenset({"unbundle"})


def requested_tasks(argv: list[str]) -> set[str]:
    """The task names a command line asks for (``run`` dropped); variables and options left out."""
    from tasks.core.workspace import VALUE_OPTIONS  # doit's options that take a value: the next word is not a task

    words, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in VALUE_OPTIONS:
            skip = True
        elif not arg.startswith("-") and "=" not in arg:
            words.append(arg)
    return set(words[1:] if words[:1] == ["run"] else words)
