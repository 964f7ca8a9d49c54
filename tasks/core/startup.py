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
import types
from typing import Any


def _first_line(obj: Any) -> tuple[list[str], int]:
    """``inspect.getsourcelines`` for what doit asks of it: the line a task creator starts on."""
    code = getattr(obj, "__code__", None)
    if code is None:
        return inspect.getsourcelines(obj)
    return [], int(code.co_firstlineno)


def fast_start() -> None:
    """Make doit read plugins once and find its task creators' lines without reading their source."""
    import doit.loader
    import doit.plugin

    if isinstance(doit.loader.inspect, types.SimpleNamespace):
        return  # done already (the venv's `doit`, then dodo.py)

    everything = functools.cache(importlib.metadata.entry_points)  # read when doit first asks

    def entry_points(group: str) -> importlib.metadata.EntryPoints:
        return everything().select(group=group)

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
