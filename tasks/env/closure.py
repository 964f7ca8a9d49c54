"""The runtime closure: ``[runtime]`` resolved into exact, hash-pinned wheels for the lock's target.

`doit lock` resolves the environment's top-level requirements, with the wheels we build and the
packages the target already provides standing in as fixed, into every distribution the environment
needs; pip's own resolver does it (``pip install --dry-run --report`` for the target's Python and
platforms), nothing here resolves. What the target provides (``[runtime] provided``, and our own
built or prebuilt wheels) enters the resolution as stub wheels of exactly that version without any
requirement of their own, in a find-links directory: a stub's version carries the local label
``+provided``, which sorts above the public version, so pip takes the stub, and neither it nor its
dependencies enter the closure. Each pinned version then gets the sha256 of every file of it that
installs on the target, from the index pages (PEP 503 ``#sha256=`` fragments, as for the hermetic
toolchain).

`doit wheels` fetches one file per pin into the cache (``<cache>/fetched/<sha256>/<file>``: a mismatch
is refused, nothing kept) and checks that every built wheel's ``Requires-Dist`` is met by the
closure, the provided set and the other built wheels.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import re
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import Specifier
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from tasks.core import net, proc
from tasks.core.console import warn
from tasks.core.errors import ImageError, LockError, VerificationError
from tasks.core.fsutil import rmtree
from tasks.core.treehash import file_sha256
from tasks.env import docker
from tasks.lock import pypi
from tasks.lock.lockfile import Runtime
from tasks.store.cache import temporary_dir
from tasks.store.simple_index import wheel_metadata, wheel_problem

#: The manylinux tags of glibc 2.28 down to 2.5 on x86_64, newest first: the default target platforms.
DEFAULT_PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)),
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
)
STUB_LABEL = "provided"
#: Run in the base's interpreter (standard library only) to capture what it holds.
CAPTURE_SCRIPT = Path(__file__).resolve().parents[1] / "outside" / "capture_base.py"


@dataclass(frozen=True)
class Target:
    """The interpreter and platforms the closure installs on: CPython ``python`` (``3.12``) on ``platforms``."""

    python: str
    platforms: tuple[str, ...] = DEFAULT_PLATFORMS

    @property
    def version(self) -> tuple[int, int]:
        major, minor = self.python.split(".")[:2]
        return int(major), int(minor)

    @property
    def abi(self) -> str:
        return f"cp{self.version[0]}{self.version[1]}"

    @functools.cached_property
    def tags(self) -> frozenset[Tag]:
        return frozenset(
            [
                *cpython_tags(self.version, abis=[self.abi, "abi3", "none"], platforms=list(self.platforms)),
                *compatible_tags(self.version, self.abi, list(self.platforms)),
            ]
        )

    def fits(self, filename: str) -> bool:
        """Whether pip on the target would install the wheel ``filename``."""
        try:
            _name, _version, _build, tags = parse_wheel_filename(filename)
        except InvalidWheelFilename:
            return False
        return not tags.isdisjoint(self.tags)

    def environment(self) -> dict[str, str]:
        """PEP 508 marker values of the target (for the Requires-Dist of our wheels)."""
        env: dict[str, str] = {k: str(v) for k, v in default_environment().items()}
        machine = "aarch64" if any("aarch64" in p for p in self.platforms) else "x86_64"
        env.update(
            python_version=self.python,
            python_full_version=f"{self.python}.0",
            implementation_name="cpython",
            platform_python_implementation="CPython",
            implementation_version=f"{self.python}.0",
            sys_platform="linux",
            platform_system="Linux",
            os_name="posix",
            platform_machine=machine,
        )
        return env

    def pip_options(self) -> list[str]:
        options = ["--only-binary=:all:", "--python-version", self.python, "--implementation", "cp", "--abi", self.abi]
        for tag in self.platforms:
            options += ["--platform", tag]
        return options


def host_target(python: str = "") -> Target:
    """CPython ``python`` (default: this one) on this machine's CPU, with the default manylinux tags."""
    python = python or f"{sys.version_info[0]}.{sys.version_info[1]}"
    machine = platform.machine() or "x86_64"
    return Target(python, tuple(p.replace("x86_64", machine) for p in DEFAULT_PLATFORMS))


