"""The tool's own wheels in a mirror's ``tool/`` (tasks/image/selfwheels.py): what `doit mirror` pins is what the
tool wrote or downloaded itself, never what it found there; and one ``requirements.txt`` installs the tool on each
CPython named in ``tool_python=``.

Real components: `doit mirror` run as a user runs it, a real venv and pip's own ``--require-hashes`` check, a
package index on loopback serving wheels tagged for other Pythons, fetched by ``pip download``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import Workspace, venv_with_pip
from fake_wheels import make_wheel, write_simple_index
from packaging.requirements import Requirement
from packaging.tags import parse_tag
from packaging.utils import canonicalize_name, parse_wheel_filename
from serve import FixtureServer

from tasks.core.errors import FetchError
from tasks.core.treehash import file_sha256
from tasks.env.closure import Target
from tasks.image import selfwheels

pytestmark = pytest.mark.integration

#: A lock of nothing: `doit mirror` then writes only the tool's wheels (no network needed).
EMPTY_LOCK = "format = 1\n[sources]\n[packages]\n"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _alter(wheel: Path, module: str, payload: str) -> None:
    """Rewrite ``wheel`` in place as a valid wheel (its RECORD regenerated) whose ``module`` runs ``payload``."""
    with zipfile.ZipFile(wheel) as zin:
        items = [(info, zin.read(info)) for info in zin.infolist()]
    record = next(info.filename for info, _ in items if info.filename.endswith(".dist-info/RECORD"))
    contents = {info.filename: data for info, data in items}
    contents[module] = contents[module] + f"\n{payload}\n".encode()
    lines = [_record_line(name, data) for name, data in contents.items() if name != record]
    contents[record] = ("\n".join([*lines, f"{record},,"]) + "\n").encode()
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zout:
        for info, _ in items:
            zout.writestr(info, contents[info.filename])


def _offline_pip(env_dir: Path, tool: Path) -> subprocess.CompletedProcess[str]:
    """The documented offline install (docs/offline.md, "The tool itself on a host without network")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "REPRO_"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [str(env_dir / "bin" / "pip"), "install", "--no-index", "--find-links", str(tool)]
    cmd += ["--require-hashes", "-r", str(tool / "requirements.txt")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)


