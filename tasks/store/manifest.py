"""The wheelhouse's one contract: ``wheels/manifest.json``, its writer and its readers.

``doit wheels`` writes the manifest last (its presence means the wheelhouse is complete) from
:class:`WheelRecord` values with :func:`render`. It is read here only:

- :func:`load_manifest` / :func:`parse_manifest`: the typed view that verify checks a wheelhouse
  against (:class:`Manifest`, one :class:`WheelSpec` per wheel); a missing, unreadable or invalid
  manifest is a :class:`~tasks.core.errors.ReproError` naming every problem at once. The document's
  ``format`` is not checked (a manifest of any format that has the fields is read as format 1).
- :func:`read_manifest`: the same view, or None where there is no valid manifest.
- :func:`read_document`: the JSON object as written, or None where the file is missing, not JSON or
  not an object (whether wheels/ is current: tasks/stages/wheelhouse.py, tasks/cli/plan.py, tasks/verify/repro.py).
- :func:`load_document`: the JSON value as written; FileNotFoundError and ValueError reach the
  caller, which says what to do (tasks/image/image.py, tasks/cli/lockcmd.py).

Standard library only at import time (and tasks/core/errors.py, which is too): tasks/verify/checks.py imports this
module inside the runtime image (tasks/verify/incontainer.py), where only the kit of
tasks/verify/image.py is there. :attr:`WheelRecord.name` and ``version`` read the wheel's file name
with ``packaging``, imported when asked: only the writer's side asks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.errors import ReproError

MANIFEST_FORMAT = 1
#: Its name in wheels/.
MANIFEST_FILE = "manifest.json"


# --------------------------------------------------------------------------
# Writing


@dataclass(frozen=True, kw_only=True)
class WheelRecord:
    """One wheel as ``doit wheels`` places it and records it in the manifest."""

    package: str
    filename: str
    sha256: str
    size: int
    action_key: str
    sources: tuple[Mapping[str, Any], ...]
    cuda: bool = False
    verify: Mapping[str, Any] | None = None
    #: "built" (by us, from the lock's sources), "prebuilt" (a wheel source, as is) or "fetched" (the runtime closure)
    origin: str = "built"
    url: str = ""  # where a prebuilt or fetched wheel came from
    deps: bool = True  # whether its Requires-Dist must be met by the wheelhouse and the provided set

    @property
    def name(self) -> str:
        from packaging.utils import parse_wheel_filename

        return str(parse_wheel_filename(self.filename)[0])

    @property
    def version(self) -> str:
        from packaging.utils import parse_wheel_filename

        return str(parse_wheel_filename(self.filename)[1])

    def to_json(self) -> dict[str, Any]:
        return {
            "package": self.package,
            "name": self.name,
            "version": self.version,
            "filename": self.filename,
            "sha256": self.sha256,
            "size": self.size,
            "action_key": self.action_key,
            "sources": list(self.sources),
            "cuda": self.cuda,
            "verify": dict(self.verify or {}),
            "origin": self.origin,
            **({"url": self.url} if self.url else {}),
            **({} if self.deps else {"deps": False}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WheelRecord:
        """The record of one entry of the manifest's ``wheels`` (``name`` and ``version`` come from the
        file name). KeyError or TypeError when the entry lacks a field that :meth:`to_json` always writes."""
        return cls(
            package=str(data["package"]),
            filename=str(data["filename"]),
            sha256=str(data["sha256"]),
            size=int(data["size"]),
            action_key=str(data["action_key"]),
            sources=tuple(data["sources"]),
            cuda=bool(data.get("cuda", False)),
            verify=dict(data["verify"]) if data.get("verify") else None,
            origin=str(data.get("origin", "built")),
            url=str(data.get("url", "")),
            deps=bool(data.get("deps", True)),
        )


def render(
    records: Sequence[WheelRecord],
    *,
    lock: str,
    lock_sha256: str,
    profile: str,
    archs: Sequence[str],
    runtime: Mapping[str, Any] | None = None,
) -> str:
    """The text of ``manifest.json`` (the wheels sorted by package)."""
    doc = {
        "format": MANIFEST_FORMAT,
        "lock": lock,
        "lock_sha256": lock_sha256,
        "profile": profile,
        "archs": list(archs),
        **({"runtime": dict(runtime)} if runtime else {}),
        "wheels": [r.to_json() for r in sorted(records, key=lambda r: r.package)],
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


# --------------------------------------------------------------------------
# Reading: the document


def load_document(wheels: Path) -> Any:
    """The JSON value of ``wheels/manifest.json``; FileNotFoundError, other OSErrors and ValueError
    (not JSON, not UTF-8) reach the caller."""
    return json.loads((wheels / MANIFEST_FILE).read_text())


def read_document(wheels: Path) -> dict[str, Any] | None:
    """The JSON object of ``wheels/manifest.json``; None when it is missing, not JSON or not an object."""
    try:
        doc = load_document(wheels)
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


# --------------------------------------------------------------------------
# Reading: what verify checks


@dataclass(frozen=True, kw_only=True)
class WheelSpec:
    """One wheel of ``wheels/manifest.json`` and what to verify of it."""

    package: str
    name: str
    version: str
    filename: str
    sha256: str
    cuda: bool = False
    imports: tuple[str, ...] | None = None
    smoke: str | None = None
    origin: str = "built"  # "built", "prebuilt" (a wheel source, as is) or "fetched" (the runtime closure)
    deps: bool = True  # whether its requirements must be met (false: installed like pip --no-deps)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    archs: tuple[str, ...]
    wheels: tuple[WheelSpec, ...]
    #: ``name==version`` the target provides ([runtime] provided): what an isolated verify may see besides the wheels
    provided: tuple[str, ...] = ()
    #: ``[runtime] verify``: checks of the environment as a whole, after the wheels' own.
    environment: WheelSpec | None = None

    @property
    def ours(self) -> tuple[WheelSpec, ...]:
        """The wheels built from the lock or placed from its wheel sources (not the runtime closure)."""
        return tuple(w for w in self.wheels if w.origin != "fetched")

    @property
    def closure(self) -> tuple[WheelSpec, ...]:
        return tuple(w for w in self.wheels if w.origin == "fetched")


ARCH_PATTERN = re.compile(r"^(?:sm_|compute_)?(?P<num>\d{2,3})(?P<suffix>[af]?)$")
MODULE_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def normalize_arch(arch: str) -> str:
    """``sm_90a``, ``compute_90a`` and ``90a`` all become ``sm_90a``."""
    match = ARCH_PATTERN.match(arch.strip())
    if match is None:
        raise ValueError(f"not a CUDA architecture: {arch!r} (expected e.g. 'sm_90a')")
    return f"sm_{match['num']}{match['suffix']}"


def parse_manifest(data: Mapping[str, Any], where: str = "manifest") -> Manifest:
    """Validate a manifest document; every problem is reported at once."""
    problems: list[str] = []
    archs: list[str] = []
    for arch in data.get("archs", []) or []:
        try:
            archs.append(normalize_arch(str(arch)))
        except ValueError as exc:
            problems.append(f"archs: {exc}")
    wheels: list[WheelSpec] = []
    entries = data.get("wheels")
    if not isinstance(entries, list):
        problems.append("'wheels' must be a list")
        entries = []
    for i, entry in enumerate(entries):
        label = f"wheels[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{label}: must be an object")
            continue
        label = f"wheels[{i}] ({entry.get('package') or entry.get('name') or '?'})"
        missing = [k for k in ("package", "name", "version", "filename", "sha256") if not entry.get(k)]
        if missing:
            problems.append(f"{label}: missing {', '.join(missing)}")
            continue
        verify = entry.get("verify") or {}
        imports = verify.get("imports")
        if imports is not None:
            bad = [m for m in imports if not isinstance(m, str) or not MODULE_PATTERN.match(m)]
            if bad or not isinstance(imports, list):
                problems.append(f"{label}: verify.imports must be a list of module names, got {bad}")
                imports = None
        smoke = verify.get("smoke") or None  # "" (no smoke script) is what the wheelhouse writes for none
        if smoke is not None and (not isinstance(smoke, str) or not MODULE_PATTERN.match(smoke)):
            problems.append(f"{label}: verify.smoke must be a script name, got {smoke!r}")
            smoke = None
        wheels.append(
            WheelSpec(
                package=str(entry["package"]),
                name=str(entry["name"]),
                version=str(entry["version"]),
                filename=str(entry["filename"]),
                sha256=str(entry["sha256"]),
                cuda=bool(entry.get("cuda", False)),
                imports=tuple(imports) if imports else None,
                smoke=smoke,
                origin=str(entry.get("origin", "built")),
                deps=bool(entry.get("deps", True)),
            )
        )
    runtime = data.get("runtime") or {}
    provided = tuple(str(p) for p in runtime.get("provided", [])) if isinstance(runtime, dict) else ()
    environment = None
    checks = runtime.get("verify") if isinstance(runtime, dict) else None
    if isinstance(checks, dict) and (checks.get("imports") or checks.get("smoke")):
        imports, smoke = checks.get("imports") or [], checks.get("smoke") or None
        if not isinstance(imports, list) or not all(isinstance(m, str) and MODULE_PATTERN.match(m) for m in imports):
            problems.append(f"runtime.verify.imports must be a list of module names, got {imports!r}")
        elif smoke is not None and (not isinstance(smoke, str) or not MODULE_PATTERN.match(smoke)):
            problems.append(f"runtime.verify.smoke must be a script name, got {smoke!r}")
        else:
            environment = WheelSpec(package="environment", name="", version="", filename="", sha256="",
                                    imports=tuple(imports) or None, smoke=smoke, origin="environment")  # fmt: skip
    if problems:
        raise ReproError(f"{where} is invalid:\n  " + "\n  ".join(problems) + "\nRebuild it with `doit wheels`.")
    return Manifest(archs=tuple(archs), wheels=tuple(wheels), provided=provided, environment=environment)


def load_manifest(wheel_dir: Path) -> Manifest:
    path = wheel_dir / MANIFEST_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ReproError(f"{path} does not exist: build the wheelhouse first (`doit wheels`)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ReproError(f"{path} cannot be read: {exc}; rebuild it with `doit wheels`") from exc
    if not isinstance(data, dict):
        raise ReproError(f"{path}: expected a JSON object; rebuild it with `doit wheels`")
    return parse_manifest(data, where=str(path))


def read_manifest(wheels: Path) -> Manifest | None:
    """The manifest of ``wheels`` as :func:`load_manifest` reads it, or None where there is none valid."""
    try:
        return load_manifest(wheels)
    except ReproError:
        return None
