"""reprostack: build a pinned CUDA training stack into a verified wheelhouse.

Run ``doit list`` for the tasks; ``doit help`` lists the variables. The task graph and its
configuration live in tasks/cli/dodo.py, which the installed ``reprostack`` command loads too.
"""

from tasks.cli.dodo import *  # noqa: F403  (doit collects task_* names from this module)
from tasks.cli.dodo import DOIT_CONFIG, prepare_run  # noqa: F401

prepare_run(globals())  # the run's preparation (importing tasks.cli.dodo does none)
