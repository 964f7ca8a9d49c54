"""The hermetic toolchain: the lock's ``[toolchain.hermetic]`` wheels as the build's CUDA.

Instead of the host's CUDA install, builds can use a toolchain made only of
hash-pinned wheels: CUDA 13's ``nvidia-cuda-nvcc`` wheel carries a full nvcc,
and with ``nvidia-nvvm``, ``nvidia-cuda-crt``, ``nvidia-cuda-runtime`` and
``nvidia-cuda-cccl`` it unpacks to a complete ``nvidia/cu13/{bin,include,lib,nvvm}``.

The wheels are installed once per pinned set, with ``pip install
--require-hashes --no-deps --target``, into ``<cache>/toolchains/<set hash>/site``
(a temporary directory renamed into place, so a reader sees a whole
environment or none), with ``lib64`` linked to ``lib`` as in a CUDA install
(nvcc links ``-lcudart_static`` from ``lib64``). A build then gets:

- ``<site>/nvidia/cu13`` as ``CUDA_HOME`` and ``CUDA_PATH``, and its ``bin``
  first on ``PATH`` (after the object cache's and jobserver's shims, which run
  the nvcc found next on ``PATH``: this one), and no ``NVCC`` variable: every
  usual way of finding nvcc (``NVCC``, ``PATH``, ``CUDA_HOME``, then
  ``/usr/local/cuda``) stops at this one. Other directories stay on ``PATH``
  (``/usr/local/bin`` may hold a link to the host's nvcc, and also cmake);
- ``<site>`` first on ``PYTHONPATH``, so a pinned torch wheel is the one the
  build imports.

The set's hash (:func:`set_sha256`) enters every package's action key.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tasks import proc
from tasks.cache import Cache, write_atomic
from tasks.errors import ToolchainError
from tasks.lockfile import WheelPin

#: Bump when the layout of an installed toolchain changes.
LAYOUT_VERSION = 1
#: Where the CUDA component wheels put the toolkit, relative to the install target.
CUDA_SUBDIR = Path("nvidia") / "cu13"


def set_sha256(pins: Sequence[WheelPin]) -> str:
    """The identity of a pinned set: its requirement lines, sorted."""
    doc = {"layout": LAYOUT_VERSION, "requirements": sorted(p.requirement() for p in pins)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def key_section(pins: Sequence[WheelPin]) -> dict[str, object]:
    """What the action key records about the hermetic toolchain."""
    return {"sha256": set_sha256(pins), "requirements": sorted(p.requirement() for p in pins)}


@dataclass(frozen=True, kw_only=True)
class Hermetic:
    """An installed hermetic toolchain."""

    root: Path  # <cache>/toolchains/<set hash>
    sha256: str

    @property
    def site(self) -> Path:
        return self.root / "site"

    @property
    def cuda_home(self) -> Path:
        return self.site / CUDA_SUBDIR

    @property
    def nvcc(self) -> Path:
        return self.cuda_home / "bin" / "nvcc"

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` with this toolchain's CUDA first and every other nvcc hidden."""
        env = dict(base)
        bin_dir = str(self.nvcc.parent)
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", os.defpath)])
        env["CUDA_HOME"] = env["CUDA_PATH"] = str(self.cuda_home)
        env.pop("NVCC", None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.site), env.get("PYTHONPATH", "")) if p)
        return env


def ensure(pins: Sequence[WheelPin], *, cache: Cache, mirror: Path | None, log: Path) -> Hermetic:
    """The installed toolchain of ``pins``, installed now (atomically) if the cache lacks it."""
    sha = set_sha256(pins)
    found = Hermetic(root=cache.root / "toolchains" / sha, sha256=sha)
    if (found.root / "meta.json").is_file():
        return found
    with cache.lock(f"toolchain-{sha}"):
        if (found.root / "meta.json").is_file():
            return found
        print(f"hermetic toolchain: installing {len(pins)} pinned wheels into {found.root}, log: {log}", flush=True)
        with cache.staging(f"toolchain-{sha[:12]}") as tmp:
            requirements = tmp / "requirements.txt"
            requirements.write_text("".join(p.requirement() + "\n" for p in pins))
            proc.run(
                install_command(requirements, tmp / "site", mirror=mirror),
                env=_pip_env(),
                log=log,
                error=ToolchainError,
                what="install of the hermetic toolchain ([toolchain.hermetic] in the lock)",
            )
            staged = Hermetic(root=tmp, sha256=sha)
            if not staged.nvcc.is_file():
                raise ToolchainError(
                    f"the hermetic toolchain has no {CUDA_SUBDIR / 'bin' / 'nvcc'}: add nvidia-cuda-nvcc "
                    "(with nvidia-nvvm, nvidia-cuda-crt, nvidia-cuda-runtime, nvidia-cuda-cccl) of CUDA 13 "
                    "to [toolchain.hermetic] requirements"
                )
            # nvcc.profile and torch's cpp_extension look for the libraries (cudart_static,
            # cudadevrt) in lib64, where a CUDA install has them; the wheels have lib/.
            (staged.cuda_home / "lib64").symlink_to("lib")
            write_atomic(tmp / "meta.json", json.dumps(key_section(pins), indent=2, sort_keys=True) + "\n")
            cache.publish_dir(tmp, found.root)
    return found


def install_command(requirements: Path, target: Path, *, mirror: Path | None) -> list[str]:
    """pip installing exactly the hashed wheels of ``requirements`` into ``target``.

    From ``<mirror>/wheels`` only, when the mirror has that folder (an offline
    host); otherwise from the index pip is configured with.
    """
    cmd = [
        sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
        "--require-hashes", "--no-deps", "--only-binary=:all:", "--no-compile",
        "--target", str(target), "-r", str(requirements),
    ]  # fmt: skip
    if mirror is not None and (mirror / "wheels").is_dir():
        cmd += ["--no-index", "--find-links", str(mirror / "wheels")]
    return cmd


def _pip_env() -> dict[str, str]:
    """This process's environment for pip: the user's index settings, none of a build's."""
    env = dict(os.environ)
    env.pop("PIP_NO_INDEX", None)
    env.pop("PIP_TARGET", None)
    env.pop("PIP_PREFIX", None)
    env["PYTHONNOUSERSITE"] = "1"
    return env
