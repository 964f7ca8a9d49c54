"""`doit lock`: resolve refs to commits, submodules to their gitlinks, fill in hashes.

With tasks/cli/oci.py (image digests), the only code that writes the lock
file. It edits the TOML document in place (tomlkit keeps comments and layout)
and replaces the file atomically. Complete entries are left alone unless named
by ``update=`` (or ``update=all``; ``update=hermetic`` for the hermetic toolchain, ``update=build`` for the
build closures).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import tomlkit
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version
from tomlkit.items import AoT, Table

from tasks.core.errors import LockError, ReproError
from tasks.core.fsutil import write_atomic
from tasks.env import closure, hermetic
from tasks.lock import kinds, pypi
from tasks.lock.lockfile import BUILD_FRONTEND, Lock, Package, Runtime, WheelPin, build_digest, load_lock
from tasks.store.cache import Cache
from tasks.store.manifest import MANIFEST_FILE, load_document


def set_key(table: Any, key: str, value: Any) -> None:
    """``table[key] = value``, a new key going after the table's last key, not after the comment lines that
    tomlkit keeps at the table's end but that introduce the next table."""
    if key in table:
        table[key] = value
        return
    body = table.value.body if hasattr(table, "value") else table.body
    plain = [i for i, (k, item) in enumerate(body) if k is not None and not isinstance(item, (Table, AoT))]
    last = plain[-1] if plain else len(body) - 1  # sub-tables ([a.b]) come after every plain key
    if last == len(body) - 1:
        table[key] = value
    else:
        (table.value if hasattr(table, "value") else table)._insert_at(last + 1, key, value)


def lock_sources(
    lock_path: Path,
    cache: Cache,
    *,
    mirror: Path | None,
    logs: Path,
    update: tuple[str, ...],
) -> list[str]:
    """Fill in the lock file's pins; return one line per source describing what changed."""
    lock = load_lock(lock_path, require_pins=False)
    unknown = [u for u in update if u not in ("all", "runtime", "build") and u not in lock.sources]
    if unknown:
        raise LockError(
            f"update= names unknown source(s) {', '.join(unknown)}; sources: {', '.join(lock.sources)} "
            "(and: all, hermetic, runtime, build, image, builder)"
        )
    doc = tomlkit.parse(lock_path.read_text())
    report = []
    for name, src in lock.sources.items():
        kind = kinds.of(src.kind)
        refresh = "all" in update or name in update
        if kind.complete(src) and not refresh:
            report.append(f"{name}: pinned")
            continue
        entry = doc["sources"][name]
        edits, line = kind.lock(
            src, cache=cache, mirror=None if refresh else mirror, log=logs / f"lock-{name}.log", refresh=refresh
        )
        for key, value in edits.items():
            if isinstance(value, Table):  # a [sources.NAME.KEY] table goes at the entry's end
                entry[key] = value
            else:
                set_key(entry, key, value)
        report.append(line)
    write_atomic(lock_path, tomlkit.dumps(doc))
    load_lock(lock_path, require_pins=False)  # what we wrote must validate (some pins may stay open)
    return report


def lock_runtime(lock_path: Path, cache: Cache, *, wheels: Path, logs: Path, update: tuple[str, ...]) -> list[str]:
    """Resolve ``[runtime]`` and each ``[profiles.NAME.runtime]`` into ``resolved`` (see tasks/env/closure.py);
    return lines saying what changed.

    A section is resolved again only when its inputs changed (requirements, provided set, target) or when
    ``update=runtime`` (or ``all``) asks; the earlier pins are kept wherever the new resolution allows
    (they go in as constraints first), and a pin whose version did not change keeps its hashes.
    """
    lock = load_lock(lock_path, require_pins=False)
    sections = lock.runtimes()  # one without requirements of its own still takes our wheels' Requires-Dist
    if not sections:
        if "runtime" in update:
            raise LockError(f"update=runtime: {lock_path} has no [runtime] to resolve")
        return []
    lines: list[str] = []
    failed: list[ReproError] = []
    for where, runtime in sections:  # one that cannot be resolved leaves the others to be
        profile = where.split(".")[1] if where.startswith("profiles.") else "default"
        try:
            lines += _lock_one_runtime(lock_path, lock, where, runtime, profile, cache, wheels=wheels, logs=logs,
                                       update=update)  # fmt: skip
        except closure.ResolutionFailed as exc:
            failed.append(exc)
            lines.append(f"{where}: NOT RESOLVED (below)")
    if failed:
        for line in lines:
            print(f"  {line}", flush=True)
        raise type(failed[0])("\n".join(exc.message for exc in failed))
    return lines


