"""The hermetic toolchain: the CUDA fixture built by nvcc from pinned wheels, the host's CUDA hidden."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, Workspace, built_packages, lock_text_for, require

from integration.test_wheels import find_cuobjdump
from tasks.env.hermetic import set_sha256
from tasks.lock.lockfile import load_lock

pytestmark = pytest.mark.integration

HERMETIC_LOCK = REPO / "examples" / "hermetic.lock"
#: Where a CUDA toolkit lives on a host (the real directory, not the /usr/local/cuda link).
SYSTEM_CUDA = Path("/usr/local/cuda").resolve()


def _hidden_cuda(argv: list[str]) -> list[str]:
    """``argv`` run with an empty directory mounted over the host's CUDA toolkit (a private mount namespace)."""
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    script = 'mount -t tmpfs reprostack-no-cuda "$1" && shift && exec "$@"'
    return ["unshare", *user, "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh",
            str(SYSTEM_CUDA), *argv]  # fmt: skip


def _can_hide_cuda() -> bool:
    if not SYSTEM_CUDA.is_dir() or shutil.which("unshare") is None:
        return False
    res = subprocess.run(_hidden_cuda(["true"]), capture_output=True, check=False)
    return res.returncode == 0


def test_hermetic_toolchain_builds_the_cuda_fixture_without_the_host_cuda(tmp_path: Path, server: object) -> None:
    if not _can_hide_cuda():
        require(f"cannot hide the host's CUDA ({SYSTEM_CUDA} absent, or unshare --mount not permitted)")
    pins = load_lock(HERMETIC_LOCK).toolchain.hermetic
    # The pinned wheels, fetched by the host's pip as it is configured, become the
    # mirror's wheels/: the install then runs with --no-index from that folder.
    mirror = tmp_path / "mirror"
    (mirror / "wheels").mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
         "--only-binary=:all:", "-d", str(mirror / "wheels"), *(f"{p.name}=={p.version}" for p in pins)],
        check=True,
    )  # fmt: skip
    root = tmp_path / "ws"
    root.mkdir()
    ws = Workspace(root=root, cache=tmp_path / "cache", index_url=f"{server.url}/simple")  # type: ignore[attr-defined]
    ws.lock.write_text(lock_text_for(server.url, HERMETIC_LOCK))  # type: ignore[attr-defined]
    shutil.copytree(REPO / "examples" / "patches", root / "patches")
    # Nothing of the host's CUDA on PATH, no CUDA variables; inside the namespace the
    # toolkit directory itself is empty (so /usr/local/cuda and any wrapper script lead nowhere).
    path = [d for d in os.environ["PATH"].split(os.pathsep) if not d.startswith(("/usr/local/cuda", str(SYSTEM_CUDA)))]
    ws.env_extra = {"PATH": os.pathsep.join(path), "CUDA_HOME": "", "CUDA_PATH": "", "NVCC": ""}
    argv = ws.command("wheels", f"mirror={mirror}", "objcache=off")
    res = subprocess.run(
        _hidden_cuda(argv), env=ws.env(), capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
        check=False,
    )  # fmt: skip
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    assert built_packages(res.stdout) == ["repro_cuda"]
    # The build ran the hermetic nvcc, and its action key covers the pinned set.
    sha = set_sha256(pins)
    nvcc = ws.cache / "toolchains" / sha / "site" / "nvidia" / "cu13" / "bin" / "nvcc"
    log = (root / "build" / "logs" / "build-repro_cuda.log").read_text()
    # nvcc as PATH gave it: the hermetic one, run through the jobserver's gate (the build log names it).
    assert f"nvcc = {shlex.quote(str(nvcc))}" in log, log
    (entry,) = (ws.cache / "wheels").glob("*/*/entry.json")
    assert json.loads(entry.read_text())["key_document"]["hermetic_toolchain"]["sha256"] == sha
    manifest = json.loads((ws.wheels / "manifest.json").read_text())
    (wheel,) = manifest["wheels"]
    statement = json.loads((ws.wheels / "provenance" / f"{wheel['filename']}.intoto.json").read_text())
    deps = statement["predicate"]["buildDefinition"]["resolvedDependencies"]
    assert any(d["name"] == "hermetic-toolchain" and d["digest"] == {"sha256": sha} for d in deps), deps
    # sm_90a machine code in the wheel.
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.fail("cuobjdump not found: pip install nvidia-cuda-cuobjdump (see pyproject's example extra)")
    unpacked = tmp_path / "unpacked"
    shutil.unpack_archive(ws.wheels / wheel["filename"], unpacked, format="zip")
    so = next(unpacked.glob("repro_cuda/_vadd*.so"))
    listing = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True, check=True).stdout
    assert "sm_90a" in listing
    # A second run reuses the installed toolchain and the wheel.
    again = subprocess.run(
        _hidden_cuda(argv), env=ws.env(), capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
        check=False,
    )  # fmt: skip
    assert again.returncode == 0, f"{again.stdout}\n{again.stderr}"
    assert built_packages(again.stdout) == [] and "hermetic toolchain: installing" not in again.stdout
