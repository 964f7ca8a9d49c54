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

`doit lock` fills in the hashes (:func:`lock_pin`): for a pin without
``--hash``, one per wheel of that exact version on the configured index that
installs on Linux x86_64 or aarch64 (manylinux, or pure Python) under a Python
of the lock's ``[toolchain] python`` range (:func:`wheel_fits`), read from the
index page's ``#sha256=`` fragments (a file without one is downloaded and
hashed). `doit mirror` copies exactly the files those hashes name into
``<mirror>/wheels`` (:func:`mirror_wheels`), each checked against the lock.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, Specifier, SpecifierSet
from packaging.tags import Tag
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

from tasks.core import net, proc
from tasks.core.errors import LockError, ToolchainError, VerificationError
from tasks.core.fsutil import rmtree, write_atomic
from tasks.core.treehash import file_sha256
from tasks.lock import pypi
from tasks.lock.lockfile import WheelPin
from tasks.store.cache import Cache

#: Bump when the layout of an installed toolchain changes.
LAYOUT_VERSION = 1
#: Where the CUDA component wheels put the toolkit, relative to the install target.
CUDA_SUBDIR = Path("nvidia") / "cu13"


def set_sha256(pins: Sequence[WheelPin], wheels: Sequence[tuple[str, str]] = ()) -> str:
    """The identity of a pinned set: its requirement lines, sorted, and its wheel sources (filename, sha256)."""
    doc: dict[str, object] = {"layout": LAYOUT_VERSION, "requirements": sorted(p.requirement() for p in pins)}
    if wheels:
        doc["wheels"] = sorted(f"{name} --hash=sha256:{sha}" for name, sha in wheels)
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def key_section(pins: Sequence[WheelPin], wheels: Sequence[tuple[str, str]] = ()) -> dict[str, object]:
    """What the action key records about the hermetic toolchain (``wheels``: its wheel sources' file names, sha256)."""
    section: dict[str, object] = {
        "sha256": set_sha256(pins, wheels),
        "requirements": sorted(p.requirement() for p in pins),
    }
    if wheels:
        section["wheels"] = sorted(f"{name} --hash=sha256:{sha}" for name, sha in wheels)
    return section


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
        """``base`` with this toolchain's CUDA first and every other nvcc hidden, and its site first on
        PYTHONPATH (a pinned torch there is the one builds import). Without CUDA wheels, only the latter."""
        env = dict(base)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(self.site), env.get("PYTHONPATH", "")) if p)
        if not self.nvcc.is_file():
            return env
        bin_dir = str(self.nvcc.parent)
        env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", os.defpath)])
        env["CUDA_HOME"] = env["CUDA_PATH"] = str(self.cuda_home)
        env.pop("NVCC", None)
        return env


def ensure(
    pins: Sequence[WheelPin],
    *,
    cache: Cache,
    mirror: Path | None,
    log: Path,
    wheels: Sequence[tuple[Path, str]] = (),
) -> Hermetic:
    """The installed toolchain of ``pins`` and the wheel files ``wheels`` ((path, sha256): the lock's wheel
    sources, verified), installed now (atomically) if the cache lacks it."""
    sha = set_sha256(pins, [(path.name, digest) for path, digest in wheels])
    found = Hermetic(root=cache.root / "toolchains" / sha, sha256=sha)
    if (found.root / "meta.json").is_file():
        return found
    with cache.lock(f"toolchain-{sha}"):
        if (found.root / "meta.json").is_file():
            return found
        count = len(pins) + len(wheels)
        print(f"hermetic toolchain: installing {count} pinned wheels into {found.root}, log: {log}", flush=True)
        with cache.staging(f"toolchain-{sha[:12]}") as tmp:
            requirements = tmp / "requirements.txt"
            lines = [p.requirement() for p in pins] + [f"{path} --hash=sha256:{digest}" for path, digest in wheels]
            requirements.write_text("".join(f"{line}\n" for line in lines))
            proc.run(
                install_command(requirements, tmp / "site", mirror=mirror),
                env=_pip_env(),
                log=log,
                error=ToolchainError,
                what="install of the hermetic toolchain ([toolchain.hermetic] in the lock)",
            )
            staged = Hermetic(root=tmp, sha256=sha)
            cuda = any(p.name.startswith("nvidia-cuda") for p in pins)
            if cuda and not staged.nvcc.is_file():
                raise ToolchainError(
                    f"the hermetic toolchain has no {CUDA_SUBDIR / 'bin' / 'nvcc'}: add nvidia-cuda-nvcc "
                    "(with nvidia-nvvm, nvidia-cuda-crt, nvidia-cuda-runtime, nvidia-cuda-cccl) of CUDA 13 "
                    "to [toolchain.hermetic] requirements"
                )
            # nvcc.profile and torch's cpp_extension look for the libraries (cudart_static,
            # cudadevrt) in lib64, where a CUDA install has them; the wheels have lib/.
            if staged.nvcc.is_file():
                (staged.cuda_home / "lib64").symlink_to("lib")
            section = key_section(pins, [(path.name, digest) for path, digest in wheels])
            write_atomic(tmp / "meta.json", json.dumps(section, indent=2, sort_keys=True) + "\n")
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