def _lock_one_runtime(
    lock_path: Path, lock: Lock, where: str, runtime: Runtime, profile: str, cache: Cache, *, wheels: Path,
    logs: Path, update: tuple[str, ...],
) -> list[str]:  # fmt: skip
    label = where if where == "runtime" else f"{where} (profile {profile})"
    refresh = "runtime" in update or "all" in update
    log = logs / ("lock-runtime.log" if where == "runtime" else f"lock-runtime-{profile}.log")
    base: dict[str, tuple[str, list[str]]] = {}
    written: list[str] = []
    if runtime.base_python or runtime.base_image or runtime.base_capture:  # the provided set: what the base holds
        capture = None
        if runtime.base_capture:
            capture = lock_path.parent / runtime.base_capture
            if not capture.resolve().is_relative_to(lock_path.parent.resolve()):
                raise LockError(f"[{where}] base_capture {runtime.base_capture!r} leads out of the lock's folder")
        base_py, base = closure.capture_base(runtime.base_python, image=runtime.base_image, capture=capture,
                                             log=log.with_name(log.stem + "-base.log"))  # fmt: skip
        provided = tuple(sorted((name, version) for name, (version, _requires) in base.items()))
        if provided != runtime.provided:
            source = runtime.base_capture or runtime.base_image or runtime.base_python
            written.append(f"provided ({len(provided)} distributions installed in {source})")
        runtime = replace(runtime, provided=provided, python=runtime.python or base_py)
    if not runtime.python:
        runtime = replace(runtime, python=f"{sys.version_info[0]}.{sys.version_info[1]}")
        written.append(f"python = {runtime.python!r} (this interpreter's)")
    if written:
        _write_runtime_inputs(lock_path, where, profile, runtime)
    target = closure.target_of(runtime)
    started = time.monotonic()
    fixed, requires, notes = _ours(lock.resolve(profile), lock, runtime, wheels, cache)
    fixed.update(runtime.provided_versions)
    available = {**{pin.name: pin.version for pin in runtime.resolved}, **fixed}
    # Our wheels' requirements, once they are built, are the closure's to meet: a closure resolved before
    # (with requirements = [], say) that does not meet them is resolved again.
    unmet = closure.unmet(requires, available, target)
    if runtime.resolved_from == runtime.digest() and not refresh and not unmet:
        return [f"{label}: pinned ({len(runtime.resolved)} distributions)"]
    notes = [f"  wrote {line}" for line in written] + notes
    if unmet and runtime.resolved_from == runtime.digest():
        notes.append(f"  resolved again: the built wheels need {', '.join(unmet)}")
    old = {pin.name: pin for pin in runtime.resolved}
    requirements = [*runtime.requirements, *requires]
    base_requires = {name: requires for name, (_version, requires) in base.items()}
    try:
        found = closure.resolve(requirements, fixed, target, constraints=[f"{n}=={p.version}" for n, p in old.items()],
                                log=log, where=where, base=base_requires)  # fmt: skip
    except closure.ResolutionFailed:
        if not old:
            raise
        found = closure.resolve(requirements, fixed, target, log=log, where=where, base=base_requires)  # earlier pins
        # did not fit
    indexes = pypi.pip_indexes()
    pins = []
    with tempfile.TemporaryDirectory(prefix="lock-runtime-") as work:
        for name, version in found.items():
            if name in old and old[name].version == version and old[name].hashes:
                pins.append(old[name].requirement())
                continue
            hashes = closure.file_hashes(name, version, target, work=Path(work), indexes=indexes)
            pins.append(closure.Pin(name, version, tuple(hashes)).requirement())
    doc = tomlkit.parse(lock_path.read_text())
    table = doc["runtime"] if where == "runtime" else doc["profiles"][profile]["runtime"]
    array = tomlkit.array()
    array.multiline(True)
    array.extend(pins)
    set_key(table, "resolved", array)
    set_key(table, "resolved_from", runtime.digest())
    write_atomic(lock_path, tomlkit.dumps(doc))
    load_lock(lock_path, require_pins=False)  # what we wrote must validate
    new = dict(found)
    added = sorted(new.keys() - old.keys())
    removed = sorted(old.keys() - new.keys())
    changed = sorted(n for n in new.keys() & old.keys() if new[n] != old[n].version)
    summary = f"{label}: {len(pins)} distributions for CPython {target.python} ({time.monotonic() - started:.1f} s)"
    if old:
        summary += (
            f"; added {', '.join(added) or 'none'}"
            f"; changed {', '.join(f'{n} {old[n].version}->{new[n]}' for n in changed) or 'none'}"
            f"; removed {', '.join(removed) or 'none'}"
        )
    return [summary, *notes]