def target_of(runtime: Runtime) -> Target:
    """The target of a lock's ``[runtime]``."""
    return Target(runtime.python, runtime.platforms or DEFAULT_PLATFORMS)


@dataclass(frozen=True, order=True)
class Pin:
    """One distribution of the closure: its exact version and the sha256 of each file the target takes."""

    name: str
    version: str
    hashes: tuple[str, ...] = ()

    def requirement(self) -> str:
        return " ".join([f"{self.name}=={self.version}", *(f"--hash=sha256:{h}" for h in self.hashes)])


#: The version a stub takes for a provided distribution named without one ("whatever the target has"):
#: high, so that a requirement with a lower bound takes the stub rather than an index's real one.
ANY_VERSION = "999999"


def stub_wheel(directory: Path, name: str, version: str, requires: Sequence[str] = ()) -> Path:
    """A wheel of ``name`` at ``version`` (+provided unless it has a local label) requiring ``requires`` only
    (nothing for a hand-written provided entry; the distribution's own Requires-Dist for one captured from
    the base, so that the resolution keeps every requirement of the base)."""
    version = version or ANY_VERSION
    stub_version = version if "+" in version else f"{version}+{STUB_LABEL}"
    dist = re.sub(r"[-.]+", "_", name)
    path = directory / f"{dist}-{stub_version}-py3-none-any.whl"
    info = f"{dist}-{stub_version}.dist-info"
    lines = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {stub_version}\n{lines}")
        zf.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: reprostack\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(f"{info}/RECORD", "")
    return path


class ResolutionFailed(LockError):
    """pip found no set of versions for the target; the message carries pip's reason."""


def resolve(
    requirements: Sequence[str],
    fixed: Mapping[str, str],
    target: Target,
    *,
    constraints: Sequence[str] = (),
    log: Path,
    where: str = "runtime",
    base: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, str]:
    """name -> version of every distribution the requirements need on the target, but the ``fixed`` ones.

    ``fixed`` maps the distributions the target already has (provided, or built by us) to their
    versions; ``constraints`` are extra ``name==version`` lines (the lock's earlier pins); ``where`` is
    the lock's section, for the error. ``base`` maps the distributions captured from the base's
    interpreter to their own requirements: each enters the resolution with them, so that nothing the
    closure brings breaks a requirement of the base (pip refuses, naming both).
    """
    base = base or {}
    with tempfile.TemporaryDirectory(prefix="reprostack-resolve-") as tmp:
        work = Path(tmp)
        stubs = work / "stubs"
        stubs.mkdir()
        for name, version in fixed.items():
            stub_wheel(stubs, name, version, base.get(name, ()))
        requirements = [*requirements, *sorted(n for n in base if n in fixed)]
        (work / "requirements.in").write_text("".join(f"{r}\n" for r in requirements))
        pins = [f"{name}=={version.split('+')[0]}" for name, version in fixed.items() if version]
        (work / "constraints.txt").write_text("".join(f"{c}\n" for c in [*pins, *constraints]))
        cmd = [
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",  # not --quiet: pip
            # says the causes of a conflict ("The conflict is caused by: ...") at its default level only
            "--disable-pip-version-check", "--no-input", "--report", str(work / "report.json"),
            "--timeout", f"{net.timeout():g}",  # REPRO_NET_TIMEOUT, as every other network operation
            *target.pip_options(), "--target", str(work / "target"), "--find-links", str(stubs),
            "-r", str(work / "requirements.in"), "-c", str(work / "constraints.txt"),
        ]  # fmt: skip
        env = dict(os.environ)
        for name in ("PIP_NO_INDEX", "PIP_TARGET", "PIP_PREFIX", "PIP_REQUIRE_VIRTUALENV", "PIP_USER"):
            env.pop(name, None)
        log.parent.mkdir(parents=True, exist_ok=True)
        res = proc.query(cmd, env=env, text=True)
        log.write_text(f"$ {' '.join(cmd)}\n{res.stdout}{res.stderr}")
        if res.returncode != 0:
            reason = _pip_reason(res.stderr + _conflict(res.stdout), target, where)
            raise ResolutionFailed(reason + _base_side(reason, base, fixed) + f"\n(pip's output: {log})")
        report = json.loads((work / "report.json").read_text())
    found: dict[str, str] = {}
    fixed_names = {canonicalize_name(n) for n in fixed}
    for item in report.get("install", []):
        name = str(canonicalize_name(item["metadata"]["name"]))
        version = str(item["metadata"]["version"])
        if name in fixed_names or version.endswith(f"+{STUB_LABEL}"):
            continue
        found[name] = version
    return dict(sorted(found.items()))


