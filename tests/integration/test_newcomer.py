"""A newcomer's first hour (issue 17): what a host without nvcc builds, one nvcc reached two ways,
the workspace's default lock, one message for one cause.

Real doit runs on the example lock served on loopback, real nvcc builds of the CUDA fixture.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import HAVE_HEADERS, HAVE_NVCC, REPO, Workspace, entries, make_workspace, require, shas

from tasks.core.settings import WORKSPACE_FILE
from tasks.env.toolchain import _which

pytestmark = pytest.mark.integration


def nvcc_or_skip() -> Path:
    """The nvcc executable itself (not a wrapper script that runs it by a fixed path)."""
    if not HAVE_NVCC:
        require("nvcc not found (NVCC, PATH, CUDA_HOME, /usr/local/cuda): the CUDA fixture cannot build")
    homes = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    found = _which("nvcc", dict(os.environ))
    for candidate in [*(os.path.join(h, "bin", "nvcc") for h in homes if h), found]:
        if candidate and os.path.isfile(candidate):
            real = Path(os.path.realpath(candidate))
            with real.open("rb") as fh:
                if fh.read(4) == b"\x7fELF":
                    return real
    require("no nvcc executable found (CUDA_HOME, /usr/local/cuda, PATH): the CUDA fixture cannot build")


def linked_cuda(tmp: Path, nvcc: Path) -> Path:
    """A second path to the same CUDA install: a symlink to its directory (as /usr/local/cuda is)."""
    link = tmp / "cuda-link"
    link.symlink_to(nvcc.parent.parent, target_is_directory=True)
    return link / "bin"


def manifest(ws: Workspace) -> dict[str, object]:
    doc: dict[str, object] = json.loads((ws.wheels / "manifest.json").read_text())
    return doc


def test_host_without_nvcc_builds_the_rest(workspace: Workspace) -> None:
    """No nvcc (NVCC names one that is not there): the optional CUDA fixture is left out with one line, the rest
    builds and verifies; without `optional`, the same package is a toolchain error naming it."""
    workspace.env_extra["NVCC"] = "/nonexistent/bin/nvcc"
    res = workspace.doit("wheels", "profile=quick")
    out = res.stdout + res.stderr
    assert len(re.findall(r"^skipped repro_cuda \(optional in example.lock\): nvcc not found", out, re.M)) == 1, out
    (line,) = [x for x in out.splitlines() if x.startswith("skipped repro_cuda")]
    assert len(line) < 200, line  # brief
    again = workspace.doit("wheels", "profile=quick")
    assert "skipped repro_cuda" not in again.stdout + again.stderr  # said once per change, not on every no-op run
    # and not even looked at again: its build task is up to date (doit's "--"), so a no-op imports no build
    assert re.search(r"^-- build:repro_cuda$", again.stdout, re.M), again.stdout
    (workspace.wheels / "manifest.json").unlink()  # wheels/ assembled again: its summary still says skipped
    again = workspace.doit("wheels", "profile=quick")
    assert re.search(r"^repro_cuda +skipped ", again.stdout, re.M), again.stdout
    expected = {"repro_pure", "repro_pybind"} if HAVE_HEADERS else {"repro_pure"}  # pybind needs Python.h
    assert set(shas(workspace)) == expected
    workspace.doit("verify", "gpu=off", "profile=quick")
    report = json.loads((workspace.root / "build" / "verify" / "report.json").read_text())
    assert {row["package"] for row in report["rows"]} - {"wheelhouse", "closure"} == expected
    # Without the profile wheels/ was built with, verify's dependency on wheels would first rebuild wheels/ for
    # the default profile (for sources.lock: hours, FA2 and the full FA3): refused before anything runs.
    before = manifest(workspace)
    for task in ("verify", "repro", "bundle"):
        res = workspace.doit(task, "gpu=off", check=False)
        assert res.returncode == 10, res.stdout + res.stderr
        said = res.stderr
        assert "holds profile 'quick' of example.lock" in said and f"`doit {task} profile=quick`" in said, said
        assert f"`doit wheels {task} profile=default`" in said and "build:" not in res.stdout, res.stdout + said
    assert manifest(workspace) == before

    workspace.edit_lock("optional = true  # left out, with one line saying why, on a host without nvcc\n", "")
    res = workspace.doit("wheels", "profile=quick", check=False)
    out = res.stdout + res.stderr
    assert res.returncode == 16, out  # ToolchainError's status
    assert "ToolchainError: package repro_cuda: the build toolchain does not match" in out, out
    assert "nvcc not found" in out


def test_one_nvcc_reached_two_ways_gives_one_key_and_one_wheel(tmp_path: Path, server: object) -> None:
    """/usr/local/cuda/bin/nvcc and /usr/local/cuda-13.0/bin/nvcc are one file; nvcc writes the path it was
    started by into what it links. Builds reach it by its resolved path: same key, same bytes."""
    nvcc = nvcc_or_skip()
    via_link = linked_cuda(tmp_path, nvcc)
    url = server.url  # type: ignore[attr-defined]
    wheels = {}
    for name, bindir in (("real", nvcc.parent), ("link", via_link)):
        ws = make_workspace(tmp_path / name, tmp_path / f"cache-{name}", url)
        ws.env_extra.update(PATH=os.pathsep.join([str(bindir), os.environ["PATH"]]), CUDA_HOME=str(bindir.parent))
        ws.doit("build:repro_cuda", "profile=quick")
        wheels[name] = entries(ws.cache)["repro_cuda"]["sha256"]
    assert wheels["real"] == wheels["link"]


def other_cuda(tmp: Path, nvcc: Path) -> Path:
    """Another CUDA install: its own copy of the nvcc program, the rest of the toolkit linked in."""
    home, other = nvcc.parent.parent, tmp / "other-cuda"
    (other / "bin").mkdir(parents=True)
    for entry in home.iterdir():
        if entry.name != "bin":
            (other / entry.name).symlink_to(entry)
    for tool in nvcc.parent.iterdir():
        if tool.name == "nvcc":
            shutil.copy2(tool, other / "bin" / "nvcc")
        else:
            (other / "bin" / tool.name).symlink_to(tool)
    return other / "bin"


def test_another_nvcc_is_another_key(tmp_path: Path, workspace: Workspace) -> None:
    """The key holds the nvcc actually used (resolved path and version): another install of it is another
    key; two paths to one nvcc, or a wrapper script that runs it (`exec .../nvcc "$@"`), are one key."""
    nvcc = nvcc_or_skip()
    wrapper = tmp_path / "wrapper" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nexec {nvcc} "$@"\n')
    wrapper.chmod(0o755)
    keys = {}
    reached = {
        "real": nvcc.parent,
        "link": linked_cuda(tmp_path, nvcc),
        "wrapper": wrapper.parent,
        "other": other_cuda(tmp_path, nvcc),
    }
    for name, bindir in reached.items():
        code = (
            "from tasks.stages.context import Context\n"
            f"ctx = Context.load({{'lock': {str(workspace.lock)!r}, 'cache': {str(workspace.cache)!r}}})\n"
            "print(ctx.key(ctx.package('repro_cuda'))[0])\n"
        )
        env = workspace.env() | {"PATH": os.pathsep.join([str(bindir), os.environ["PATH"]])}
        env.pop("CUDA_HOME", None)
        env.pop("NVCC", None)
        res = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True
        )
        keys[name] = res.stdout.strip().splitlines()[-1]
    assert keys["real"] == keys["link"] == keys["wrapper"]
    assert keys["other"] != keys["real"]


def doit_here(root: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """doit in ``root`` as a user types it there: no lock= on the command line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "REPRO_"))}
    env.update(REPRO_CACHE=str(cache), PIP_CONFIG_FILE=os.devnull)
    return subprocess.run(
        [sys.executable, "-m", "doit", "-f", str(REPO / "dodo.py"), "-d", str(root), *args],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
        check=False,
    )


