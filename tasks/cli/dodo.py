"""The task graph as a module: what ``reprostack`` loads (tasks/cli/main.py), and what the checkout's
dodo.py re-exports.

The installed command has no dodo.py to read (a wheel carries only the ``tasks`` package), so the
task creators and ``DOIT_CONFIG`` live here; importing this module prepares the process for a run
(doit's start-up trimmed, whole console lines, the workspace claimed), as dodo.py did. Paths stay
relative to the directory the command runs in: the lock, its patches, ``reprostack.toml``,
``wheels/``, ``build/`` and doit's state (``.doit.db``) are that directory's.
"""

import sys

from tasks.cli.graph import (  # noqa: F401  (doit collects task_* names from this module)
    Reporter,
    claim_workspace,
    task_build,
    task_bundle,
    task_export,
    task_fetch,
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

if requested_tasks(sys.argv[1:]) and requested_tasks(sys.argv[1:]) <= LOCK_FREE:
    for _name in [n for n in globals() if n.startswith("task_") and n.removeprefix("task_") not in LOCK_FREE]:
        del globals()[_name]  # their creators read the lock

# under `python -m doit`: what tasks/cli/main.py does before doit starts (the venv's `doit` did it already)
fast_start()
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
