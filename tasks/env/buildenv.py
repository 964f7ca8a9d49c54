"""Build environments: a venv of exactly a package's build closure (``[build.NAME]``), made once per closure.

Each is ``/tmp/reprostack-build/envs/<sha256>`` (one path wherever the cache is, like the staged trees'): a
``venv --without-pip`` of the build's interpreter into which the
closure's pinned pip installs every pinned wheel (itself included) with ``--require-hashes --no-deps
--no-index``, from files fetched by sha256 (the cache, the mirror's ``wheels/``, the index). It sees the
standard library, those wheels and, for a package that builds against torch, the base's directory holding
torch (after them on ``sys.path``: a pinned tool shadows the base's copy); nothing else of the host's
site-packages. Its identity hashes the pins, the interpreter and those directories; ``meta.json``, written
last, says it is whole. See docs/building.md, "Build environments".
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from tasks.core import proc
from tasks.core.errors import ToolchainError
from tasks.core.fsutil import rmtree, write_atomic
from tasks.env import closure
from tasks.env.reproducible import CANONICAL_ROOT
from tasks.lock.lockfile import WheelPin
from tasks.store.cache import Cache

#: Bump when the layout of a build environment changes.
LAYOUT_VERSION = 1
#: Where build environments are: one path on every host and for every cache, as the staged trees' (compilers
#: record the include directories, pybind11's among them, and ccache hashes them).
ENVS = Path(CANONICAL_ROOT) / "envs"
#: The file in the venv's site-packages naming the base's directories it sees.
BASE_PTH = "zz-reprostack-base.pth"


@dataclass(frozen=True)
class BuildEnv:
    root: Path
    sha256: str

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def bin(self) -> Path:
        return self.root / "bin"


def interpreter() -> tuple[str, str]:
    """The interpreter builds run with (the one under the tool's venv, if any) and its version."""
    base = getattr(sys, "_base_executable", "") or sys.executable
    return os.path.realpath(base), sys.version.split()[0]


@functools.cache
def torch_dirs() -> tuple[str, ...]:
    """The directories the base's torch and what it requires are installed in (in ``sys.path`` order; none without
    torch): what a build against torch must see of the base. A requirement installed beside torch is taken from
    there, not from a directory earlier on ``sys.path`` (the tool's own venv, which also has filelock)."""
    try:
        top = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        spec = importlib.util.find_spec("torch")
        return (str(Path(spec.origin).resolve().parent.parent),) if spec is not None and spec.origin else ()
    home = str(Path(str(top.locate_file(""))).resolve())

    def find(name: str) -> metadata.Distribution | None:
        """The distribution of ``name`` beside torch if it is there (the base's), else the first on sys.path."""
        beside = next(iter(metadata.distributions(name=name, path=[home])), None)
        if beside is not None:
            return beside
        try:
            return metadata.distribution(name)
        except metadata.PackageNotFoundError:
            return None

    dirs: set[str] = set()
    seen: set[str] = set()
    todo = [top]
    while todo:
        dist = todo.pop()
        name = str(canonicalize_name(dist.metadata["Name"] or ""))
        if name in seen:
            continue
        seen.add(name)
        dirs.add(str(Path(str(dist.locate_file(""))).resolve()))
        for line in dist.requires or []:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            found = find(req.name)
            if found is not None:
                todo.append(found)
    order = [str(Path(p).resolve()) for p in sys.path if p]
    return tuple(sorted(dirs, key=lambda d: order.index(d) if d in order else len(order)))


def env_sha256(pins: Sequence[WheelPin], *, base_dirs: Sequence[str] = ()) -> str:
    python, version = interpreter()
    doc = {
        "layout": LAYOUT_VERSION,
        "pins": sorted(p.requirement() for p in pins),
        "interpreter": python,
        "version": version,
        "base": list(base_dirs),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def ensure(
    pins: Sequence[WheelPin],
    *,
    cache: Cache,
    mirror: Path | None,
    log: Path,
    package: str,
    base_dirs: Sequence[str] = (),
) -> BuildEnv:
    """The build environment of ``pins`` (seeing ``base_dirs`` after them), made now if the cache lacks it."""
    from filelock import FileLock

    sha = env_sha256(pins, base_dirs=base_dirs)
    found = BuildEnv(ENVS / sha, sha)
    if (found.root / "meta.json").is_file():
        return found
    ENVS.mkdir(parents=True, exist_ok=True)
    with FileLock(str(ENVS / f"{sha}.lock")):
        if (found.root / "meta.json").is_file():
            return found
        files = _fetch(pins, cache=cache, mirror=mirror, package=package)
        print(f"build environment for {package}: {len(files)} pinned wheels into {found.root}", flush=True)
        rmtree(found.root)  # one a killed run left half made
        found.root.parent.mkdir(parents=True, exist_ok=True)
        python, _version = interpreter()
        env = _clean_env()
        proc.run([python, "-m", "venv", "--without-pip", str(found.root)], env=env, log=log, error=ToolchainError,
                 what=f"the build environment of {package} (python -m venv)")  # fmt: skip
        requirements = found.root / "requirements.txt"
        requirements.write_text("".join(f"{path} --hash=sha256:{sha}\n" for path, sha in files))
        pip = next((path for path, _sha in files if path.name.startswith("pip-")), None)
        if pip is None:
            raise ToolchainError(f"package {package}: its build closure pins no pip (run `doit lock`)")
        cmd = [
            str(found.python), f"{pip}/pip", "install", "--isolated", "--disable-pip-version-check", "--no-input",
            "--no-deps", "--no-index", "--require-hashes", "--only-binary=:all:", "-r", str(requirements),
        ]  # fmt: skip
        proc.run(cmd, env=env, log=log, error=ToolchainError,
                 what=f"the install of {package}'s build closure ([build.{package}] in the lock)")  # fmt: skip
        if base_dirs:
            (_site(found) / BASE_PTH).write_text("".join(f"{d}\n" for d in base_dirs))
        meta = {"pins": sorted(p.requirement() for p in pins), "base": list(base_dirs), "package": package}
        write_atomic(found.root / "meta.json", json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return found


def _site(env: BuildEnv) -> Path:
    return env.root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"


def _fetch(pins: Sequence[WheelPin], *, cache: Cache, mirror: Path | None, package: str) -> list[tuple[Path, str]]:
    """One file of each pin for this interpreter, sha256 checked: the cache's, the mirror's or the index's."""
    target = closure.host_target()
    out = []
    for pin in pins:
        path = closure.fetch(
            closure.Pin(pin.name, pin.version, pin.hashes),
            cache.fetched,
            mirror=mirror,
            indexes=None,  # the index pip is configured with, asked only for a file neither cache nor mirror has
            target=target,
            section=f"build.{package}",
        )
        out.append((path, path.parent.name))
    return out


def _clean_env() -> dict[str, str]:
    """This process's environment without what would steer pip or Python elsewhere."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env