def test_mirror_never_pins_an_altered_tool_wheel(tmp_path: Path) -> None:
    """42.1: doit's wheel in a mirror's tool/ replaced by a valid wheel whose code writes a file on import. pip's
    --require-hashes refuses it; `doit mirror` again used to pin its sha256, so the documented install then took it.
    Now the mirror's pins are the wheels the tool writes itself: the altered file is replaced, and said so."""
    ws = Workspace(root=tmp_path / "ws", cache=tmp_path / "cache", index_url="http://127.0.0.1:9/simple")
    ws.root.mkdir()
    ws.lock.write_text(EMPTY_LOCK)
    mirror = tmp_path / "mirror"
    ws.doit("mirror", f"mirror={mirror}")
    tool = mirror / "tool"
    pins = (tool / "requirements.txt").read_text()
    (genuine,) = tool.glob("doit-*.whl")
    genuine_bytes = genuine.read_bytes()
    marker = tmp_path / "altered-code-ran"
    _alter(genuine, "doit/__init__.py", f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')")
    (tool / "evil-1.0-py3-none-any.whl").write_bytes(genuine.read_bytes())  # a stray wheel of no pin

    node = tmp_path / "node"
    venv_with_pip(node)
    refused = _offline_pip(node, tool)
    assert refused.returncode != 0 and "THESE PACKAGES DO NOT MATCH THE HASHES" in refused.stderr, refused.stderr
    assert "doit" in refused.stderr

    res = ws.doit("mirror", f"mirror={mirror}")
    out = res.stdout + res.stderr
    assert (tool / "requirements.txt").read_text() == pins, out  # the pins are the tool's own, not the file's
    assert genuine.read_bytes() == genuine_bytes and not (tool / "evil-1.0-py3-none-any.whl").exists()
    assert f"replaced {genuine}" in out and "not pinned" in out, out
    assert f"removed {tool / 'evil-1.0-py3-none-any.whl'}" in out, out

    installed = _offline_pip(node, tool)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    run = subprocess.run(
        [str(node / "bin" / "reprostack"), "--version"], capture_output=True, text=True, timeout=120, check=True
    )
    assert run.stdout.startswith(f"reprostack {importlib.metadata.version('reprostack')} "), run.stdout
    subprocess.run([str(node / "bin" / "python"), "-c", "import doit"], check=True, timeout=60)
    assert not marker.exists(), "the altered wheel's code ran on the node"


def _wheel_tags(path: Path) -> set[str]:
    """The tags a wheel's own WHEEL file gives (not its file name)."""
    with zipfile.ZipFile(path) as zf:
        info = next(n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/WHEEL"))
        lines = zf.read(info).decode().splitlines()
    return {str(t) for line in lines if line.startswith("Tag:") for t in parse_tag(line.split(":", 1)[1].strip())}


def test_tool_wheels_for_other_pythons_one_requirements_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """38.4: a mirror written on this Python carries, for each CPython named, the wheel that installs there of each
    distribution built for one Python (charset-normalizer's mypyc build), downloaded by pip from the package index
    into the cache; each of its sha256 on the one requirement line, so the same file installs on every one of them.
    A second run without the index works from the cache; without both, the error names the Python."""
    here = selfwheels.this_python()
    others = tuple(p for p in ("3.11", "3.12", "3.13") if p != here)[:2]
    bound = {
        str(canonicalize_name(d.metadata["Name"])): d.version
        for d in selfwheels.closure()
        if d.metadata["Name"] != selfwheels.TOOL and not Target(others[0]).fits(f"x-1-{selfwheels._wheel_tag(d)}.whl")
    }
    assert bound, "no dependency of the tool here is built for one Python: nothing for tool_python= to fetch"
    index = tmp_path / "index"
    machine = platform.machine()
    published: dict[str, list[str]] = {}
    for name, version in bound.items():  # what the package index has for the other Pythons
        for python in others:
            abi = "cp" + python.replace(".", "")
            wheel = make_wheel(index / "files", name, version, f"{abi}-{abi}-manylinux_2_17_{machine}", {})
            published.setdefault(name, []).append(wheel.name)
    # What only the other Pythons need and this one has not installed (typing_extensions below 3.13, seen from
    # 3.13): a pure wheel of a version the requirement allows.
    elsewhere: dict[str, Requirement] = {}
    selfwheels.closure(selfwheels.TOOL, tuple(Target(p).environment() for p in others), elsewhere)
    for key, req in elsewhere.items():
        allowed = next(v for v in ("4.15.0", "2.0", "1.0", "0.1") if req.specifier.contains(v, prereleases=True))
        published.setdefault(key, []).append(make_wheel(index / "files", key, allowed, "py3-none-any", {}).name)
    write_simple_index(index, published)
    store = tmp_path / "cache" / "fetched"
    with FixtureServer(index) as server:
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
        monkeypatch.setenv("PIP_INDEX_URL", f"{server.url}/simple")
        monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
        monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
        tool = tmp_path / "mirror" / "tool"
        lines = selfwheels.write_tool_wheels(tool, pythons=others, store=store, log=tmp_path / "pip.log")
    requirements = (tool / "requirements.txt").read_text().splitlines()
    by_sha = {file_sha256(p): p for p in tool.glob("*.whl")}
    for name in bound:
        (line,) = [x for x in requirements if x.startswith(f"{name}==")]
        hashes = [h.removeprefix("--hash=sha256:") for h in line.split()[1:]]
        assert len(hashes) == 1 + len(others), line
        for python in (here, *others):  # each Python named has a pinned file whose own WHEEL tags fit it
            fitting = [h for h in hashes if _wheel_tags(by_sha[h]) & {str(t) for t in Target(python).tags}]
            assert len(fitting) == 1, (python, line)
            assert parse_wheel_filename(by_sha[fitting[0]].name)[0] == name
    for key in elsewhere:  # pinned for the Pythons that need it only
        (line,) = [x for x in requirements if x.startswith(f"{key}==")]
        assert " ; python_version == " in line and f'"{here}"' not in line.split(" --hash")[0], line
    first, second, third = sorted((here, *others), key=lambda v: tuple(map(int, v.split("."))))
    assert any(f"install on CPython {first}, {second} and {third} only" in x for x in lines), lines
    # pip as on each other Python: the one requirements file, --require-hashes, no index, the tool/ directory.
    for python in others:
        target = Target(python, selfwheels.default_platforms())
        cmd = [sys.executable, "-m", "pip", "download", "--no-index", "--find-links", str(tool), "--no-deps"]
        cmd += ["--require-hashes", "-r", str(tool / "requirements.txt"), "-d", str(tmp_path / f"got-{python}")]
        res = subprocess.run(
            [*cmd, *target.pip_options()],
            env={**os.environ, "PIP_CONFIG_FILE": os.devnull},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        got = {parse_wheel_filename(p.name)[0]: p.name for p in (tmp_path / f"got-{python}").glob("*.whl")}
        abi = "cp" + python.replace(".", "")
        assert all(f"-{abi}-{abi}-" in got[name] for name in bound), got

    # The index gone: a second mirror works from the cache's fetched/ (the hashes known from the first run) ...
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    again = tmp_path / "mirror2" / "tool"
    selfwheels.write_tool_wheels(again, pythons=others, store=store, log=tmp_path / "pip.log")
    assert (again / "requirements.txt").read_text() == (tool / "requirements.txt").read_text()
    # ... and without the cache either, the error names the Python it could not get the wheels for.
    with pytest.raises(FetchError, match=rf"the tool's wheels for CPython {others[0]}: pip could not download"):
        selfwheels.write_tool_wheels(tmp_path / "m3" / "tool", pythons=others, store=tmp_path / "empty", log=None)
