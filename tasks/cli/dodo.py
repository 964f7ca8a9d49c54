"""The task graph as a module: what ``reprostack`` loads (tasks/cli/main.py), and what the checkout's
dodo.py re-exports.

The installed command has no dodo.py to read (a wheel carries only the ``tasks`` package), so the
task creators and ``DOIT_CONFIG`` live here. Importing this module does nothing else; :func:`prepare_run`
prepares the process for a run (doit's start-up trimmed, the exit status of the first failure, whole
console lines, the workspace claimed), called by whoever loads the graph for doit (the checkout's dodo.py,
tasks/cli/main.py's loader) before doit opens its state database. Paths stay
relative to the directory the command runs in: the lock, its patches, ``reprostack.toml``,
``wheels/``, ``build/`` and doit's state (``.doit.db``) are that directory's.
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping
from typing import Any

from tasks.cli import failures
from tasks.cli.graph import (  # noqa: F401  (doit collects task_* names from this module)
    Reporter,
    claim_workspace,
    context,
    task_build,
    task_bundle,
    task_export,
    task_fetch,
    task_hints,
    task_image,
    task_lock,
    task_mirror,
    task_plan,
    task_preflight,
    task_repro,
    task_stage,
    task_unbundle,
    task_verify,
    task_verify_image,
    task_wheels,
)
from tasks.core import console
from tasks.core.startup import LOCK_FREE, fast_start, requested_tasks


def prepare_run(namespace: MutableMapping[str, Any]) -> None:
    """Prepare this process for the run its command line asks for, with the task creators of ``namespace``
    (what doit collects tasks from): only the lock-free ones for a lock-free command."""
    wanted = requested_tasks(sys.argv[1:])
    if wanted and wanted <= LOCK_FREE:
        for name in [n for n in namespace if n.startswith("task_") and n.removeprefix("task_") not in LOCK_FREE]:
            del namespace[name]  # their creators read the lock
    # under `python -m doit`: what tasks/cli/main.py does before doit starts (the venv's `doit` did it already)
    fast_start()
    failures.install()  # first of our exit handlers, so that it runs last
    failures.settings_from(lambda: context().settings)  # a full disk's message names the fullest output
    console.install()  # whole lines on the console while tasks run in threads
    claim_workspace()  # one run at a time per workspace, before doit opens its state database (tasks/core/workspace.py)


DOIT_CONFIG = {
    "default_tasks": ["wheels"],
    "backend": "sqlite3",
    "dep_file": ".doit.db",
    # Packages build in parallel; one jobserver (tasks/engine/jobserver.py) caps
    # their compiler jobs together, so more tasks than cores is safe.
    "num_process": 8,
    "par_type": "thread",
    "verbosity": 2,
    "reporter": Reporter,  # doit's console reporter; `doit plan format=json` prints its JSON alone
}
