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
"""

from __future__ import annotations

import importlib.metadata
import os
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tasks.core.errors import ReproError
from tasks.core.fsutil import write_atomic
from tasks.core.treehash import file_sha256
from tasks.store.wheelnorm import normalize_wheel

TOOL = "reprostack"
#: Metadata files of an installed distribution that are the installer's, not the wheel's.
_INSTALLER_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}


def closure(root: str = TOOL) -> list[importlib.metadata.Distribution]:
    """``root`` and every distribution its requirements (markers evaluated here, no extras) need, installed."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [(root, frozenset[str]())]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and not extras:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise ReproError(f"{name} is not installed here; reinstall the tool (pip install reprostack)") from None
        seen[key] = dist
        for raw in dist.requires or []:
            req = Requirement(raw)
            wanted = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in wanted):
                todo.append((req.name, frozenset(req.extras)))
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


def write_wheels(dest: Path, roots: tuple[str, ...] = (TOOL,)) -> Path:
    """Write the wheels of ``roots`` and what they need, as installed here, and ``requirements.txt`` (each
    pinned by sha256) into ``dest``; the requirements file."""
    dest.mkdir(parents=True, exist_ok=True)
    lines = []
    dists = {canonicalize_name(d.metadata["Name"]): d for root in roots for d in closure(root)}
    for _key, dist in sorted(dists.items()):
        name = dist.metadata["Name"]
        own = canonicalize_name(name) == TOOL
        tag = "py3-none-any" if own else _wheel_tag(dist)
        path = dest / f"{name.replace('-', '_')}-{dist.version}-{tag}.whl"
        if own or not path.is_file():  # reprostack's own code changes within a version: always written
            _write_wheel(path, _own_files(dist) if own else iter(_dist_files(dist)))
        lines.append(f"{canonicalize_name(name)}=={dist.version} --hash=sha256:{file_sha256(path)}\n")
    write_atomic(dest / "requirements.txt", "".join(lines))
    return dest / "requirements.txt"


def interpreter_bound(dest: Path) -> dict[str, list[str]]:
    """The wheels in ``dest`` that install on some Pythons only (their interpreter tags, ``cp311``): the
    tool's wheels are this installation's, so a compiled dependency is built for this Python alone."""
    from packaging.utils import InvalidWheelFilename, parse_wheel_filename

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


def _python_name(interpreter: str) -> str:
    """``cp311`` as people say it: CPython 3.11."""
    if interpreter.startswith("cp") and interpreter[2:].isdigit() and len(interpreter) > 3:
        return f"CPython {interpreter[2]}.{interpreter[3:]}"
    return interpreter


def write_tool_wheels(dest: Path) -> list[str]:
    """The tool's wheels and their ``requirements.txt`` in ``dest`` (:func:`write_wheels`); lines to print."""
    count = len(write_wheels(dest).read_text().splitlines())
    lines = [
        f"the tool: {count} wheels (reprostack and what it runs on) in {dest}; install it offline with "
        f"pip install --no-index --find-links {dest} --require-hashes -r {dest / 'requirements.txt'}"
    ]
    bound = interpreter_bound(dest)
    if bound:
        pythons = sorted({p for tags in bound.values() for p in tags})
        lines.append(
            f"note: the tool's wheels install on {' and '.join(pythons)} only ({', '.join(bound)} "
            f"{'is' if len(bound) == 1 else 'are'} built for this Python): for a build host with another Python, "
            "write them with the tool installed on that Python"
        )
    return lines
