"""The venv's ``doit`` (tasks/cli/main.py): doit's start-up trimmed, its behaviour unchanged."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import runpy
import subprocess
import sys
from pathlib import Path

import doit
import doit.loader
import doit.plugin
import pytest
from conftest import require

from tasks.core import startup

REPO = Path(__file__).resolve().parents[2]


def test_task_creators_keep_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # doit orders the creators by the line they start on; the code object's line is that line.
    namespace = runpy.run_path(str(REPO / "tasks" / "cli" / "graph.py"), run_name="graph_under_test")
    monkeypatch.setattr(doit.loader, "inspect", inspect)
    before = [(name, line) for name, _, line in doit.loader._get_task_creators(namespace, [])]
    startup.fast_start()
    assert doit.loader.inspect is not inspect  # doit no longer reads the creators' source
    after = [(name, line) for name, _, line in doit.loader._get_task_creators(namespace, [])]
    assert after == before and len(after) >= 10


def test_plugins_are_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    real = importlib.metadata.entry_points

    def counted() -> importlib.metadata.EntryPoints:
        reads.append(1)
        return real()

    monkeypatch.setattr(importlib.metadata, "entry_points", counted)
    monkeypatch.setattr(doit.loader, "inspect", inspect)  # fast_start runs again
    monkeypatch.setattr(doit.plugin, "entry_points_impl", doit.plugin.entry_points_impl)
    startup.fast_start()
    for category in ("COMMAND", "LOADER", "REPORTER", "BACKEND"):
        doit.plugin.PluginDict().add_plugins({}, category)
    assert len(reads) == 1


def _dist(folder: Path, name: str, entry_points: str | None) -> None:
    info = folder / f"{name}.dist-info"
    info.mkdir(parents=True)
    dist, version = name.split("-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    if entry_points is not None:
        (info / "entry_points.txt").write_text(entry_points)


def test_doits_plugins_are_found_as_importlib_metadata_finds_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    _dist(first, "my_plug-1.0", "[console_scripts]\nmy = my_plug:main\n\n[doit.COMMAND]\nhello = my_plug.cmd:Hello\n")
    _dist(first, "quiet-2.0", None)
    _dist(first, "scripts_only-1.0", "[console_scripts]\nonly = scripts_only:main\n")
    # the same distribution again, later on the path (name spelled otherwise): importlib.metadata drops it
    _dist(second, "My.Plug-0.9", "[doit.COMMAND]\nold = my_plug_old:Old\n")
    _dist(second, "second_plug-3.1", "[doit.REPORTER]\n# a comment\nfancy = second_plug.rep : Fancy\n[doit.LOADER]\n")
    monkeypatch.setattr(sys, "path", [str(first), str(tmp_path / "missing"), str(second), *sys.path])
    monkeypatch.setattr(doit.loader, "inspect", inspect)  # fast_start runs again, its one read on this path
    monkeypatch.setattr(doit.plugin, "entry_points_impl", doit.plugin.entry_points_impl)
    startup.fast_start()
    found = []
    for category in ("COMMAND", "LOADER", "REPORTER", "BACKEND"):
        group = f"doit.{category}"
        ours = sorted((e.name, e.value) for e in doit.plugin.entry_points_impl()(group=group))
        theirs = sorted((e.name, e.value) for e in importlib.metadata.entry_points(group=group))
        assert ours == theirs, group
        plugins = doit.plugin.PluginDict()
        plugins.add_plugins({}, category)
        found += [(group, name, entry.location) for name, entry in plugins.items()]
    assert found == [
        ("doit.COMMAND", "hello", "my_plug.cmd:Hello"),
        ("doit.REPORTER", "fancy", "second_plug.rep:Fancy"),
    ]


def test_the_venvs_doit_is_ours_and_runs_doit() -> None:
    script = Path(sys.executable).parent / "doit"
    if not script.is_file():
        require(f"no doit script beside {sys.executable}")
    assert "tasks.cli.main" in script.read_text(), f"{script} is not the project's (pip install -e . writes it)"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True).stdout
    tool, doit_line = out.splitlines()
    assert tool.startswith(f"reprostack {importlib.metadata.version('reprostack')} (tasks @ "), out
    assert doit_line.startswith(f"doit {'.'.join(map(str, doit.__version__))} (lib @ "), out


def test_reprostack_version_names_the_tool_and_doit(tmp_path: Path) -> None:
    """`reprostack --version` printed doit's version alone (0.37.0), as if the tool had none."""
    res = _reprostack(tmp_path, "--version")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        f"reprostack {importlib.metadata.version('reprostack')}",
        f"doit {'.'.join(map(str, doit.__version__))}",
    ], res.stdout


