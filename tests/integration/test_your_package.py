"""docs/your-package.md, done as it says: the installed tool, from a directory outside the checkout holding only
a lock and a patches/ folder, builds, verifies and reproduces a C++ extension of "your own" (our pybind11 fixture,
served as an sdist-like archive on loopback).

The tool is installed as a user without network would install it: a venv of its own, the tool's wheels from
`doit mirror`'s tool/ (tasks/image/selfwheels.py) with --no-index --require-hashes, then the reprostack wheel that pip
builds from this checkout; nothing else (the build requirements come through the lock's build closure).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, venv_with_pip
from serve import FixtureServer

from tasks.image import selfwheels

pytestmark = [pytest.mark.integration, pytest.mark.needs_headers]

PATCH = "\n".join(
    [
        "Say that the build is ours: a patch from the lock's patches/ directory, applied before the build.",
        "",
        "--- a/repro_pybind/__init__.py",
        "+++ b/repro_pybind/__init__.py",
        "@@ -1,5 +1,7 @@",
        ' """pybind11 fixture package."""',
        " ",
        " from ._core import add, dot",
        " ",
        '+BUILT_BY = "my-stack"',
        "+",
        ' __all__ = ["add", "dot"]',
        "",
    ]
)


def _lock(url: str) -> str:
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"""\
format = 1
patches_dir = "patches"

[toolchain]
python = ">=3.10"
archs = ["sm_90a"]

[sources.my-ext]
kind = "url"
url = "{url}/archives/repro_pybind-0.1.0.tar"
license = "MIT"

[packages.repro_pybind]
source = "my-ext"
build_requires = ["setuptools>=61", "pybind11>=2.10"]
patches = ["0001-built-by.patch"]
verify = {{ imports = ["repro_pybind", "repro_pybind._core"] }}

[runtime]
requirements = ["repro-greeting>=0.3"]
python = "{python}"
"""


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False, **kwargs)  # type: ignore[call-overload]
    assert res.returncode == 0, f"{argv} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    return res  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def installed_tool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv holding the tool, installed offline as docs/offline.md says; its bin directory."""
    root = tmp_path_factory.mktemp("tool")
    tool = root / "tool"
    selfwheels.write_tool_wheels(tool)  # what `doit mirror` and `doit bundle` carry
    # The project's own wheel, built by pip from the checkout (a copy: pip builds in the tree).
    src = root / "src"
    for tree in ("tasks", "docker"):
        shutil.copytree(REPO / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    dist = root / "dist"
    offline = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "REPRO_"))}
    offline.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)]
    _run(pip, env=offline, timeout=600)
    (wheel,) = dist.glob("reprostack-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    # What the tasks read at run time beside their code: the smoke scripts, docker/'s install script (doit image).
    for needed in ("tasks/outside/unbundle.py", "tasks/outside/smoke/_harness.py", "tasks/docker/install-wheels.sh"):
        assert needed in names, names
        (own,) = tool.glob("reprostack-*.whl")
        assert needed in zipfile.ZipFile(own).namelist()
    env_dir = root / "venv"
    venv_with_pip(env_dir)
    vpip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index"]
    _run(
        [*vpip, "--find-links", str(tool), "--require-hashes", "-r", str(tool / "requirements.txt")],
        env=offline,
        timeout=600,
    )
    _run([*vpip, "--no-deps", "--force-reinstall", str(wheel)], env=offline, timeout=600)
    # Nothing else: `reprostack lock` pins the build requirements, and the build runs in a venv of exactly those.
    code = "from tasks.image.image import tool_docker_dir as d; print(d())"
    where = _run([str(env_dir / "bin" / "python"), "-c", code], cwd=root)  # not the checkout: it is on sys.path there
    assert Path(where.stdout.strip()).is_relative_to(env_dir), where.stdout  # the installed copy, not the checkout's
    yield env_dir / "bin"


def test_your_own_package_from_a_directory_of_its_own(
    installed_tool: Path, tmp_path: Path, server: FixtureServer
) -> None:
    stack = tmp_path / "my-stack"  # outside the checkout: only a lock and patches/
    (stack / "patches" / "repro_pybind").mkdir(parents=True)
    (stack / "patches" / "repro_pybind" / "0001-built-by.patch").write_text(PATCH)
    (stack / "sources.lock").write_text(_lock(server.url))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "REPRO_"))}
    env.update(
        PIP_INDEX_URL=f"{server.url}/simple",
        PIP_CONFIG_FILE=os.devnull,
        PYTHONUNBUFFERED="1",
        REPRO_CACHE=str(tmp_path / "cache"),
        PATH=f"{installed_tool}{os.pathsep}{env.get('PATH', os.defpath)}",
    )

    def reprostack(*args: str) -> str:
        res = _run(["reprostack", *args], cwd=stack, env=env, timeout=1200)
        output = res.stdout + res.stderr
        assert str(REPO) not in output, output  # nothing from the checkout: the installed tool alone
        return output

    out = reprostack("lock")
    text = (stack / "sources.lock").read_text()
    assert "tree_sha256 = " in text and "sha256 = " in text and "repro-greeting==0.3.0 --hash=sha256:" in text, out
    closure = tomllib.loads(text)["build"]["repro_pybind"]["resolved"]  # pinned from the index, with pip
    assert sorted(line.split("==")[0] for line in closure) == ["pip", "pybind11", "setuptools"], out
    out = reprostack("wheels")
    assert "built repro_pybind in" in out, out
    house = sorted(p.name for p in (stack / "wheels").glob("*.whl"))
    assert any(n.startswith("repro_pybind-0.1.0-") for n in house) and any(
        n.startswith("repro_greeting-") for n in house
    )
    (ours,) = (stack / "wheels").glob("repro_pybind-*.whl")
    assert 'BUILT_BY = "my-stack"' in zipfile.ZipFile(ours).read("repro_pybind/__init__.py").decode()
    assert "built repro_pybind in" not in reprostack("wheels")  # up to date: nothing rebuilt
    out = reprostack("verify", "isolated=on")
    assert re.search(r"\b[1-9]\d* passed, 0 failed", out), out
    out = reprostack("repro")
    assert "identical" in out, out
    # Everything it wrote is in the directory it ran in: doit's state, build/ and wheels/.
    assert any(p.name.startswith(".doit.db") for p in stack.iterdir()) and (stack / "build" / "logs").is_dir()
