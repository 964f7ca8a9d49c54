"""Every compiler a build runs goes through the run's gate and the object cache, whatever it is called
and wherever the build's paths are: target-prefixed names (Debian's Python has sysconfig CC
``x86_64-linux-gnu-gcc``), compilers named by path, and workspace paths with spaces."""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import HAVE_NVCC, REPO, built_packages, make_workspace, object_counts, scratch_venv


def _units(ws_root: Path, package: str) -> list[str]:
    """The units ``package`` started in the run's unit log (build/logs/units.log): each took a job token."""
    log = ws_root / "build" / "logs" / "units.log"
    return re.findall(rf"^\S+ start {package} (\S+) ", log.read_text(), flags=re.M) if log.exists() else []


@pytest.mark.needs_headers  # compiles the pybind fixture
def test_pybind_compiles_take_tokens_and_hit_the_object_cache_whatever_the_compiler_is_called(
    tmp_path: Path, server: object
) -> None:
    # The name setuptools compiles with: sysconfig's CC (Debian's python3: x86_64-linux-gnu-gcc) and,
    # whatever Python runs this, a target-prefixed gcc named in the environment, as a cross setup does.
    multiarch = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
    prefixed = shutil.which(f"{multiarch}-gcc"), shutil.which(f"{multiarch}-g++")
    if not all(prefixed):
        pytest.skip(f"no {multiarch}-gcc and -g++ on PATH (Debian's gcc package installs them)")
    cache = tmp_path / "cache"
    for env in ({}, {"CC": f"{multiarch}-gcc", "CXX": f"{multiarch}-g++"}):
        shutil.rmtree(cache, ignore_errors=True)
        trees = []
        for tree in ("one", "two"):  # the second build from a new tree, under another action key
            ws = make_workspace(tmp_path / tree / str(len(env)), cache, server.url)  # type: ignore[attr-defined]
            ws.env_extra.update(env)
            if tree == "two":
                ws.lock.write_text(
                    ws.lock.read_text() + '\n[profiles.moved.packages.repro_pybind.env]\nX_UNUSED = "1"\n'
                )
            res = ws.doit("build:repro_pybind", *(["profile=moved"] if tree == "two" else []))
            trees.append((ws, res))
        (first, cold), (_, warm) = trees
        assert object_counts(cold.stdout, "repro_pybind") == (0, 1), (env, cold.stdout)
        units = _units(first.root, "repro_pybind")  # the compile, its preprocessor run and the link
        assert "core.o" in units and any(u.startswith("_core.") and u.endswith(".so") for u in units), units
        assert "seen running outside" not in cold.stdout + warm.stdout
        assert object_counts(warm.stdout, "repro_pybind") == (1, 0), (env, warm.stdout)
        log = (first.root / "build" / "logs" / "build-repro_pybind.log").read_text()
        if env:
            assert re.search(rf"^\s*{re.escape(multiarch)}-g(cc|\+\+) .* -c src/core\.cpp ", log, flags=re.M), log


@pytest.mark.needs_headers
def test_a_workspace_path_with_spaces_builds_compiled_packages(tmp_path: Path, server: object) -> None:
    base = tmp_path / "My Builds"
    ws = make_workspace(base / "ws", base / "the cache", server.url)  # type: ignore[attr-defined]
    pkgs = ["repro_pybind", *(["repro_cuda"] if HAVE_NVCC else [])]
    res = ws.doit("wheels", "profile=quick", f"pkgs={','.join(pkgs)}", f"builddir={base / 'build dir'}")
    assert set(pkgs) <= set(built_packages(res.stdout)), res.stdout
    assert object_counts(res.stdout, "repro_pybind") == (0, 1)  # (nvcc's one command for two sources: no cache)
    assert "seen running outside" not in res.stdout  # nvcc's cicc, ptxas and host compiler ran under its gate
    units = (base / "build dir" / "logs" / "units.log").read_text()
    for pkg in pkgs:  # compiled through the gate
        assert re.search(rf"^\S+ start {pkg} ", units, flags=re.M), (pkg, units)
    again = ws.doit("repro", "profile=quick", f"pkgs={','.join(pkgs)}", f"builddir={base / 'build dir'}")
    assert f"{len(pkgs)} of {len(pkgs)} wheel(s) identical" in again.stdout, again.stdout


@pytest.mark.needs_headers
def test_a_compiler_the_build_runs_by_its_own_path_is_reported_as_outside_the_gate(
    tmp_path: Path, server: object
) -> None:
    # A setup.py that names its compiler by a path of its own: nothing can route that one.
    gxx = shutil.which("g++")
    assert gxx, "g++ is needed to build the fixtures"
    own = str(Path(gxx).resolve())
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", server.url)  # type: ignore[attr-defined]
    setup = (REPO / "tests" / "fixtures" / "src" / "repro_pybind" / "setup.py").read_text().splitlines(True)
    patched = ["import os\n", f"os.environ['CXX'] = {own!r}\n", *setup]
    patch = "".join(difflib.unified_diff(setup, patched, "a/setup.py", "b/setup.py"))
    (ws.root / "patches" / "repro_pybind").mkdir(parents=True, exist_ok=True)
    (ws.root / "patches" / "repro_pybind" / "0001-own-compiler.patch").write_text(patch)
    ws.edit_lock('source = "repro-pybind"\n', 'source = "repro-pybind"\npatches = ["0001-own-compiler.patch"]\n')

    res = ws.doit("build:repro_pybind")
    assert object_counts(res.stdout, "repro_pybind") == (0, 0)
    # The compile and, unless it ended between two samples, the link (setuptools links C++ with CXX too).
    said = r"warning: repro_pybind: ([12]) compile\(s\) seen running outside the run's gate and object cache \(\1 by "
    assert re.search(said + re.escape(f"{own})"), res.stdout), res.stdout
    log = (ws.root / "build" / "logs" / "build-repro_pybind.log").read_text()
    said = r"# but ([12]) compile\(s\) seen running outside the gate and the object cache: \1 by "
    assert re.search(said + re.escape(f"{own}\n"), log), log
    assert "core.o" not in _units(ws.root, "repro_pybind")


@pytest.mark.needs_headers
def test_a_build_interpreter_under_a_path_with_spaces_runs_the_gate(tmp_path: Path, server: object) -> None:
    # The gate is a script the compilers' launchers exec: a '#!' line cannot name an interpreter whose
    # path has a space, so it must not be one.
    python = scratch_venv(tmp_path / "My Tools" / "venv")
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", server.url)  # type: ignore[attr-defined]
    env = ws.env()  # ninja >= 1.13 and ccache from this interpreter's environment, as the scratch one has none
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    res = subprocess.run(
        [python, *ws.command("build:repro_pybind")[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert object_counts(res.stdout, "repro_pybind") == (0, 1), res.stdout
    assert "core.o" in _units(ws.root, "repro_pybind")