def _reprostack(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The installed command's entry point (pyproject.toml: reprostack = tasks.cli.main:reprostack), run in ``cwd``."""
    code = "import sys; from tasks.cli.main import reprostack; sys.argv[0] = 'reprostack'; reprostack()"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REPRO_")}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_help_lists_the_variables_and_the_values_in_force(tmp_path: Path) -> None:
    (tmp_path / "reprostack.toml").write_text('lock = "my.lock"\n')
    res = _reprostack(tmp_path, "help", "jobs=3", env={"REPRO_PROFILE": "quick"})
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "reprostack help" in out and "Variables:" in out
    assert "in force: jobs=3 (from the command line)" in out
    assert "in force: profile=quick (from REPRO_PROFILE)" in out
    assert "in force: lock=my.lock (from reprostack.toml)" in out
    assert "cache directory (default $XDG_CACHE_HOME/reprostack)" in out
    assert not (tmp_path / ".doit.db").exists() and not (tmp_path / "build").exists()  # help loads no tasks


def test_reprostack_works_in_the_directory_it_runs_in(tmp_path: Path) -> None:
    """No dodo.py there: the task graph is the package's; the lock is looked up here and named as given."""
    res = _reprostack(tmp_path, "list")
    assert res.returncode == 11, res.stdout + res.stderr  # LockError
    assert "sources.lock: lock file not found" in res.stderr and str(REPO) not in res.stderr
    (tmp_path / "sources.lock").write_text('format = 1\n[toolchain]\narchs = ["sm_90a"]\n[sources]\n[packages]\n')
    res = _reprostack(tmp_path, "list")
    assert res.returncode == 0, res.stdout + res.stderr
    assert {"wheels", "verify", "bundle", "lock"} <= {line.split()[0] for line in res.stdout.splitlines() if line}


def test_the_tasks_a_command_line_asks_for() -> None:
    """Only `unbundle` asked for: no task creator that reads the lock is loaded (tasks/cli/dodo.py)."""
    assert startup.requested_tasks(["-n", "2", "unbundle", "bundle=x.tar", "dest=y"]) == {"unbundle"}
    assert startup.requested_tasks(["run", "-f", "dodo.py", "-d", "ws", "unbundle"]) == {"unbundle"}
    assert startup.requested_tasks(["wheels", "profile=quick"]) == {"wheels"}
    assert startup.requested_tasks(["profile=quick"]) == set()  # the default task, which reads the lock
    assert startup.LOCK_FREE == {"unbundle"}


def test_workspace_settings_nested_too_deeply_are_one_error(tmp_path: Path) -> None:
    """A reprostack.toml nested 50 000 deep is one ReproError naming the file (tomllib raised RecursionError)."""
    from tasks.core.errors import ReproError
    from tasks.core.settings import workspace_defaults

    (tmp_path / "reprostack.toml").write_text("lock = " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(ReproError, match="nested too deeply"):
        workspace_defaults(tmp_path)


def test_the_tools_wheel_is_not_written_from_metadata_older_than_pyproject(tmp_path: Path) -> None:
    """An editable install made before pyproject.toml gained a command gave a tool wheel without it."""
    from tasks.core.errors import ReproError
    from tasks.image.selfwheels import _check_current

    dist = importlib.metadata.distribution("reprostack")
    _check_current(dist, REPO / "pyproject.toml")  # this checkout's install is current
    text = (REPO / "pyproject.toml").read_text()
    newer = text.replace("[project.scripts]\n", '[project.scripts]\nreprostack-new = "tasks.cli.main:main"\n')
    (tmp_path / "pyproject.toml").write_text(newer)
    with pytest.raises(ReproError, match=r"commands reprostack-new.*bootstrap\.sh"):
        _check_current(dist, tmp_path / "pyproject.toml")


def test_the_tools_wheels_say_which_pythons_they_install_on(tmp_path: Path) -> None:
    """The tool's wheels are this installation's: a compiled dependency (charset-normalizer, built by mypyc)
    installs on this Python only, unless tool_python= names others. `doit mirror` and `doit bundle` say so,
    naming the distributions, so that a GPU host with another Python is not first told by pip's "no matching
    distribution"."""
    import zipfile

    from packaging.utils import parse_wheel_filename

    from tasks.image.selfwheels import write_tool_wheels

    lines = write_tool_wheels(tmp_path / "tool")
    bound = {}
    for wheel in sorted((tmp_path / "tool").glob("*.whl")):  # the tags each wheel's own WHEEL file gives
        with zipfile.ZipFile(wheel) as z:
            info = next(n for n in z.namelist() if n.endswith(".dist-info/WHEEL"))
            tags = [x.split(":", 1)[1].strip() for x in z.read(info).decode().splitlines() if x.startswith("Tag:")]
        if not all(t.split("-")[0].startswith("py") or t.split("-")[1] == "abi3" for t in tags):
            bound[str(parse_wheel_filename(wheel.name)[0])] = tags
    notes = [x for x in lines if x.startswith("note:")]
    if not bound:
        assert notes == [], lines
        return
    (note,) = notes
    mine = f"CPython {sys.version_info.major}.{sys.version_info.minor}"
    assert f"install on {mine} only" in note and all(name in note for name in bound), (note, bound)
    assert "tool_python=" in note, note


def test_tool_python_is_checked() -> None:
    """tool_python= takes CPython versions, major.minor, comma-separated."""
    from tasks.core.errors import ReproError
    from tasks.core.settings import parse_pythons

    assert parse_pythons("3.12, 3.13,3.12") == ("3.12", "3.13") and parse_pythons("") == ()
    for bad in ("3", "3.12.1", "py3.12", "2.7", "3.x"):
        with pytest.raises(ReproError, match="tool_python="):
            parse_pythons(bad)


@pytest.mark.parametrize("entry", ["main", "reprostack"])
def test_a_ctrl_c_while_the_command_starts_is_one_line_and_130(entry: str, tmp_path: Path) -> None:
    """Before the run's own handler is in place (while doit and the graph load), Ctrl-C is Python's
    KeyboardInterrupt: the command says one line and exits 130, as a run interrupted later does."""
    script = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"  # a terminal's: a background job ignores it
        "from tasks.core import replay\n"
        "def starting(argv):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "replay.replay = starting\n"
        "from tasks.cli import main\n"
        f"sys.argv = ['{entry}', 'list']\n"
        f"main.{entry}()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 130, done.stderr
    assert done.stderr == "\ninterrupted: before the run started\n"
