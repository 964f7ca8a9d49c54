"""Air-gapped delivery: one bundle file out (`doit bundle`), verified before use on the other side (`doit unbundle`).

The bundle is an uncompressed tar (wheels and image layers are compressed
already) holding one directory::

    reprostack-bundle/
        BUNDLE.json      what is inside: lock sha256, profile, parts
        lock/            the lock file the wheels were built from
        wheels/          the wheelhouse: wheels, manifest.json, simple/, requirements.txt,
                         sbom.cdx.json, provenance/
        image/           the exported image (docker-archive, OCI layout), with bundle_image=on
        mirror/          what `doit mirror` writes (trees/, archives/, wheels/, index.json), with bundle_mirror=on
        tool/            the tool's own wheels and their hash-pinned requirements.txt (tasks/image/selfwheels.py)
        unbundle.py      the unpacker (tasks/outside/unbundle.py): checks and unpacks with python3 alone
        SHA256SUMS       every other file's sha256 (`sha256sum -c` input)

and ``<bundle>.sha256`` beside it for checking the transfer. Entries are
sorted, with fixed times and owners, so the same inputs give the same bundle.

`doit unbundle`, like ``unbundle.py`` where only python3 is, checks every member before
anything is written (only regular files and directories, all under ``reprostack-bundle/``: no links, devices,
absolute names or ``..``), compares the file list with SHA256SUMS, then streams
each file into a private temporary directory while hashing it, stops at the
first that differs, and only then renames the directory into place; a damaged
bundle is refused and leaves nothing behind. SHA256SUMS travels inside the
bundle, so only the ``.sha256`` (when it was obtained apart from the bundle)
protects the content against someone who altered both (:func:`check_transfer`).
"""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.core.console import warn
from tasks.core.errors import BundleError
from tasks.core.fsutil import write_atomic
from tasks.core.treehash import file_sha256
from tasks.outside import unbundle
from tasks.store.manifest import MANIFEST_FILE
from tasks.store.wheelnorm import DEFAULT_EPOCH

TOP = unbundle.TOP
SUMS = unbundle.SUMS
FORMAT = 1


def _files(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            yield Path(dirpath) / name


def sums_text(root: Path) -> str:
    """SHA256SUMS for every file under ``root`` except SHA256SUMS itself, sorted by path."""
    lines = []
    for path in _files(root):
        rel = path.relative_to(root).as_posix()
        if rel != SUMS:
            lines.append(f"{file_sha256(path)}  {rel}\n")
    return "".join(sorted(lines, key=lambda line: line[66:]))


def parse_sums(text: str) -> dict[str, str]:
    try:
        return unbundle.parse_sums(text)
    except unbundle.Refused as exc:
        raise BundleError(str(exc)) from None


def _add_tree(tar: tarfile.TarFile, root: Path, arcroot: str) -> None:
    """Add ``root`` as ``arcroot`` with sorted entries, fixed times and owners, normalised modes."""
    paths = [root, *sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix())]
    for path in paths:
        rel = path.relative_to(root).as_posix()
        info = tar.gettarinfo(str(path), arcname=arcroot if rel == "." else f"{arcroot}/{rel}")
        info.mtime = DEFAULT_EPOCH
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        if info.isdir():
            info.mode = 0o755
            tar.addfile(info)
        elif info.isfile():
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            with path.open("rb") as fh:
                tar.addfile(info, fh)
        else:
            raise BundleError(f"{path}: only regular files and directories can go into a bundle")