# --------------------------------------------------------------------------- doit lock, doit mirror

#: The machines `doit lock` hashes wheels for: Linux on these CPUs.
LOCK_ARCHES = ("x86_64", "aarch64")
#: manylinux platform tags (PEP 513, 571, 599 and 600) of those CPUs.
MANYLINUX_RE = re.compile(r"^manylinux(?:1|2010|2014|_\d+_\d+)_(?:x86_64|aarch64)$")
#: Python 3 interpreter tags: ``py3``, ``py3Y``, ``cp3Y``.
PY3_TAG_RE = re.compile(r"^(py|cp)3(\d*)$")


@functools.cache
def python_minors(python: str) -> frozenset[int]:
    """The minor versions ``Y`` of the Pythons 3.Y with a release inside the specifier ``python`` ('' = any)."""
    spec = SpecifierSet(python)
    return frozenset(y for y in range(100) if any(Version(f"3.{y}.{p}") in spec for p in range(30)))


def tag_fits(tag: Tag, minors: frozenset[int]) -> bool:
    """Whether pip on CPython 3.Y (Y in ``minors``), Linux x86_64 or aarch64 (glibc), accepts ``tag``."""
    if tag.platform != "any" and not MANYLINUX_RE.match(tag.platform):
        return False
    m = PY3_TAG_RE.match(tag.interpreter)
    if m is None:
        return False
    kind, digits = m.groups()
    least = int(digits) if digits else 0
    if kind == "py":  # py3 and py3Y: any CPython 3 (from 3.Y on)
        return tag.abi == "none" and any(y >= least for y in minors)
    if not digits:
        return False
    if tag.abi == "abi3":  # the stable ABI: CPython 3.Y and later
        return any(y >= least for y in minors)
    return tag.abi in ("none", f"cp3{least}", f"cp3{least}m") and least in minors


def _version_of(filename: str, project: str) -> Version | None:
    """The version of a wheel or sdist of ``project`` named ``filename``; None for other files."""
    try:
        if filename.endswith(".whl"):
            name, version, _build, _tags = parse_wheel_filename(filename)
        else:
            name, version = parse_sdist_filename(filename)
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None
    return version if name == canonicalize_name(project) else None


def wheel_fits(filename: str, *, project: str, version: str, python: str) -> bool:
    """Whether ``filename`` is a wheel of ``project`` ``==version`` that `doit lock` hashes.

    That is: a wheel (not an sdist) of exactly that version, as pip matches
    ``==version`` (a local label such as ``+cu130`` also matches), with a tag
    that pip accepts on CPython of the ``python`` range, on Linux x86_64 or
    aarch64: ``manylinux*_x86_64``/``manylinux*_aarch64`` or ``any`` platform,
    ``py3``/``py3Y`` (no ABI), ``cp3Y`` with ``abi3``, ``none`` or the ``cp3Y`` ABI.
    Other platforms (Windows, macOS, musllinux), PyPy and free-threaded CPython are left out.
    """
    if not filename.endswith(".whl"):
        return False
    try:
        name, found, _build, tags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return False
    if name != canonicalize_name(project) or not Specifier(f"=={version}").contains(found, prereleases=True):
        return False
    minors = python_minors(python)
    return any(tag_fits(tag, minors) for tag in tags)


def _describe_python(python: str) -> str:
    return f"Python {python}" if python else "Python 3"


def lock_pin(
    pin: WheelPin, *, python: str, work: Path, indexes: list[str] | None = None, where: str = "toolchain.hermetic"
) -> list[tuple[str, str]]:
    """``(filename, sha256)`` of each wheel `doit lock` pins for ``pin`` (see :func:`wheel_fits`).

    The sha256 comes from the index page's ``#sha256=`` fragment (PEP 503);
    a file listed without one is downloaded into ``work`` and hashed.
    """
    try:
        SpecifierSet(python)
    except InvalidSpecifier:
        raise LockError(f"[toolchain] python {python!r} is not a version specifier") from None
    requirement = f"{pin.name}=={pin.version}"
    files = pypi.project_files(pin.name, indexes)
    if not files.found:
        raise LockError(
            f"[{where}] {requirement}: no project {pin.name!r} on the package index "
            f"({', '.join(files.pages)}); check the name, or the index pip is configured with"
        )
    exact = Specifier(f"=={pin.version}")
    of_version = [
        link
        for link in files.links
        if (v := _version_of(link.filename, pin.name)) is not None and exact.contains(v, prereleases=True)
    ]
    if not of_version:
        versions = sorted({v for link in files.links if (v := _version_of(link.filename, pin.name)) is not None})
        shown = ", ".join(str(v) for v in versions[-10:]) or "none"
        raise LockError(
            f"[{where}] {requirement}: the package index has no file of version {pin.version} "
            f"({', '.join(files.found)}); its latest versions: {shown}"
        )
    chosen = sorted(
        (w for w in of_version if wheel_fits(w.filename, project=pin.name, version=pin.version, python=python)),
        key=lambda link: link.filename,
    )
    if not chosen:
        raise LockError(
            f"[{where}] {requirement}: no wheel for Linux {' or '.join(LOCK_ARCHES)} (manylinux) and "
            f"{_describe_python(python)} among its files on the package index: "
            f"{', '.join(sorted(link.filename for link in of_version))}"
        )
    pinned = []
    for link in chosen:
        sha = link.sha256
        if not sha:
            dest = work / link.filename
            net.download(link.url, dest)
            sha = file_sha256(dest)
            dest.unlink()
        pinned.append((link.filename, sha))
    return pinned


