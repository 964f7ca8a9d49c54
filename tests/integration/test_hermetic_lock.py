"""`doit lock` and `doit mirror` on a hermetic toolchain, against a real package index on loopback.

A PEP 503 simple index of tiny fake wheels (tests/fixtures/fake_wheels.py) is
served over HTTP on 127.0.0.1; pip is pointed at it and nothing else. `doit
lock` fills the requirements' hashes from it, `doit mirror` copies the pinned
wheels into the mirror, and with the server stopped the hermetic toolchain
installs from the mirror alone (pip --no-index, the offline host's path).
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest
from conftest import Workspace
from fake_wheels import publish_fake_toolchain
from fake_wheels import sha256 as file_sha
from serve import FixtureServer

from tasks.env.hermetic import ensure
from tasks.lock.lockfile import load_lock
from tasks.store.cache import Cache

pytestmark = pytest.mark.integration

LOCK = """\
# The fake toolchain of tests/fixtures/fake_wheels.py; `doit lock` fills the hashes.
format = 1

[toolchain]
python = ">=3.10"
archs = ["sm_90a"]

[toolchain.hermetic]
requirements = [
  "fake-cuda-tool==1.0",  # carries nvidia/cu13/bin/nvcc
  "fake-cuda-rt==2.0",    # listed without #sha256= fragments
]

[sources.tiny]
kind = "url"
url = "{url}/archives/tiny-0.1.tar"
license = "MIT"

[packages]
"""


def _tiny_archive(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        data = b"a source, so that the lock has one to mirror\n"
        info = tarfile.TarInfo("tiny-0.1/README")
        info.size, info.mtime, info.mode = len(data), 1700000000, 0o644
        tar.addfile(info, io.BytesIO(data))


def _requirements(lock: Path) -> list[str]:
    return list(tomllib.loads(lock.read_text())["toolchain"]["hermetic"]["requirements"])


def _workspace(tmp_path: Path, url: str) -> Workspace:
    root = tmp_path / "ws"
    root.mkdir()
    ws = Workspace(root=root, cache=tmp_path / "cache", index_url=f"{url}/simple")
    ws.lock.write_text(LOCK.format(url=url))
    return ws


def test_lock_hashes_the_index_wheels_and_the_mirror_installs_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = tmp_path / "index"
    wheels = publish_fake_toolchain(served)
    _tiny_archive(served / "archives" / "tiny-0.1.tar")
    mirror = tmp_path / "mirror"
    with FixtureServer(served) as server:
        ws = _workspace(tmp_path, server.url)
        before = ws.lock.read_text()
        res = ws.doit("lock")
        # One --hash per wheel of the pinned version for manylinux x86_64 and aarch64 (or any platform),
        # each the sha256 of the file the server sends; not the Windows, CPython 3.9, 1.1 or sdist files.
        tool = sorted(file_sha(wheels[k]) for k in ("x86_64", "aarch64"))
        assert _requirements(ws.lock) == [
            "fake-cuda-tool==1.0 " + " ".join(f"--hash=sha256:{h}" for h in tool),
            f"fake-cuda-rt==2.0 --hash=sha256:{file_sha(wheels['rt'])}",  # downloaded and hashed
        ]
        assert "hermetic fake-cuda-tool==1.0: 2 wheels" in res.stdout
        assert f"{wheels['aarch64'].name}  sha256:{file_sha(wheels['aarch64'])}" in res.stdout
        # Comments and layout are kept; only the requirement strings changed.
        stripped = re.sub(r" --hash=sha256:[0-9a-f]{64}", "", ws.lock.read_text())
        assert stripped.startswith(before.split("[sources.tiny]")[0])
        pins = load_lock(ws.lock).toolchain.hermetic  # complete now, sources too

        res = ws.doit("mirror", f"mirror={mirror}")
        assert "hermetic toolchain: the wheels of 2 pins" in res.stdout
    # What the mirror holds is exactly the pinned files, byte for byte.
    mirrored = sorted(p.name for p in (mirror / "wheels").iterdir())
    assert mirrored == sorted(wheels[k].name for k in ("x86_64", "aarch64", "rt"))
    assert {file_sha(mirror / "wheels" / n) for n in mirrored} == {h for p in pins for h in p.hashes}
    assert (mirror / "index.json").is_file()  # the sources went there as before

    # The server is gone: the hermetic toolchain installs from <mirror>/wheels alone (pip --no-index).
    for name in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", ws.index_url)  # stopped: refused, were it asked
    toolchain = ensure(pins, cache=Cache(tmp_path / "cache2"), mirror=mirror, log=tmp_path / "install.log")
    assert "--no-index" in (tmp_path / "install.log").read_text()
    out = subprocess.run([toolchain.nvcc], capture_output=True, text=True, check=True).stdout
    assert "fake nvcc" in out
    assert (toolchain.site / "fake_cuda_rt" / "__init__.py").is_file()


@pytest.mark.parametrize(
    ("requirement", "message"),
    [
        ("fake-cuda-tool>=1.0", "requirement 'fake-cuda-tool>=1.0' needs one exact version"),
        ("fake-cuda-tool==9.9", "fake-cuda-tool==9.9: the package index has no file of version 9.9"),
    ],
)
def test_a_range_or_an_unknown_version_is_an_error_and_the_lock_stays(
    tmp_path: Path, requirement: str, message: str
) -> None:
    served = tmp_path / "index"
    publish_fake_toolchain(served)
    with FixtureServer(served) as server:
        ws = _workspace(tmp_path, server.url)
        ws.lock.write_text(ws.lock.read_text().replace('"fake-cuda-tool==1.0"', f'"{requirement}"'))
        before = ws.lock.read_bytes()
        res = ws.doit("lock", check=False)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and message in out, out
    assert ws.lock.read_bytes() == before
