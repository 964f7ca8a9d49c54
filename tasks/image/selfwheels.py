"""The tool's own wheels: reprostack and the distributions it runs on, for a host without network.

`doit mirror` and `doit bundle` put them in ``tool/`` beside what they carry for the lock, with a
hash-pinned ``requirements.txt``, so the build host installs the tool itself offline::

    python3 -m venv .venv
    .venv/bin/pip install --no-index --find-links tool --require-hashes -r tool/requirements.txt

The wheels are written from the installed distributions this process runs on (the versions
pyproject.toml pins, the ones the tests ran with), not downloaded: a dependency is repacked from the
files its ``RECORD`` lists (compiled bytecode left out) with its own ``WHEEL`` tags; reprostack
itself from the ``tasks`` package this process imported, with its installed metadata. Each wheel is
normalised (tasks/store/wheelnorm.py), so the same installation gives the same bytes and hashes.

A wheel built for one Python (charset-normalizer's mypyc build: ``cp311``) installs on that Python only.
For each other CPython named (``tool_python=3.12,3.13``; by default the lock's ``[runtime] python``),
the same version's wheel for that Python is downloaded by pip (``pip download --only-binary=:all:
--python-version 3.12 --platform ...``) into the cache's ``fetched/<sha256>/`` (kept, so a later run
without network still has it), and its sha256 joins the requirement's line: one requirements file,
several hashes per line, and pip takes the file that fits the Python it runs on.

The pins come only from what this process knows: the wheels it writes itself, and the ones pip downloaded
into its cache (trusted as the cache is, docs/security.md). A file found in the destination is never
pinned for being there: one whose bytes differ from the wheel of that name is replaced, and said so, and a
wheel there that is none of the tool's is removed.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.requirements import Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from tasks.core import proc
from tasks.core.errors import FetchError, ReproError
from tasks.core.fsutil import write_atomic
from tasks.core.treehash import file_sha256
from tasks.store.wheelnorm import normalize_wheel

if TYPE_CHECKING:
    from tasks.env.closure import Target

TOOL = "reprostack"
#: Metadata files of an installed distribution that are the installer's, not the wheel's.
_INSTALLER_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}


def closure(
    root: str = TOOL,
    environments: tuple[dict[str, str], ...] = (),
    elsewhere: dict[str, Requirement] | None = None,
) -> list[importlib.metadata.Distribution]:
    """``root`` and every distribution its requirements (no extras) need, installed; markers evaluated here and
    in each of ``environments`` (another Python's marker values): a distribution any of them needs is in. One
    that only another Python needs and that is not installed here (``typing_extensions; python_version <
    "3.13"`` seen from 3.13) goes to ``elsewhere`` (canonical name -> requirement) instead."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo: list[tuple[str, frozenset[str], Requirement | None]] = [(root, frozenset(), None)]
    while todo:
        name, extras, only_elsewhere = todo.pop()
        key = canonicalize_name(name)
        if key in seen and not extras:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            if only_elsewhere is not None and elsewhere is not None:
                elsewhere[key] = only_elsewhere
                continue
            raise ReproError(
                f"{name} is not installed here, and the tool needs it: install the tool with its dependencies on "
                "this host's Python (pip install reprostack) before writing the tool's wheels"
            ) from None
        seen[key] = dist
        if elsewhere is not None:
            elsewhere.pop(key, None)
        for raw in dist.requires or []:
            req = Requirement(raw)
            here = [{"extra": e} for e in (extras or {""})]
            there = [{**env, "extra": e} for env in environments for e in (extras or {""})]
            if req.marker is None or any(req.marker.evaluate(env) for env in here):
                todo.append((req.name, frozenset(req.extras), None))
            elif any(req.marker.evaluate(env) for env in there):
                todo.append((req.name, frozenset(req.extras), req))
    return sorted(seen.values(), key=lambda d: canonicalize_name(d.metadata["Name"]))


def _wheel_tag(dist: importlib.metadata.Distribution) -> str:
    """The compressed tag set of the wheel ``dist`` was installed from (its ``WHEEL`` file's Tag lines)."""
    tags = [
        line.split(":", 1)[1].strip()
        for line in (dist.read_text("WHEEL") or "").splitlines()
        if line.startswith("Tag:")
    ]
    if not tags:
        raise ReproError(f"{dist.metadata['Name']}: installed without a WHEEL file, so it cannot be carried as a wheel")
    parts: list[list[str]] = [[], [], []]
    for tag in tags:
        for i, piece in enumerate(tag.split("-")):
            if piece not in parts[i]:
                parts[i].append(piece)
    return "-".join(".".join(p) for p in parts)


def _dist_files(dist: importlib.metadata.Distribution) -> Iterator[tuple[str, Path]]:
    """(name in the wheel, file here) of an installed distribution, from its RECORD."""
    files = dist.files
    if files is None:
        raise ReproError(f"{dist.metadata['Name']}: its installation lists no files (no RECORD); reinstall it with pip")
    site = Path(str(dist.locate_file(""))).resolve()
    schemes = {key: Path(sysconfig.get_paths()[key]).resolve() for key in ("scripts", "data")}
    scripts = {ep.name for ep in dist.entry_points if ep.group in ("console_scripts", "gui_scripts")}
    data = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}.data"
    for entry in files:
        path = Path(str(dist.locate_file(entry))).resolve()
        rel = entry.as_posix()
        if "__pycache__/" in rel or rel.endswith(".pyc") or not path.is_file():
            continue
        if rel.split("/", 1)[0].endswith(".dist-info") and entry.name in _INSTALLER_FILES:
            continue
        if path.is_relative_to(site):
            yield path.relative_to(site).as_posix(), path
        elif path.is_relative_to(schemes["scripts"]):
            if path.name not in scripts:  # entry-point scripts are the installer's to write
                yield f"{data}/scripts/{path.name}", path
        elif path.is_relative_to(schemes["data"]):
            yield f"{data}/data/{path.relative_to(schemes['data']).as_posix()}", path