def test_workspace_file_is_the_default_lock(workspace: Workspace) -> None:
    """reprostack.toml in the workspace supplies lock= (said on every run); the command line still wins;
    a mistake in the file names the file."""
    (workspace.root / WORKSPACE_FILE).write_text('lock = "example.lock"\nprofile = "quick"\n')
    res = doit_here(workspace.root, workspace.cache, "list", "--all")
    assert res.returncode == 0, res.stderr
    assert f"lock: example.lock (from {WORKSPACE_FILE}; lock=PATH overrides it)" in res.stderr
    assert "build:repro_pybind" in res.stdout and "build:repro_torchext" not in res.stdout  # profile=quick
    res = doit_here(workspace.root, workspace.cache, "list", "--all", "lock=missing.lock")
    assert res.returncode != 0 and "missing.lock: lock file not found" in res.stderr
    (workspace.root / WORKSPACE_FILE).write_text('lokc = "example.lock"\n')
    res = doit_here(workspace.root, workspace.cache, "list")
    assert res.returncode == 10, res.stderr
    assert f"{WORKSPACE_FILE}: unknown variable 'lokc'" in res.stderr


@pytest.mark.needs_headers  # without Python.h the (optional) pybind fixture is left out: one failing package
def test_one_cause_is_said_once(workspace: Workspace) -> None:
    """A toolchain that no package can use: every build task fails for the same reason, and it is said once."""
    workspace.edit_lock('python = ">=3.10"', 'python = ">=9.0"')
    res = workspace.doit("wheels", "profile=quick", check=False)
    err = res.stderr
    assert res.returncode == 16, res.stdout + err
    assert err.count("does not satisfy '>=9.0'") == 1, err
    # doit dispatches no new task after a failure: the tasks already started fail too, and point to the first
    # (how many had started depends on timing: on a stock trixie run only the first one had)
    assert err.count("ToolchainError: ") == 1 or "the same error as" in err, err
    assert "TaskFailed" not in res.stdout + err  # doit's own report would repeat it per task


