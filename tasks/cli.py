"""The venv's ``doit`` command: doit's own main, with less work before the first task.

pyproject.toml installs this as ``doit`` (over doit's own script of the same name, which runs
``doit.__main__:main``; both start the same ``DoitMain``). What it saves is doit's start-up cost on a
run with nothing to do, the no-op that users run most (docs/building.md, "The no-op"):

- doit (0.37) reads the installed distributions' entry points once per plugin kind, three times
  before it loads ``dodo.py`` (commands, loaders, reporters): on a GPU host whose environment sees a
  torch venv's 210 distributions, about 30 ms a read. Here it reads them once.
- doit orders the task creators by their line in ``dodo.py``'s namespace with
  ``inspect.getsourcelines``, which reads and tokenizes each function's source (10 ms for ours);
  the line of a function's code object is the same number.

``python -m doit`` (the tests' way) still works: ``dodo.py`` calls :func:`fast_start` too, which then
helps only what doit has not read yet.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import sys
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


def main() -> None:
    fast_start()
    from doit.doit_cmd import DoitMain

    sys.exit(DoitMain().run(sys.argv[1:]))