def _own_files(dist: importlib.metadata.Distribution) -> Iterator[tuple[str, Path | bytes]]:
    """reprostack's wheel contents: the imported ``tasks`` package and the installed metadata."""
    import tasks

    package = Path(tasks.__file__).resolve().parent
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package)
        if path.is_file() and "__pycache__" not in rel.parts and path.suffix != ".pyc":
            yield f"tasks/{rel.as_posix()}", path
    if not (package / "docker").is_dir():  # a checkout: tasks.docker is its docker/ (pyproject.toml)
        from tasks.image.image import tool_docker_dir

        docker = tool_docker_dir()
        for path in sorted(docker.iterdir()) if docker is not None else []:
            if path.is_file():
                yield f"tasks/docker/{path.name}", path
    _check_current(dist, package.parent / "pyproject.toml")
    info = f"{TOOL}-{dist.version}.dist-info"
    metadata = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    yield f"{info}/METADATA", metadata.encode()
    yield f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: reprostack\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    yield f"{info}/entry_points.txt", (dist.read_text("entry_points.txt") or "").encode()
    yield f"{info}/top_level.txt", b"tasks\n"


def _check_current(dist: importlib.metadata.Distribution, pyproject: Path) -> None:
    """In a checkout, the installed metadata (an editable install's .dist-info) must still be pyproject.toml's:
    one made before a command or dependency was added would give a tool wheel without them (seen: a
    bundle's tool installed with no ``reprostack`` command)."""
    if not pyproject.is_file():
        return
    import tomllib

    from tasks.core.errors import ReproError

    project = tomllib.loads(pyproject.read_text()).get("project", {})
    scripts = {ep.name for ep in dist.entry_points if ep.group == "console_scripts"}
    wanted = set(project.get("scripts", {}))
    requires = {r.split(";")[0].replace(" ", "") for r in dist.requires or [] if "extra ==" not in r}
    needed = {d.replace(" ", "") for d in project.get("dependencies", [])}
    stale = []
    if wanted - scripts:
        stale.append(f"commands {', '.join(sorted(wanted - scripts))}")
    if needed - requires:
        stale.append(f"dependencies {', '.join(sorted(needed - requires))}")
    if project.get("version", dist.version) != dist.version:
        stale.append(f"version {project['version']}")
    if stale:
        raise ReproError(
            f"the installed {TOOL} {dist.version} lacks what {pyproject} now says ({'; '.join(stale)}): "
            "reinstall it (bash scripts/bootstrap.sh) before writing the tool's wheels"
        )


def _write_wheel(dest: Path, files: Iterator[tuple[str, Path | bytes]]) -> None:
    """A wheel at ``dest`` from (name, file or bytes); normalised, RECORD regenerated."""
    with tempfile.TemporaryDirectory(prefix=".tool-wheel-", dir=dest.parent) as tmp:
        raw = Path(tmp) / dest.name
        info_dir = ""
        with zipfile.ZipFile(raw, "w") as zout:
            for name, content in files:
                data = content if isinstance(content, bytes) else content.read_bytes()
                mode = 0o755 if not isinstance(content, bytes) and os.access(content, os.X_OK) else 0o644
                item = zipfile.ZipInfo(name)
                item.external_attr = (0o100000 | mode) << 16
                zout.writestr(item, data)
                if name.count("/") == 1 and name.split("/")[0].endswith(".dist-info"):
                    info_dir = name.split("/")[0]
            zout.writestr(f"{info_dir}/RECORD", "")  # regenerated by normalize_wheel
        normalize_wheel(raw, dest)


