"""Wheels that refuse to go where they cannot work (issue 31): the torch a wheel was compiled against is in
its metadata, and plain pip, offline, refuses to install it beside another torch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, Workspace

sys.path.insert(0, str(REPO / "tests" / "fixtures"))

from fake_wheels import make_wheel

pytestmark = pytest.mark.integration


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return zf.read(name).decode()


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pip as a user on an offline node runs it: no configuration of this machine (its find-links, its index)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, check=False, env=env)  # fmt: skip


@pytest.mark.needs_torch
def test_the_torch_extension_pins_its_torch_and_pip_refuses_another(workspace: Workspace, tmp_path: Path) -> None:
    ws = workspace
    res = ws.doit("build:repro_torchext")
    wheel = next((ws.cache / "wheels").glob("*/*/repro_torchext-*.whl"))
    built_with = _torch_version()  # this interpreter's torch: the one the build compiled against
    assert f"Requires-Dist: torch=={built_with}\n" in _metadata(wheel), res.stdout
    log = (ws.root / "build" / "logs" / "build-repro_torchext.log").read_text()
    assert f"added to the wheel's METADATA: Requires-Dist: torch=={built_with}" in log

    # Offline, as a user installs: a find-links directory with our wheel and a torch of another version.
    links = tmp_path / "links"
    links.mkdir()
    (links / wheel.name).write_bytes(wheel.read_bytes())
    public = built_with.split("+")[0]
    other = f"{public}+cu999" if "+" in built_with else f"{public}+cpu"  # same public version, other label
    make_wheel(tmp_path / "torches", "torch", other, "py3-none-any", {"torch/__init__.py": b""})
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=True).create(env)
    python = env / "bin" / "python"
    assert _pip(python, "install", "--no-index", "--find-links", str(tmp_path / "torches"), "torch").returncode == 0
    refused = _pip(python, "install", "--no-index", "--find-links", str(links), "repro_torchext")
    assert refused.returncode != 0
    assert f"torch=={built_with}" in refused.stdout + refused.stderr, refused.stderr
    assert _pip(python, "show", "repro_torchext").returncode != 0  # nothing installed
    # Beside the torch it was built against (a fixture of that exact version), pip installs it.
    same = make_wheel(tmp_path / "same", "torch", built_with, "py3-none-any", {"torch/__init__.py": b""})
    assert _pip(python, "install", "--no-index", str(same)).returncode == 0
    done = _pip(python, "install", "--no-index", "--find-links", str(links), "repro_torchext")
    assert done.returncode == 0, done.stderr


def _profile_without(ws: Workspace, name: str, *left_out: str) -> None:
    ws.lock.write_text(ws.lock.read_text() + f"\n[profiles.{name}]\n" + "".join(
        f"[profiles.{name}.packages.{p}]\nenabled = false\n" for p in left_out))  # fmt: skip


@pytest.mark.needs_torch
def test_preflight_checks_the_node_against_the_wheelhouse_it_ships_in(workspace: Workspace, tmp_path: Path) -> None:
    """`doit wheels` ships the checker; `doit preflight` and the shipped copy (no checkout, plain Python) agree."""
    ws = workspace
    _profile_without(ws, "guard", "repro_pybind", "repro_cuda")
    ws.doit("wheels", "profile=guard")
    spec = json.loads((ws.wheels / "preflight.json").read_text())
    assert spec["archs"] == ["sm_90a"] and spec["build"]["torch"] == _torch_version()
    assert (ws.wheels / "preflight.py").read_bytes() == (REPO / "tasks" / "preflight.py").read_bytes()
    ws.doit("verify", "profile=guard")  # what doit wheels writes is the wheelhouse's own (the contents row)

    ws.env_extra["REPRO_LIBCUDA"] = str(tmp_path / "no-driver" / "libcuda.so.1")  # no driver, whatever the host
    res = ws.doit("preflight", "profile=guard", check=False)
    assert res.returncode == 21, res.stdout + res.stderr
    said = [ln for ln in res.stdout.splitlines() if "no NVIDIA driver" in ln]
    assert len(said) == 1 and said[0].startswith("FAIL  driver"), res.stdout
    for name in ("python", "glibc", "torch", "provided"):
        assert re.search(rf"^PASS  {name} ", res.stdout, flags=re.M), res.stdout
    report = json.loads((ws.root / "build" / "preflight" / "report.json").read_text())
    assert report["ok"] is False and [c["check"] for c in report["checks"] if c["status"] == "FAIL"] == ["driver"]
    assert "PreflightFailed: this node cannot take the wheels" in res.stderr
    assert ws.doit("preflight", "profile=guard", "gpu=off").returncode == 0

    # On a node: the shipped copy alone, outside any checkout, under an isolated interpreter.
    node = tmp_path / "node"
    shutil.copytree(ws.wheels, node / "wheels")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPRO_", "PYTHON"))}
    env["REPRO_LIBCUDA"] = ws.env_extra["REPRO_LIBCUDA"]
    shipped = [sys.executable, "-I", "wheels/preflight.py", "--json", "report.json"]
    res2 = subprocess.run(shipped, cwd=node, env=env, capture_output=True, text=True, check=False)
    assert res2.returncode == 21 and "no NVIDIA driver found" in res2.stdout, res2.stdout + res2.stderr
    res3 = subprocess.run([*shipped, "--gpu", "off"], cwd=node, env=env, capture_output=True, text=True, check=False)
    assert res3.returncode == 0, res3.stdout + res3.stderr
    assert json.loads((node / "report.json").read_text())["ok"] is True
