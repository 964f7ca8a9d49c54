"""The venv's ``doit`` command: doit's own main, with less work before the first task.

pyproject.toml installs this as ``doit`` (over doit's own script of the same name, which runs
``doit.__main__:main``; both start the same ``DoitMain``). What it saves is doit's start-up cost on a
run with nothing to do, the no-op that users run most (docs/building.md, "The no-op"):

- A no-op that a record answers (tasks/core/replay.py) is answered before anything else is imported: no
  doit, no task graph, no lock.
- doit (0.37) reads the installed distributions' entry points once per plugin kind, three times
  before it loads ``dodo.py`` (commands, loaders, reporters): on a GPU host whose environment sees a
  torch venv's 210 distributions, about 30 ms a read. Here it reads them once.
- doit orders the task creators by their line in ``dodo.py``'s namespace with
  ``inspect.getsourcelines``, which reads and tokenizes each function's source (10 ms for ours);
  the line of a function's code object is the same number.

``python -m doit`` (the tests' way) still works: ``dodo.py`` calls :func:`fast_start` too, which then
helps only what doit has not read yet.

pyproject.toml also installs :func:`reprostack`, the same doit with this task graph built in
(tasks/cli/dodo.py): it reads no dodo.py and stays in the directory it runs in, so a user's own directory
holding a lock and its patches is a workspace wherever the tool is installed (pip, pipx, a wheel).
Both commands' ``help`` also lists the variables (tasks/core/settings.py), their defaults and the values in
force here.
"""

from __future__ import annotations

import os
import sys

from tasks.core import replay

TYPE_CHECKING = False  # no typing at start-up (tasks/core/replay.py)
if TYPE_CHECKING:
    from typing import Any


def variable_docs() -> dict[str, str]:
    """Each variable's meaning and default, as tasks/core/settings.py's table documents it."""
    from tasks.core import settings

    docs: dict[str, str] = {}
    name = ""
    for line in (settings.__doc__ or "").splitlines():
        words = line.split(maxsplit=2)
        if len(words) == 3 and words[0] in settings.VARIABLES and not line[0].isspace():
            name = words[0]
            docs[name] = words[2].replace("``", "")
        elif name and line.startswith(" ") and line.strip():
            docs[name] += " " + line.strip().replace("``", "")
        elif line.startswith("="):
            name = ""
    return docs


def print_variables(bin_name: str) -> None:
    """The variables, each with its meaning and default and, where something sets it, the value in force."""
    from doit import doit_cmd

    from tasks.core.errors import ReproError
    from tasks.core.settings import VARIABLES, WORKSPACE_FILE, workspace_defaults

    given = dict(doit_cmd._CMDLINE_VARS or {})
    try:
        workspace = workspace_defaults()
    except ReproError as exc:
        print(f"({exc})")
        workspace = {}
    docs = variable_docs()
    print("")
    print(f"Variables: {bin_name} [TASK] name=value, or the environment variable, or {WORKSPACE_FILE} here")
    print("(docs/tasks.md); 'in force' shows a value set here and where it came from.")
    width = max(map(len, VARIABLES))
    for name, (env_name, default) in VARIABLES.items():
        if name in given:
            value, source = given[name], "the command line"
        elif env_name in os.environ:
            value, source = os.environ[env_name], env_name
        elif name in workspace:
            value, source = workspace[name], WORKSPACE_FILE
        else:
            value, source = default, ""
        print(f"  {name:{width}s}  {env_name:22s} {docs.get(name, '')}")
        if source:
            print(f"  {'':{width}s}  in force: {name}={value} (from {source})")


def print_version() -> None:
    """``--version``: the tool's version and doit's, each with where it is imported from."""
    import importlib.metadata

    import doit

    import tasks

    try:
        ours = importlib.metadata.version("reprostack")
    except importlib.metadata.PackageNotFoundError:
        ours = "(not installed: a checkout's tasks/ on the path)"
    print(f"reprostack {ours} (tasks @ {os.path.dirname(os.path.abspath(tasks.__file__))})")
    print(f"doit {'.'.join(map(str, doit.__version__))} (lib @ {os.path.dirname(os.path.abspath(doit.__file__))})")


def _with_variables_help(main: Any) -> Any:
    """``main`` (a DoitMain) whose ``help`` command, without arguments, ends with the variables, and whose
    ``--version`` names the tool's version before doit's."""
    from doit.cmd_help import Help

    class HelpWithVariables(Help):  # type: ignore[misc]
        def print_usage(self, cmds: Any) -> None:
            if self.bin_name == "reprostack":  # the installed command: say what it is before doit's own lines
                print("reprostack -- doit with the reprostack task graph, in the current directory (README.md)")
            super().print_usage(cmds)

        def execute(self, params: Any, args: list[str]) -> int:
            result: int = super().execute(params, args)
            if len(args) != 1:
                print_variables(self.bin_name)
            return result

    get_cmds = main.get_cmds

    def cmds() -> Any:
        found = get_cmds()
        found["help"] = HelpWithVariables
        return found

    main.get_cmds = cmds
    main.print_version = print_version
    return main


def _stopped_at_start() -> None:
    """A Ctrl-C before the run's own handler is in place (tasks/core/proc.py: while Python, doit and the task
    graph load): the same one line and status as later, not a traceback through the imports."""
    try:
        os.write(2, b"\ninterrupted: before the run started\n")
    except OSError:
        pass  # the terminal is gone
    sys.exit(130)


def main() -> None:
    """The checkout's ``doit``: doit's main on ``dodo.py`` (found as doit finds it)."""
    try:
        _main()
    except KeyboardInterrupt:
        _stopped_at_start()


def _main() -> None:
    if replay.replay(sys.argv):  # a no-op answered from its record, without doit (tasks/core/replay.py)
        sys.exit(0)
    from tasks.core.startup import fast_start

    fast_start()
    from doit.doit_cmd import DoitMain

    sys.exit(_with_variables_help(DoitMain()).run(sys.argv[1:]))


def reprostack() -> None:
    """The installed ``reprostack``: doit with tasks/cli/dodo.py's graph, in the current directory."""
    try:
        _reprostack()
    except KeyboardInterrupt:
        _stopped_at_start()


def _reprostack() -> None:
    if replay.replay(sys.argv):
        sys.exit(0)
    import inspect

    from tasks.core.startup import fast_start

    fast_start()
    from doit.cmd_base import NamespaceTaskLoader
    from doit.doit_cmd import DoitMain

    class GraphLoader(NamespaceTaskLoader):  # type: ignore[misc]
        """The task graph of tasks/cli/dodo.py, imported only for a command that loads tasks (not for ``help``)."""

        def setup(self, opt_values: dict[str, Any]) -> None:
            from tasks.cli import dodo

            self.namespace = dict(inspect.getmembers(dodo))
            dodo.prepare_run(self.namespace)

    doit_main = _with_variables_help(DoitMain(GraphLoader()))
    sys.exit(doit_main.run(sys.argv[1:]))