def _base_side(reason: str, base: Mapping[str, Sequence[str]], fixed: Mapping[str, str]) -> str:
    """The base's side of a conflict pip reports as a constraint: which distributions of the base require
    what the closure would change, and the version the base holds."""
    lines = []
    for target in sorted({str(canonicalize_name(m)) for m in re.findall(r"depends on ([A-Za-z0-9._-]+)", reason)}):
        for name, requires in sorted(base.items()):
            for line in requires:
                req = Requirement(line)
                if canonicalize_name(req.name) == target and (req.marker is None or "extra" not in str(req.marker)):
                    lines.append(f"{name} {fixed.get(name, '?')} (installed in the base) requires {line}")
        if target in base:
            lines.append(f"the base holds {target} {fixed.get(target, '?')}, which the closure may not replace")
    return "".join(f"\n  {line}" for line in lines)


def _conflict(stdout: str) -> str:
    """pip's "The conflict is caused by:" block (it prints it to stdout), which names both sides."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("The conflict is caused by")), None)
    if start is None:
        return ""
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.strip() or line.strip().startswith("To fix this"):
            break
        block.append(line)
    return "\n" + "\n".join(block) + "\n"


def _pip_reason(stderr: str, target: Target, where: str) -> str:
    """The lines of pip's error that say what could not be resolved."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    wanted = [
        line
        for line in lines
        if line.startswith(("ERROR:", "The conflict is caused by", "    "))
        or "requires" in line
        or "depends on" in line
    ]
    shown = "\n  ".join((wanted or lines)[-12:]).replace(f"+{STUB_LABEL}", " (installed in the base)")
    return f"[{where}] cannot be resolved for CPython {target.python} on {target.platforms[0]}:\n  {shown}"


def capture_base(
    python: str, *, log: Path, image: str = "", capture: Path | None = None
) -> tuple[str, dict[str, tuple[str, list[str]]]]:
    """The base's CPython (``3.12``) and what it has installed: canonical name -> (version, its Requires-Dist).

    From ``capture``, a document tasks/outside/capture_base.py wrote on the node (``[runtime] base_capture``); else
    by running that script in ``python``, in the image ``image`` where one is named (``base_image``: no
    network, the script mounted read-only), or on this host (``base_python``)."""
    what = f"[runtime] base_capture = {str(capture)!r}" if capture else (
        f"[runtime] base_image = {image!r}" if image else f"[runtime] base_python = {python!r}")  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    if capture is not None:
        try:
            text = capture.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise LockError(f"{what} cannot be read: {exc}") from None
    elif image:
        text = _capture_in_image(image, python or "python3", log=log, what=what)
    else:
        cmd = [python, str(CAPTURE_SCRIPT)]
        try:
            res = proc.query(cmd, timeout=300, text=True)
        except (OSError, proc.TimeoutExpired) as exc:
            raise LockError(f"{what} cannot be run: {exc}") from None
        log.write_text(f"$ {' '.join(cmd)}\n{res.stdout}{res.stderr}")
        if res.returncode != 0:
            raise LockError(f"{what} failed (Python 3.8 or newer is needed); see {log}")
        text = res.stdout
    return _parse_capture(text, what)


