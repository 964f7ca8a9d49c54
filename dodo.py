"""reprostack: build a pinned CUDA training stack into a verified wheelhouse.

Run ``doit list`` for the tasks; the README documents every variable.
"""

from tasks import console
from tasks.cli import fast_start
from tasks.graph import (  # noqa: F401  (doit collects task_* names from this module)
    claim_workspace,
    task_build,
    task_bundle,
    task_export,
    task_fetch,
    task_image,
    task_lock,
    task_mirror,
    task_preflight,
    task_repro,
    task_stage,
    task_unbundle,
    task_verify,
    task_verify_image,
    task_wheels,
)

fast_start()  # under `python -m doit`: what tasks/cli.py does before doit starts (the venv's `doit` did it already)
console.install()  # whole lines on the console while tasks run in threads
claim_workspace()  # one run at a time per workspace, before doit opens its database (tasks/workspace.py)

DOIT_CONFIG = {
    "default_tasks": ["wheels"],
    "backend": "sqlite3",
    "dep_file": ".doit.db",
    # Packages build in parallel; one jobserver (tasks/jobserver.py) caps
    # their compiler jobs together, so more tasks than cores is safe.
    "num_process": 8,
    "par_type": "thread",
    "verbosity": 2,
}
