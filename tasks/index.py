"""Pure writers of the wheelhouse's metadata: manifest, PEP 503 index, hash-pinned requirements."""

from __future__ import annotations

import html
import json
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from email.message import Message
from email.parser import BytesHeaderParser
from pathlib import Path
from typing import Any

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

MANIFEST_FORMAT = 1


def wheel_project(filename: str) -> str:
    """The canonical project name of a wheel file name ('' when it is not one)."""
    try:
        return str(parse_wheel_filename(filename)[0])
    except InvalidWheelFilename:
        return ""


#: The most of a wheel's METADATA read (its headers come first; the rest is the long description).
METADATA_LIMIT = 1 << 20


def wheel_metadata(wheel: Path) -> tuple[str, Message]:
    """The name and headers of a wheel file's one top-level ``*.dist-info/METADATA``.

    ValueError when the file is not a readable wheel or holds no such file, or more than one.
    """
    try:
        with zipfile.ZipFile(wheel) as zf:
            found = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
            if len(found) != 1:
                raise ValueError(f"the wheel holds {len(found)} top-level .dist-info/METADATA files, not one")
            with zf.open(found[0]) as fh:
                head = fh.read(METADATA_LIMIT)
    except (zipfile.BadZipFile, OSError, EOFError, NotImplementedError, zlib.error) as exc:
        raise ValueError(f"not a readable wheel ({exc})") from None
    return found[0], BytesHeaderParser().parsebytes(head)


def wheel_problem(wheel: Path, project: str, version: str = "") -> str | None:
    """Why ``wheel`` is not a wheel of ``project`` (at ``version``, when given); None when it is.

    A file name is anyone's word: the ``Name`` and ``Version`` of the wheel's own ``*.dist-info/METADATA``
    (what pip installs it as) must be the project and version of its file name, and those the expected ones.
    """
    try:
        name, file_version, _build, _tags = parse_wheel_filename(wheel.name)
    except InvalidWheelFilename:
        return f"{wheel.name!r} is not a wheel file name (NAME-VERSION-TAGS.whl)"
    want = canonicalize_name(project)
    if name != want:
        return f"its file name {wheel.name} is of {str(name)!r}, not {project!r}"
    if version and not _same_version(str(file_version), version):
        return f"its file name {wheel.name} is of version {file_version}, not {version}"
    try:
        where, meta = wheel_metadata(wheel)
    except ValueError as exc:
        return str(exc)
    meta_name, meta_version = (meta.get("Name") or "").strip(), (meta.get("Version") or "").strip()
    if not meta_name or not meta_version:
        return f"its {where} has no {'Name' if not meta_name else 'Version'}"
    if canonicalize_name(meta_name) != want:
        return f"its {where} names the project {meta_name!r}, not {project!r}"
    if not _same_version(meta_version, str(file_version)):
        return f"its {where} says version {meta_version}, but its file name {wheel.name} says {file_version}"
    return None


def _same_version(a: str, b: str) -> bool:
    try:
        return Version(a) == Version(b)
    except InvalidVersion:
        return a == b


@dataclass(frozen=True, kw_only=True)
class WheelRecord:
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
        return str(parse_wheel_filename(self.filename)[0])

    @property
    def version(self) -> str:
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


def manifest(
    records: Sequence[WheelRecord],
    *,
    lock: str,
    lock_sha256: str,
    profile: str,
    archs: Sequence[str],
    runtime: Mapping[str, Any] | None = None,
) -> str:
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


def requirements(records: Sequence[WheelRecord]) -> str:
    lines = [
        "# Generated by `doit wheels`: install with",
        "#   pip install --no-index --find-links wheels/ --require-hashes -r wheels/requirements.txt",
    ]
    for r in sorted(records, key=lambda r: canonicalize_name(r.name)):
        lines.append(f"{r.name}=={r.version} --hash=sha256:{r.sha256}")
    return "\n".join(lines) + "\n"


def _page(title: str, links: Sequence[tuple[str, str]]) -> str:
    body = "\n".join(f'    <a href="{html.escape(href)}">{html.escape(text)}</a><br/>' for href, text in links)
    return (
        '<!DOCTYPE html>\n<html>\n  <head>\n    <meta name="pypi:repository-version" content="1.0">\n'
        f"    <title>{html.escape(title)}</title>\n  </head>\n  <body>\n{body}\n  </body>\n</html>\n"
    )


def simple_index(records: Sequence[WheelRecord]) -> dict[str, str]:
    """Files of a PEP 503 index rooted at ``wheels/simple/``: relative path -> content.

    Links point at ``../../<wheel>`` so the index works from any location.
    """
    projects: dict[str, list[WheelRecord]] = {}
    for r in records:
        projects.setdefault(str(canonicalize_name(r.name)), []).append(r)
    files = {
        "index.html": _page("Simple index", [(f"{p}/", p) for p in sorted(projects)]),
    }
    for project, recs in sorted(projects.items()):
        links = [(f"../../{r.filename}#sha256={r.sha256}", r.filename) for r in sorted(recs, key=lambda r: r.filename)]
        files[f"{project}/index.html"] = _page(f"Links for {project}", links)
    return files
