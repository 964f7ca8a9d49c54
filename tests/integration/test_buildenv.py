"""Build closures (docs/lock.md, "The build closure"; docs/building.md, "Build environments"): a build runs with the
lock's pinned wheels, never the host's; a closure that no longer matches its build_requires is refused until
`doit lock` pins it again."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from conftest import Workspace, built_packages, make_workspace

pytestmark = [pytest.mark.integration, pytest.mark.needs_headers]  # the pybind11 fixture compiles

#: The example's pure and pybind11 packages: no nvcc, no torch.
PROFILE = "\n[profiles.host]\n" + "".join(
    f"[profiles.host.packages.{p}]\nenabled = false\n" for p in ("repro_cuda", "repro_torchext")
)

#: A host whose own build tools break on import: a build that imported any of them would fail.
BROKEN = 'raise RuntimeError("the host\'s {name} was imported by a build")\n'


def _workspace(root: Path, url: str) -> Workspace:
    ws = make_workspace(root / "ws", root / "cache", url)
    ws.lock.write_text(ws.lock.read_text() + PROFILE)
    return ws


def _wheels(ws: Workspace) -> dict[str, str]:
    doc = json.loads((ws.wheels / "manifest.json").read_text())
    return {w["package"]: w["sha256"] for w in doc["wheels"] if w.get("origin", "built") == "built"}


def test_a_build_imports_nothing_of_the_hosts_build_tools(tmp_path: Path, server: object) -> None:
    broken = tmp_path / "host-site"
    for name in ("setuptools", "wheel", "pybind11", "pip"):
        (broken / name).mkdir(parents=True)
        (broken / name / "__init__.py").write_text(BROKEN.format(name=name))
    plain = _workspace(tmp_path / "plain", server.url)  # type: ignore[attr-defined]
    plain.doit("wheels", "profile=host")
    hostile = _workspace(tmp_path / "hostile", server.url)  # type: ignore[attr-defined]
    hostile.env_extra["PYTHONPATH"] = str(broken)  # first on the tool's sys.path, and the build's if it leaked
    res = hostile.doit("wheels", "profile=host")
    assert sorted(built_packages(res.stdout)) == ["repro_pure", "repro_pybind"], res.stdout + res.stderr
    assert "was imported by a build" not in res.stdout + res.stderr
    assert _wheels(hostile) == _wheels(plain)  # the same bytes whatever the host's tools
    log = (hostile.root / "build" / "logs" / "build-repro_pybind.log").read_text()
    assert "/tmp/reprostack-build/envs/" in log, log  # pip and the compiler ran from the closure's venv


def test_a_closure_that_no_longer_matches_build_requires_is_refused_until_locked(
    tmp_path: Path, server: object
) -> None:
    ws = _workspace(tmp_path, server.url)  # type: ignore[attr-defined]
    ws.edit_lock(
        'build_requires = ["setuptools>=61"]\nverify = { imports = ["repro_pure"]',
        'build_requires = ["setuptools>=70"]\nverify = { imports = ["repro_pure"]',
    )
    res = ws.doit("wheels", "profile=host", check=False)
    assert res.returncode == 11, res.stdout + res.stderr
    assert "package repro_pure:" in res.stderr and "has no build closure for its build_requires" in res.stderr
    assert "run `doit lock lock=" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (ws.wheels / "manifest.json").exists()
    locked = ws.doit("lock")
    assert "build.repro_pure: 2 wheels (with pip, the frontend)" in locked.stdout, locked.stdout
    assert "build.repro_pybind: pinned" in locked.stdout, locked.stdout  # the others kept as they were
    closure = tomllib.loads(ws.lock.read_text())["build"]["repro_pure"]["resolved"]
    assert [line.split(" ")[0] for line in closure] == ["pip==26.3", "setuptools==84.2.1"]
    res = ws.doit("wheels", "profile=host")
    assert built_packages(res.stdout) == ["repro_pure"]  # (repro_pybind was built by the refused run)
    assert (ws.wheels / "manifest.json").is_file()


def test_a_build_requirement_the_index_lacks_is_one_message_and_the_lock_is_kept(
    tmp_path: Path, server: object
) -> None:
    ws = _workspace(tmp_path, server.url)  # type: ignore[attr-defined]
    ws.edit_lock(
        'build_requires = ["setuptools>=61"]\nverify = { imports = ["repro_pure"]',
        'build_requires = ["setuptools>=61", "no-such-build-tool"]\nverify = { imports = ["repro_pure"]',
    )
    before = ws.lock.read_text()
    res = ws.doit("lock", check=False)
    assert res.returncode == 11, res.stdout + res.stderr
    assert "package repro_pure: its build_requires" in res.stderr and "no-such-build-tool" in res.stderr
    assert "then run `doit lock` again; the lock was left as it was" in res.stderr
    assert "Traceback" not in res.stderr
    assert ws.lock.read_text() == before