def this_python() -> str:
    """This interpreter's CPython version, ``3.11``."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def default_platforms() -> tuple[str, ...]:
    """The manylinux tags the tool's downloaded wheels are chosen for when the lock names none: those of
    tasks/env/closure.py's default target (glibc 2.28 down to 2.5), for this machine's architecture."""
    from tasks.env.closure import DEFAULT_PLATFORMS

    machine = platform.machine() or "x86_64"
    return tuple(p.replace("x86_64", machine) for p in DEFAULT_PLATFORMS)


def _publish(path: Path, dest: Path, notes: list[str], *, copy: bool = False) -> None:
    """Move (``copy``: copy, for a file of the cache) ``path`` to ``dest``, keeping a ``dest`` of the same bytes
    and replacing, with a note, one that differs: what the destination held is never pinned for being there."""
    sha = file_sha256(path)
    if dest.is_file() and not dest.is_symlink():
        found = file_sha256(dest)
        if found == sha:
            return
        notes.append(
            f"replaced {dest}: its sha256 {found[:12]}… is not the tool's wheel of that name "
            f"({sha[:12]}…); altered or stale, it was not pinned"
        )
    elif dest.exists() or dest.is_symlink():
        notes.append(f"replaced {dest}: not a regular file")
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
    tmp = dest.with_name(f".{dest.name}.new")
    if copy:  # a cache file: the cache keeps it
        shutil.copyfile(path, tmp)
        os.chmod(tmp, 0o644)
    else:
        os.replace(path, tmp)
    os.replace(tmp, dest)


def _cached_wheel(store: Path, name: str, spec: str, fits: Callable[[str], bool]) -> Path | None:
    """The highest version of ``name`` that ``spec`` (``==3.4.7``, ``>=4.6,<5``) allows and that ``fits``, in the
    cache's ``fetched/<sha256>/``, its sha256 checked."""
    prefix = f"{canonicalize_name(name).replace('-', '_')}-"
    found = []
    for path in sorted(store.glob(f"*/{prefix}*.whl")) if store.is_dir() else []:
        version = _version_of(path.name, name, spec)
        if version is not None and fits(path.name) and file_sha256(path) == path.parent.name:
            found.append((version, path))
    return max(found)[1] if found else None


def _version_of(filename: str, name: str, spec: str) -> Version | None:
    """The version of the wheel ``filename`` where it is one of ``name`` that ``spec`` allows, else None."""
    try:
        wheel_name, version, _b, _t = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return None
    if wheel_name != canonicalize_name(name) or not SpecifierSet(spec).contains(version, prereleases=True):
        return None
    return version


def _download(wanted: list[tuple[str, str]], python: str, platforms: tuple[str, ...], store: Path, log: Path) -> None:
    """pip downloads a wheel of each (name, specifier) of ``wanted`` for CPython ``python`` on ``platforms`` into
    ``store`` (``<sha256>/<file>``, with ``origin``); FetchError naming that Python when pip cannot."""
    from tasks.core import net
    from tasks.env.closure import Target
    from tasks.store.cache import temporary_dir
    from tasks.store.simple_index import wheel_problem

    target = Target(python, platforms)
    said = [f"{name}{spec}" for name, spec in wanted]
    with temporary_dir(store, ".fetch-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--dest", str(tmp)]
        cmd += ["--timeout", f"{net.timeout():g}", "--retries", "2"]  # REPRO_NET_TIMEOUT, as every network operation
        res = proc.run([*cmd, *target.pip_options(), *said], env=dict(os.environ), log=log, check=False)
        if res.returncode != 0:
            raise FetchError(
                f"the tool's wheels for CPython {python}: pip could not download {', '.join(said)} "
                f"(exit status {res.returncode}; {' / '.join(res.tail(3).splitlines()) or 'no output'}; log: {log}). "
                f"Run `doit mirror` once where the package index is reachable (the wheels are kept in the cache), "
                f"or leave CPython {python} out of tool_python="
            )
        for name, spec in wanted:
            found = [p for p in sorted(tmp.glob("*.whl")) if _version_of(p.name, name, spec) and target.fits(p.name)]
            if not found:
                raise FetchError(f"the tool's wheels for CPython {python}: pip gave no wheel of {name}{spec} "
                                 f"for it (log: {log})")  # fmt: skip
            problem = wheel_problem(found[0], name, str(_version_of(found[0].name, name, spec)))
            if problem is not None:
                raise FetchError(f"the tool's wheels for CPython {python}: {found[0].name}: {problem}")
            sha = file_sha256(found[0])
            final = store / sha
            final.mkdir(parents=True, exist_ok=True)
            os.chmod(found[0], 0o644)
            os.replace(found[0], final / found[0].name)
            (final / "origin").write_text(f"pip download (the tool's wheels for CPython {python})\n")