def _write_runtime_inputs(lock_path: Path, where: str, profile: str, runtime: Runtime) -> None:
    """``provided`` (captured from base_python) and ``python`` of a runtime section, into the lock file."""
    doc = tomlkit.parse(lock_path.read_text())
    table = doc["runtime"] if where == "runtime" else doc["profiles"][profile]["runtime"]
    if runtime.base_python or runtime.base_image or runtime.base_capture:
        array = tomlkit.array()
        array.multiline(True)
        array.extend(f"{name}=={version}" for name, version in runtime.provided)
        set_key(table, "provided", array)
    set_key(table, "python", runtime.python)
    write_atomic(lock_path, tomlkit.dumps(doc))


def _ours(
    packages: tuple[Package, ...], lock: Lock, runtime: Runtime, wheels: Path, cache: Cache
) -> tuple[dict[str, str], list[str], list[str]]:
    """The distributions this profile's packages make (name -> version, as fixed points of the resolution),
    the requirements of those whose wheels exist already (wheels/, or a prebuilt one), and notes on the rest."""
    fixed: dict[str, str] = {}
    requires: list[str] = []
    notes = []
    built = {}
    provided = runtime.provided_versions
    if (wheels / MANIFEST_FILE).is_file():
        try:
            for w in load_document(wheels).get("wheels", []):
                if w.get("origin", "built") != "fetched" and (wheels / w["filename"]).is_file():
                    built[w["package"]] = wheels / w["filename"]
        except (ValueError, KeyError, TypeError):
            pass
    for pkg in packages:
        name = pkg.name
        src = lock.sources[pkg.source]
        wheel = built.get(name) or _newest_cached(cache, name)
        if wheel is None and pkg.prebuilt and src.sha256:
            wheel = cache.fetched_wheel(src.sha256)
        if wheel is not None:
            fixed[pkg.distribution_name] = str(parse_wheel_filename(wheel.name)[1])
            if pkg.deps and pkg.distribution_name not in provided:  # a patched base package needs what the base has
                # What the target provides is not resolved: our wheels' pins of it (the torch they were
                # compiled against) are checked against the provided set by `doit wheels` instead.
                requires += [r for r in closure.requires_dist(wheel)
                             if not _names_ours(r, lock) and _name(r) not in provided]  # fmt: skip
            continue
        if pkg.prebuilt:
            fixed[pkg.distribution_name] = str(parse_wheel_filename(src.filename)[1])
        else:
            fixed[pkg.distribution_name] = src.version or "0"
        notes.append(name)
    if notes:
        notes = [
            f"  not built yet (no wheel in {wheels}/): {', '.join(notes)}; `doit wheels` checks their requirements "
            "against the closure, and `doit lock update=runtime` after a build takes them into the resolution"
        ]
    return fixed, requires, notes


def _newest_cached(cache: Cache, package: str) -> Path | None:
    """The wheel of ``package`` built last into the cache (a `doit wheels` that the closure stopped leaves
    its wheels there, not in wheels/): its requirements stand for the current build's; `doit wheels` checks
    the real ones again."""
    found = []
    for entry in (cache.root / "wheels").glob("*/*/entry.json"):
        try:
            meta = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        wheel = entry.parent / str(meta.get("filename", ""))
        if meta.get("package") == package and not meta.get("prebuilt") and wheel.suffix == ".whl" and wheel.is_file():
            found.append((entry.stat().st_mtime, wheel))
    return max(found)[1] if found else None