def _capture_in_image(image: str, python: str, *, log: Path, what: str) -> str:
    with tempfile.TemporaryDirectory(prefix="repro-base-") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        try:
            docker.run_container(
                image, ["/repro/capture_base.py", "/out/base.json"], log=log, what=f"{what} (capture)",
                mounts=[(CAPTURE_SCRIPT, "/repro/capture_base.py", True), (out, "/out", False)],
                user=docker.current_user(), extra=["--entrypoint", python],
            )  # fmt: skip
            return (out / "base.json").read_text(encoding="utf-8")
        except (ImageError, OSError) as exc:
            raise LockError(f"{what}: the capture in the image failed ({exc}); see {log}") from None


def _parse_capture(text: str, what: str) -> tuple[str, dict[str, tuple[str, list[str]]]]:
    try:
        doc = json.loads(text)
        python, dists = str(doc["python"]), doc["dists"]
        items = [(str(n), str(v), [str(r) for r in reqs]) for n, (v, reqs) in dists.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LockError(
            f"{what} is not a capture of tasks/outside/capture_base.py ({type(exc).__name__}: {exc})"
        ) from None
    found: dict[str, tuple[str, list[str]]] = {}
    for name, version, requires in items:
        try:
            Version(version)
        except InvalidVersion:
            continue  # pip could not pin it either
        found[str(canonicalize_name(name))] = (version, [r for r in requires if _valid(r)])
    return python, dict(sorted(found.items()))


def _valid(line: str) -> bool:
    try:
        Requirement(line)
    except InvalidRequirement:
        return False
    return True


def provided_needs(
    requires: Mapping[str, Sequence[str]], provided: Mapping[str, Sequence[str]], target: Target
) -> dict[str, list[str]]:
    """key (a wheel) -> the provided distributions it needs, each as a requirement: its name and the version
    specifiers of every requirement that reached it (``typing-extensions>=4.10.0``; a bare name where none asks
    for a version): those its ``requires`` name, then, through each of those's own requirements (``provided``:
    canonical name -> its Requires-Dist; one with none known is followed no further), what they need of the
    provided set, with the extras asked for; markers evaluated for the target.

    What `doit preflight` and isolated `doit verify` hold a node to: a provided distribution no wheel needs may
    differ from the captured base without breaking the wheels, and one they need at a version every requirement
    on the way accepts."""
    env = target.environment()
    needs_of: dict[str, list[str]] = {}
    for key, lines in requires.items():
        needs: dict[str, set[str]] = {}
        followed: set[tuple[str, str]] = set()
        todo = [(line, "") for line in lines]
        while todo:
            line, extra = todo.pop()
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
                continue
            name = str(canonicalize_name(req.name))
            if name not in provided:
                continue
            needs.setdefault(name, set()).update(str(spec) for spec in req.specifier)
            for asked in ["", *sorted(req.extras)]:
                if (name, asked) not in followed:
                    followed.add((name, asked))
                    todo += [(sub, asked) for sub in provided[name]]
        needs_of[key] = [name + ",".join(sorted(specs)) for name, specs in sorted(needs.items())]
    return needs_of


def provided_requirements(runtime: Runtime, lock_dir: Path, *, log: Path) -> tuple[dict[str, list[str]], str]:
    """canonical name -> the Requires-Dist of each provided distribution, and where they were read: the base's
    capture (``base_capture``'s file, or ``base_python`` run again), else this interpreter's installed
    distributions of the provided versions (``base_image``, a provided set written by hand); a distribution found
    in neither has none."""
    versions = runtime.provided_versions
    source = ""
    if runtime.base_capture or (runtime.base_python and not runtime.base_image):
        capture = lock_dir / runtime.base_capture if runtime.base_capture else None
        try:
            _python, base = capture_base(runtime.base_python, log=log, capture=capture)
        except LockError as exc:
            warn(f"the base's requirements for preflight.json: {exc.message}; this interpreter's distributions "
                 "stand in")  # fmt: skip
        else:
            source = runtime.base_capture or runtime.base_python
            return {name: list(base[name][1]) if name in base else [] for name in versions}, source
    found: dict[str, list[str]] = {}
    for dist in importlib.metadata.distributions():
        name = str(canonicalize_name(dist.metadata["Name"] or ""))
        if name in versions and name not in found and _same_public(dist.version, versions[name]):
            found[name] = list(dist.requires or [])
    return {name: found.get(name, []) for name in versions}, "this interpreter's installed distributions"


def _same_public(installed: str, pinned: str) -> bool:
    if not pinned:
        return True
    try:
        return Version(installed).public == Version(pinned).public
    except InvalidVersion:
        return installed == pinned


def file_hashes(name: str, version: str, target: Target, *, work: Path, indexes: list[str] | None) -> list[str]:
    """The sha256 of every file of ``name==version`` the target installs, from the index pages."""
    files = pypi.project_files(name, indexes)
    exact = Specifier(f"=={version}")
    chosen = []
    for link in files.links:
        try:
            wheel_name, wheel_version, _b, _t = parse_wheel_filename(link.filename)
        except InvalidWheelFilename:
            continue
        if (
            wheel_name == canonicalize_name(name)
            and exact.contains(wheel_version, prereleases=True)
            and target.fits(link.filename)
        ):
            chosen.append(link)
    if not chosen:
        listed = ", ".join(sorted(link.filename for link in files.links)[-8:]) or "none"
        raise LockError(
            f"[runtime] {name}=={version}: no wheel of it for CPython {target.python} on the target's platforms on "
            f"the package index ({', '.join(files.pages) or 'no page'}); files there: {listed}"
        )
    hashes = set()
    for link in chosen:
        sha = link.sha256
        if not sha:  # an index without #sha256= fragments: download and hash
            dest = work / link.filename
            net.download(link.url, dest)
            sha = file_sha256(dest)
            dest.unlink()
        hashes.add(sha)
    return sorted(hashes)


def requires_dist(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA."""
    try:
        _where, meta = wheel_metadata(wheel)
    except ValueError:
        return []
    return [value.strip() for value in meta.get_all("Requires-Dist", [])]


def unmet(requires: Iterable[str], available: Mapping[str, str], target: Target) -> list[str]:
    """The requirements of ``requires`` that ``available`` (name -> version) does not meet on the target."""
    env = target.environment()
    missing = []
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        version = available.get(canonicalize_name(req.name))
        if version is None:
            missing.append(f"{line} (not in the closure)")
            continue
        if not version:
            continue  # provided by the target, whatever its version
        try:
            ok = req.specifier.contains(Version(version), prereleases=True) or _same_unlabelled(req, version)
        except InvalidVersion:
            ok = False
        if not ok:
            missing.append(f"{line} (the closure has {version})")
    return missing


def _same_unlabelled(req: Requirement, version: str) -> bool:
    """Whether ``version``, written without a local label (a hand-written ``provided = ["torch==2.11.0"]``), is
    the public version every ``==`` of ``req`` names with one (``torch==2.11.0+cu130``, our wheels' pin): the
    label is then unknown here, and `doit preflight` checks it on the node."""
    specs = list(req.specifier)
    if "+" in version or not specs:
        return False
    return all(s.operator == "==" and "+" in s.version and Version(s.version).public == version for s in specs)


def fetch(
    pin: Pin, store: Path, *, mirror: Path | None, indexes: list[str] | None, target: Target, section: str = "runtime"
) -> Path:
    """One file of ``pin`` in ``store`` (``<sha256>/<file>``): the store's, the mirror's, or downloaded.

    Whatever the origin, the file's sha256 must be one the lock pins: a stored file is hashed again
    before it is used (one changed since it was stored is discarded and fetched again, as
    :meth:`tasks.store.cache.Cache.fetched_wheel` does), and a fetched one that differs is refused, nothing kept.
    """
    for sha in pin.hashes:
        folder = store / sha
        for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
            if file_sha256(path) == sha:
                _refuse_unless_of(path, pin, sha, f"cached as {path.name}", section)
                return path
            warn(f"corrupted fetched wheel {path}: its sha256 changed; discarded, it is fetched again")
            rmtree(folder)
            break
    candidates: list[tuple[str, str]] = []  # (source, filename)
    if mirror is not None and (mirror / "wheels").is_dir():
        for path in sorted((mirror / "wheels").glob("*.whl")):
            if _is_of(path.name, pin) and target.fits(path.name):
                candidates.append((str(path), path.name))
    if not candidates:
        files = pypi.project_files(pin.name, indexes)
        for link in sorted(files.links, key=lambda link: link.filename):
            if (
                _is_of(link.filename, pin)
                and target.fits(link.filename)
                and (not link.sha256 or link.sha256 in pin.hashes)
            ):
                candidates.append((link.url, link.filename))
    if not candidates:
        raise VerificationError(
            f"[{section}] {pin.name}=={pin.version}: no file with a pinned sha256 in the mirror or on the package "
            "index; run `doit mirror` where the index is reachable, or re-pin with "
            f"`doit lock update={_update(section)}`"
        )
    with temporary_dir(store, ".fetch-") as tmp:  # held by this run; one a killed run left, the next removes
        for origin, filename in candidates:
            dest = tmp / filename
            net.download(origin, dest)
            sha = file_sha256(dest)
            if sha not in pin.hashes:
                raise VerificationError(
                    f"[{section}] {pin.name}=={pin.version}: {origin} has sha256 {sha}, which the lock does not pin "
                    f"({', '.join(h[:12] for h in pin.hashes)}); refusing it, nothing was kept"
                )
            _refuse_unless_of(dest, pin, sha, f"from {origin}", section)
            final = store / sha
            final.mkdir(parents=True, exist_ok=True)
            os.chmod(dest, 0o644)
            os.replace(dest, final / filename)
            (final / "origin").write_text(origin + "\n")
            return final / filename
    raise AssertionError("unreachable")  # pragma: no cover


def _update(section: str) -> str:
    """The ``update=`` of `doit lock` that re-pins ``section``."""
    return "build" if section.startswith("build") else "runtime"


def _refuse_unless_of(path: Path, pin: Pin, sha: str, where: str, section: str = "runtime") -> None:
    """VerificationError unless ``path`` is a wheel of ``pin``'s project at its version, by its file name and
    its own METADATA: a pin's sha256 repointed at another wheel (another pin's, an older version's) is refused
    whether that wheel comes from the cache, the mirror or the index."""
    problem = wheel_problem(path, pin.name, pin.version)
    if problem is not None:
        raise VerificationError(
            f"[{section}] {pin.name}=={pin.version}: the file of its pinned sha256 {sha[:12]}… ({where}) "
            f"is not a wheel of {pin.name} {pin.version}: {problem}; the pin names another wheel, nothing of it is "
            f"placed: re-pin with `doit lock update={_update(section)}`"
        )


def _is_of(filename: str, pin: Pin) -> bool:
    try:
        name, version, _b, _t = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return False
    return name == canonicalize_name(pin.name) and Specifier(f"=={pin.version}").contains(version, prereleases=True)