def test_no_network_is_said_once(tmp_path: Path) -> None:
    """Every source's host unreachable (nothing listens on the port; offline, the same for github.com): one
    error naming the host and what to do, one line for each other source, whatever fetched it (git, HTTP)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"  # free, nothing listening once closed
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", closed)
    res = ws.doit("fetch", check=False)
    err = res.stderr
    assert res.returncode == 12, res.stdout + err  # FetchError
    lines = [line for line in err.splitlines() if line.startswith("FetchError: ")]
    full = [line for line in lines if "cannot connect to 127.0.0.1: no network to it" in line]
    assert len(full) == 1 and "doit mirror mirror=DIR" in full[0], err
    pointers = set(lines) - set(full)
    assert all(re.fullmatch(r"FetchError: source \S+: the same error as source \S+, above", p) for p in pointers), err
    assert "TaskFailed" not in res.stdout + err and "Traceback" not in err


def test_venv_doit_finds_the_venv_tools() -> None:
    """`.venv/bin/doit` without activating the venv runs builds with the venv's tools: the first one on the
    builds' PATH is the interpreter's directory (so its ninja, not the system's)."""
    if sys.prefix == sys.base_prefix:
        require("not running in a venv")
    from tasks.stages.context import interpreter_path

    here = os.path.dirname(sys.executable)
    bare = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != here)
    assert interpreter_path(bare).split(os.pathsep)[0] == here
    assert interpreter_path(interpreter_path(bare)) == interpreter_path(bare)
    ninja = shutil.which("ninja", path=interpreter_path(bare))
    if ninja is not None and Path(here, "ninja").exists():
        assert ninja == str(Path(here, "ninja"))