def write_wheels(
    dest: Path,
    roots: tuple[str, ...] = (TOOL,),
    *,
    pythons: tuple[str, ...] = (),
    platforms: tuple[str, ...] = (),
    store: Path | None = None,
    log: Path | None = None,
    notes: list[str] | None = None,
) -> Path:
    """Write the wheels of ``roots`` and what they need, as installed here, and ``requirements.txt`` (each
    pinned by sha256) into ``dest``; for each CPython of ``pythons`` other than this one, also the wheel
    that installs there of each distribution whose wheel here does not (downloaded by pip into ``store``,
    reused from it when there), its sha256 on the same line. The requirements file. What was replaced or
    removed in ``dest`` is added to ``notes``."""
    from tasks.env.closure import Target

    notes = notes if notes is not None else []
    dest.mkdir(parents=True, exist_ok=True)
    others = sorted({p for p in pythons if p != this_python()}, key=lambda v: tuple(map(int, v.split("."))))
    targets = [Target(p, platforms or default_platforms()) for p in others]
    dists: dict[str, importlib.metadata.Distribution] = {}
    elsewhere: dict[str, Requirement] = {}
    for root in roots:
        for d in closure(root, tuple(t.environment() for t in targets), elsewhere):
            dists[canonicalize_name(d.metadata["Name"])] = d
    for key in dists:
        elsewhere.pop(key, None)
    hashes: dict[str, list[str]] = {}
    kept: set[str] = set()
    wheels: dict[str, str] = {}  # canonical name -> the file written from this installation
    with tempfile.TemporaryDirectory(prefix=".tool-wheels-", dir=dest) as tmp_name:
        tmp = Path(tmp_name)
        for key, dist in sorted(dists.items()):
            name = dist.metadata["Name"]
            own = key == TOOL
            tag = "py3-none-any" if own else _wheel_tag(dist)
            filename = f"{name.replace('-', '_')}-{dist.version}-{tag}.whl"
            _write_wheel(tmp / filename, _own_files(dist) if own else iter(_dist_files(dist)))
            hashes[key] = [file_sha256(tmp / filename)]
            _publish(tmp / filename, dest / filename, notes)
            kept.add(filename)
            wheels[key] = filename
    versions: dict[str, str] = {}  # the distributions needed only elsewhere: the version taken
    pythons_of: dict[str, list[str]] = {}  # ... and the Pythons that need them
    for target in targets:
        needed: list[tuple[str, str, str]] = []  # (canonical name, name, specifier)
        for key, dist in sorted(dists.items()):
            requires = dist.metadata["Requires-Python"] if "Requires-Python" in dist.metadata else None
            try:
                excluded = requires is not None and not SpecifierSet(requires).contains(f"{target.python}.0")
            except InvalidSpecifier:
                excluded = False
            if excluded:
                raise ReproError(
                    f"tool_python={target.python}: {dist.metadata['Name']} {dist.version} needs Python {requires}; "
                    "leave that Python out of tool_python="
                )
            if not target.fits(wheels[key]):
                needed.append((key, dist.metadata["Name"], f"=={dist.version}"))
        for key, req in sorted(elsewhere.items()):
            env = {**target.environment(), "extra": ""}
            if req.marker is None or req.marker.evaluate(env):
                needed.append((key, req.name, f"=={versions[key]}" if key in versions else str(req.specifier)))
                pythons_of.setdefault(key, []).append(target.python)
        if not needed:
            continue
        if store is None:
            raise ReproError(f"the tool's wheels for CPython {target.python}: no cache to download them into")
        absent = [(name, spec) for _key, name, spec in needed if _cached_wheel(store, name, spec, target.fits) is None]
        if absent:
            _download(absent, target.python, target.platforms, store, log or dest.parent / "tool-wheels.log")
        for key, name, spec in needed:
            path = _cached_wheel(store, name, spec, target.fits)
            if path is None:
                raise FetchError(f"the tool's wheels for CPython {target.python}: {name}{spec} is not in {store}")
            if key in elsewhere:
                versions[key] = str(_version_of(path.name, name, spec))
                _check_requires(path, target, set(dists) | set(elsewhere))
            _publish(path, dest / path.name, notes, copy=True)
            kept.add(path.name)
            if path.parent.name not in hashes.setdefault(key, []):
                hashes[key].append(path.parent.name)
    for path in sorted(dest.glob("*.whl")):
        if path.name not in kept:
            path.unlink()
            notes.append(f"removed {path}: not one of the tool's wheels")
    pinned = {key: f"{key}=={dist.version}" for key, dist in dists.items()}
    for key, version in versions.items():  # only for the Pythons that need it (not this one)
        marker = " or ".join(f'python_version == "{p}"' for p in pythons_of[key])
        pinned[key] = f"{key}=={version} ; {marker}"
    lines = [f"{pinned[key]} {' '.join(f'--hash=sha256:{h}' for h in hashes[key])}\n" for key in sorted(pinned)]
    write_atomic(dest / "requirements.txt", "".join(lines))
    return dest / "requirements.txt"