def mirror_wheels(
    pins: Sequence[WheelPin], *, python: str, mirror: Path, indexes: list[str] | None = None
) -> Iterator[str]:
    """Put the file of every hash the lock pins into ``<mirror>/wheels``; yield one line per file.

    A file already there with a pinned hash is kept; the others are looked up
    on the configured index, downloaded into a staging folder inside the
    mirror and checked against the lock's hashes. Only when every pinned hash
    has its file are the new files moved into ``wheels/``: on any error
    (a download whose sha256 is not the pinned one, a pinned hash no file of
    the index has) nothing is added, and the staging folder is removed.
    """
    dest = mirror / "wheels"
    mirror.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".wheels-staging.", dir=mirror))
    lines: list[str] = []
    try:
        staged: list[Path] = []
        for pin in pins:
            have = _mirrored(dest, pin)
            missing = set(pin.hashes) - set(have.values())
            if missing:
                indexes = indexes or pypi.pip_indexes()  # asked once, and only when a file is missing
                got = _download_pinned(pin, missing, python=python, staging=staging, indexes=indexes)
                staged.extend(staging / name for name in got)
                have.update(got)
            for name, sha in sorted(have.items()):
                if sha in pin.hashes:
                    new = (staging / name).exists()
                    lines.append(f"wheels/{name} sha256:{sha[:12]} ({'downloaded' if new else 'present'})")
        if staged:
            dest.mkdir(exist_ok=True)
            for path in staged:
                os.chmod(path, 0o644)
                os.replace(path, dest / path.name)
    finally:
        rmtree(staging)
    yield from lines


def _mirrored(dest: Path, pin: WheelPin) -> dict[str, str]:
    """filename -> sha256 of the wheels of ``pin`` already in ``dest`` whose hash the lock pins."""
    found = {}
    if dest.is_dir():
        for path in sorted(dest.glob("*.whl")):
            version = _version_of(path.name, pin.name)
            if version is not None and Specifier(f"=={pin.version}").contains(version, prereleases=True):
                sha = file_sha256(path)
                if sha in pin.hashes:
                    found[path.name] = sha
    return found


def _download_pinned(
    pin: WheelPin, missing: set[str], *, python: str, staging: Path, indexes: list[str] | None
) -> dict[str, str]:
    """Download the files of ``pin`` whose sha256 is in ``missing`` into ``staging``: filename -> sha256."""
    requirement = f"{pin.name}=={pin.version}"
    files = pypi.project_files(pin.name, indexes)
    exact = Specifier(f"=={pin.version}")
    wheels = [
        link
        for link in files.links
        if link.filename.endswith(".whl")
        and (v := _version_of(link.filename, pin.name)) is not None
        and exact.contains(v, prereleases=True)
    ]
    got: dict[str, str] = {}
    for link in sorted(wheels, key=lambda link: link.filename):
        if link.sha256 and link.sha256 not in missing:
            continue  # a file the lock does not pin (another platform), or one already mirrored
        if not link.sha256 and not wheel_fits(link.filename, project=pin.name, version=pin.version, python=python):
            continue  # no hash on the page: only the files `doit lock` would have hashed are worth downloading
        path = staging / link.filename
        net.download(link.url, path)
        sha = file_sha256(path)
        if link.sha256 and sha != link.sha256:
            raise VerificationError(
                f"[toolchain.hermetic] {requirement}: {link.url} downloaded with sha256 {sha}, but the lock "
                f"and the index pin {link.sha256}; nothing was added to the mirror"
            )
        if sha in missing:
            got[link.filename] = sha
        else:
            path.unlink()
    absent = sorted(missing - set(got.values()))
    if absent:
        listed = ", ".join(f"{link.filename} ({link.sha256 or 'no hash listed'})" for link in wheels) or "none"
        raise VerificationError(
            f"[toolchain.hermetic] {requirement}: no file on the package index has the pinned sha256 "
            f"{', '.join(absent)} (its wheels of that version: {listed}); nothing was added to the mirror. "
            "If the index is right and the lock is not, re-pin with `doit lock update=hermetic`"
        )
    return got