def write_bundle(
    out: Path,
    *,
    wheels: Path,
    image: list[Path] | None = None,
    mirror: Path | None = None,
    lock: Path | None = None,
    tool: Path | None = None,
    info: dict[str, Any],
) -> tuple[Path, str]:
    """Write the bundle to ``out`` atomically; return its path and sha256."""
    if not (wheels / MANIFEST_FILE).is_file():
        raise BundleError(f"{wheels} is not a complete wheelhouse (no manifest.json): run `doit wheels` first")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".bundle-", dir=out.parent) as tmp:
        top = Path(tmp) / TOP
        shutil.copytree(wheels, top / "wheels")
        parts = ["wheels"]
        if lock is not None:
            (top / "lock").mkdir()
            shutil.copy2(lock, top / "lock" / lock.name)
        if image:
            (top / "image").mkdir()
            for item in image:
                if item.is_dir():
                    shutil.copytree(item, top / "image" / item.name)
                else:
                    shutil.copy2(item, top / "image" / item.name)
            parts.append("image")
        if mirror is not None:
            shutil.copytree(mirror, top / "mirror")
            parts.append("mirror")
        if tool is not None:  # the tool's own wheels (tasks/image/selfwheels.py)
            shutil.copytree(tool, top / "tool")
            parts.append("tool")
        # The unpacker, so that a host with python3 alone checks and unpacks the bundle (tasks/outside/unbundle.py).
        shutil.copyfile(Path(unbundle.__file__), top / unbundle.NAME)
        doc = {"format": FORMAT, "parts": parts, **info}
        (top / "BUNDLE.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        sums = sums_text(top)
        (top / SUMS).write_text(sums)
        partial = out.with_name(f".{out.name}.partial")
        with tarfile.open(partial, "w", format=tarfile.GNU_FORMAT) as tar:
            _add_tree(tar, top, TOP)
        digest = file_sha256(partial)
        os.replace(partial, out)
    write_atomic(out.with_name(out.name + ".sha256"), f"{digest}  {out.name}\n")
    return out, digest


def check_transfer(bundle: Path) -> str | None:
    """Compare the bundle with the ``.sha256`` file beside it, if there is one (tasks/outside/unbundle.py)."""
    try:
        return unbundle.check_transfer(str(bundle), warn)
    except unbundle.Refused as exc:
        raise BundleError(str(exc)) from None


def _problems(listed: dict[str, str], present: set[str]) -> list[str]:
    return unbundle.list_problems(listed, present)


def _refuse(problems: list[str]) -> BundleError:
    shown = "\n  ".join(problems[:20]) + (f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else "")
    return BundleError(f"the bundle was altered or is incomplete; nothing was unpacked:\n  {shown}")


def verify_tree(top: Path) -> int:
    """Check that the files under ``top`` are exactly those SHA256SUMS lists, with those hashes; the count."""
    sums_file = top / SUMS
    if not sums_file.is_file():
        raise BundleError(f"the bundle has no {TOP}/{SUMS}; refusing it")
    listed = parse_sums(sums_file.read_text())
    present = {p.relative_to(top).as_posix() for p in _files(top)} - {SUMS}
    problems = _problems(listed, present)
    problems += [
        f"sha256 differs: {rel}" for rel in sorted(set(listed) & present) if file_sha256(top / rel) != listed[rel]
    ]
    if problems:
        raise _refuse(problems)
    return len(listed)


def unpack(bundle: Path, dest: Path) -> dict[str, Any]:
    """Verify ``bundle`` and unpack it to ``dest`` (which must not exist); return its BUNDLE.json.

    The code is the bundle's own unpacker, tasks/outside/unbundle.py (standard library only, so it runs
    where the tool is not installed): every member is checked (only files and directories under the
    bundle's top directory) and the file list compared with SHA256SUMS before anything is written;
    each file's bytes are hashed as they stream into a private temporary directory beside ``dest``
    and the unpacking stops at the first that differs. Only a complete, verified tree is renamed to
    ``dest``.
    """
    try:
        return unbundle.unpack(str(bundle), str(dest), warn)
    except unbundle.Refused as exc:
        raise BundleError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    """``python3 -m tasks.image.bundle BUNDLE DEST``: tasks/outside/unbundle.py's command, kept for old instructions."""
    return unbundle.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