def _check_requires(wheel: Path, target: Target, known: set[str]) -> None:
    """A wheel downloaded for a distribution that only another Python needs must need nothing more there."""
    from tasks.env.closure import requires_dist

    env = {**target.environment(), "extra": ""}
    for line in requires_dist(wheel):
        req = Requirement(line)
        if (req.marker is None or req.marker.evaluate(env)) and canonicalize_name(req.name) not in known:
            raise ReproError(
                f"the tool's wheels for CPython {target.python}: {wheel.name} needs {req}, which the tool does not "
                "carry; install the tool on that Python's host and write the wheels there"
            )


def interpreter_bound(dest: Path) -> dict[str, list[str]]:
    """The wheels in ``dest`` that install on some Pythons only (their interpreter tags, ``cp311``): each
    compiled dependency is there once per Python it was written for."""
    bound = {}
    for wheel in sorted(dest.glob("*.whl")):
        try:
            tags = parse_wheel_filename(wheel.name)[3]
        except InvalidWheelFilename:
            continue
        if all(t.interpreter.startswith("py") or t.abi == "abi3" for t in tags):
            continue  # any Python 3 (abi3: any from its version on)
        bound[wheel.name] = sorted({_python_name(t.interpreter) for t in tags})
    return bound


def installs_on(dest: Path) -> list[str]:
    """The CPythons on which every distribution of ``dest`` has a wheel (``CPython 3.12``); [] when no
    wheel is bound to a Python (then any Python 3 that the wheels' Requires-Python allows)."""
    per_dist: dict[str, set[str]] = {}
    for wheel, pythons in interpreter_bound(dest).items():
        per_dist.setdefault(parse_wheel_filename(wheel)[0], set()).update(pythons)
    if not per_dist:
        return []
    common = set.intersection(*per_dist.values())
    return sorted(common, key=lambda p: tuple(int(x) for x in p.split()[-1].split(".") if x.isdigit()))


def _python_name(interpreter: str) -> str:
    """``cp311`` as people say it: CPython 3.11."""
    if interpreter.startswith("cp") and interpreter[2:].isdigit() and len(interpreter) > 3:
        return f"CPython {interpreter[2]}.{interpreter[3:]}"
    return interpreter


def write_tool_wheels(
    dest: Path,
    *,
    pythons: tuple[str, ...] = (),
    platforms: tuple[str, ...] = (),
    store: Path | None = None,
    log: Path | None = None,
) -> list[str]:
    """The tool's wheels and their ``requirements.txt`` in ``dest`` (:func:`write_wheels`) for this Python and
    ``pythons``; lines to print."""
    notes: list[str] = []
    path = write_wheels(dest, pythons=pythons, platforms=platforms, store=store, log=log, notes=notes)
    count = len(path.read_text().splitlines())
    files = len(list(dest.glob("*.whl")))
    lines = [
        f"the tool: {count} distributions ({files} wheels: reprostack and what it runs on) in {dest}; install it "
        f"offline with pip install --no-index --find-links {dest} --require-hashes -r {dest / 'requirements.txt'}"
    ]
    lines += [f"note: {note}" for note in notes]
    where = [p.split()[-1] for p in installs_on(dest)]
    if where:
        bound = sorted({parse_wheel_filename(w)[0] for w in interpreter_bound(dest)})
        said = f"{', '.join(where[:-1])} and {where[-1]}" if len(where) > 1 else where[0]
        lines.append(
            f"note: the tool's wheels install on CPython {said} only ({', '.join(bound)} "
            f"{'is' if len(bound) == 1 else 'are'} built for each Python): for a build host with another Python, "
            "add it to tool_python= (docs/offline.md)"
        )
    return lines