def _name(requirement: str) -> str:
    return str(canonicalize_name(Requirement(requirement).name))


def _names_ours(requirement: str, lock: Lock) -> bool:
    name = canonicalize_name(Requirement(requirement).name)
    return any(pkg.distribution_name == name for pkg in lock.packages.values())


def lock_hermetic(lock_path: Path, cache: Cache, *, update: tuple[str, ...]) -> list[str]:
    """Fill in the ``--hash`` options of ``[toolchain.hermetic] requirements``; return lines saying what was pinned.

    A requirement without hashes (every one with ``update=hermetic`` or
    ``update=all``) gets one per wheel :func:`tasks.hermetic.lock_pin` selects.
    Every requirement is resolved before the file is written, so an error
    leaves the lock as it was.
    """
    lock = load_lock(lock_path, require_pins=False)
    if not lock.toolchain.hermetic:
        if "hermetic" in update:
            raise LockError(f"update=hermetic: {lock_path} has no [toolchain.hermetic] requirements to re-pin")
        return []
    refresh = "hermetic" in update or "all" in update
    doc = tomlkit.parse(lock_path.read_text())
    lines = doc["toolchain"]["hermetic"]["requirements"]
    pins = {p.name: p for p in lock.toolchain.hermetic}
    report: list[str] = []
    changed: dict[int, str] = {}
    indexes: list[str] = []
    with cache.staging("lock-hermetic") as work:
        for i, line in enumerate(lines):
            spec = str(line).split(" --")[0].strip()
            pin = pins[canonicalize_name(Requirement(spec).name)]
            what = f"hermetic {pin.name}=={pin.version}"
            if pin.hashes and not refresh:
                report.append(f"{what}: pinned ({_count(len(pin.hashes), 'hash', 'hashes')})")
                continue
            indexes = indexes or pypi.pip_indexes()
            try:
                files = hermetic.lock_pin(pin, python=lock.toolchain.python, work=work, indexes=indexes)
            except ReproError as exc:
                raise type(exc)(f"{exc.message}\n{lock_path} was left as it was.") from None
            changed[i] = " ".join([spec, *(f"--hash=sha256:{h}" for h in sorted({sha for _, sha in files}))])
            report.append(f"{what}: {_count(len(files), 'wheel', 'wheels')}")
            report.extend(f"  {name}  sha256:{sha}" for name, sha in files)
    if any(str(lines[i]) != text for i, text in changed.items()):
        for i, text in changed.items():
            lines[i] = text
        write_atomic(lock_path, tomlkit.dumps(doc))
        load_lock(lock_path, require_pins=False)  # what we wrote must validate
    return report


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


#: setuptools before 70.1 builds wheels with the ``wheel`` project's bdist_wheel; from 70.1 on, with its own.
SETUPTOOLS_OWN_BDIST_WHEEL = Version("70.1")


def lock_build(lock_path: Path, *, logs: Path, update: tuple[str, ...]) -> list[str]:
    """Resolve each package's build closure into ``[build.NAME]`` (see tasks/env/buildenv.py); return lines
    saying what was pinned.

    A package's ``build_requires`` (torch is the base's: left out), with pip (the frontend) and, where the
    resolved setuptools is older than 70.1, ``wheel`` (its bdist_wheel), resolved by pip for the lowest CPython
    of ``[toolchain] python``, each pin with the sha256 of its every Linux wheel for that range. A closure
    whose inputs did not change is kept unless ``update=build`` (or ``all``); earlier pins go in as
    constraints first. Every closure is resolved before the file is written.
    """
    lock = load_lock(lock_path, require_pins=False)
    refresh = "build" in update or "all" in update
    minors = sorted(hermetic.python_minors(lock.toolchain.python or ">=3"))
    if not minors:
        raise LockError(f"{lock_path}: [toolchain] python {lock.toolchain.python!r} admits no CPython 3")
    target = closure.Target(f"3.{minors[0]}")
    lines: list[str] = []
    resolved: dict[str, tuple[list[str], str]] = {}  # package -> (pin lines, digest)
    by_inputs: dict[tuple[str, ...], tuple[dict[str, str], list[str]]] = {}
    hashes: dict[tuple[str, str], tuple[str, ...]] = {}
    indexes: list[str] | None = None
    with tempfile.TemporaryDirectory(prefix="lock-build-") as work:
        for pkg in lock.packages.values():
            if pkg.prebuilt:
                continue
            digest = build_digest(pkg, lock.toolchain.python)
            old = lock.build.get(pkg.name)
            if old is not None and old.resolved_from == digest and not refresh:
                lines.append(f"build.{pkg.name}: pinned ({len(old.resolved)} wheels)")
                continue
            requirements = tuple(sorted({*(r for r in pkg.build_requires if _name(r) != "torch"), *BUILD_FRONTEND}))
            if requirements not in by_inputs:
                constraints = [f"{p.name}=={p.version}" for p in old.resolved] if old is not None else []
                by_inputs[requirements] = _resolve_build(
                    list(requirements), target, constraints, log=logs / f"lock-build-{pkg.name}.log", where=pkg.name
                )
            found, notes = by_inputs[requirements]
            pins = []
            for name, version in found.items():
                if (name, version) not in hashes:
                    indexes = indexes if indexes is not None else pypi.pip_indexes()
                    files = hermetic.lock_pin(WheelPin(name=name, version=version, hashes=()),
                                              python=lock.toolchain.python, work=Path(work), indexes=indexes,
                                              where=f"build.{pkg.name}")  # fmt: skip
                    hashes[(name, version)] = tuple(sorted({sha for _file, sha in files}))
                pins.append(WheelPin(name=name, version=version, hashes=hashes[(name, version)]).requirement())
            resolved[pkg.name] = (pins, digest)
            shown = ", ".join(f"{n} {v}" for n, v in found.items())
            lines.append(
                f"build.{pkg.name}: {len(pins)} wheels (with pip, the frontend) for CPython {target.python} "
                f"and up: {shown}"
            )
            lines.extend(f"  {note}" for note in notes)
    gone = [name for name in lock.build if name not in lock.packages or lock.packages[name].prebuilt]
    if resolved or gone:
        doc = tomlkit.parse(lock_path.read_text())
        if "build" not in doc:
            doc.add(tomlkit.nl())
            doc.add(tomlkit.comment("The exact wheels each package's build runs with (`doit lock` writes them)."))
            doc["build"] = tomlkit.table(is_super_table=True)
        for name in gone:
            del doc["build"][name]
            lines.append(f"build.{name}: removed (no such package built from source)")
        for name, (pins, digest) in resolved.items():
            table = tomlkit.table()
            array = tomlkit.array()
            array.multiline(True)
            array.extend(pins)
            table["resolved"] = array
            table["resolved_from"] = digest
            doc["build"][name] = table
        write_atomic(lock_path, tomlkit.dumps(doc))
        load_lock(lock_path, require_pins=False)  # what we wrote must validate
    return lines


def _resolve_build(
    requirements: list[str], target: closure.Target, constraints: list[str], *, log: Path, where: str
) -> tuple[dict[str, str], list[str]]:
    """name -> version of a build closure, and notes on what was added to the lock's requirements."""
    section = f"build.{where}"
    try:
        try:
            found = closure.resolve(requirements, {}, target, constraints=constraints, log=log, where=section)
        except closure.ResolutionFailed:
            if not constraints:
                raise
            found = closure.resolve(requirements, {}, target, log=log, where=section)  # earlier pins did not fit
    except closure.ResolutionFailed as exc:
        raise closure.ResolutionFailed(
            f"package {where}: its build_requires {requirements} have no wheels to pin: {exc.message}\n"
            f"Fix package {where}'s build_requires (or point PIP_INDEX_URL at an index that has them), then run "
            "`doit lock` again; the lock was left as it was."
        ) from None
    notes = []
    setuptools = found.get("setuptools")
    if setuptools and "wheel" not in found and Version(setuptools) < SETUPTOOLS_OWN_BDIST_WHEEL:
        found = closure.resolve([*requirements, "wheel"], {}, target, constraints=[f"setuptools=={setuptools}"],
                                log=log, where=section)  # fmt: skip
        notes.append(f"added wheel: setuptools {setuptools} builds wheels with it (setuptools 70.1 and later do not)")
    return found, notes
