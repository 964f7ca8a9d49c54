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
        SHA256SUMS       every other file's sha256 (`sha256sum -c` input)

and ``<bundle>.sha256`` beside it for checking the transfer. Entries are
sorted, with fixed times and owners, so the same inputs give the same bundle.

`doit unbundle` checks every member before anything is written (only regular
files and directories, all under ``reprostack-bundle/``: no links, devices,
absolute names or ``..``), compares the file list with SHA256SUMS, then streams
each file into a private temporary directory while hashing it, stops at the
first that differs, and only then renames the directory into place; a damaged
bundle is refused and leaves nothing behind. SHA256SUMS travels inside the
bundle, so only the ``.sha256`` (when it was obtained apart from the bundle)
protects the content against someone who altered both (:func:`check_transfer`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks import members
from tasks.cache import rmtree, warn, write_atomic
from tasks.errors import BundleError
from tasks.treehash import file_sha256
from tasks.wheelnorm import DEFAULT_EPOCH

TOP = "reprostack-bundle"
SUMS = "SHA256SUMS"
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
    entries: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        digest, sep, rel = line.partition("  ")
        if not sep or len(digest) != 64 or not rel:
            raise BundleError(f"{SUMS} line {number} is malformed: {line!r}")
        entries[rel] = digest
    return entries


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
    info: dict[str, Any],
) -> tuple[Path, str]:
    """Write the bundle to ``out`` atomically; return its path and sha256."""
    if not (wheels / "manifest.json").is_file():
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
    """Compare the bundle with the ``.sha256`` file beside it, if there is one; the digest checked, or None.

    SHA256SUMS travels inside the bundle: whoever can alter the bundle can rewrite it to match, so it
    catches damage, not tampering. Only a digest obtained apart from the bundle (the one `doit bundle`
    printed, sent over another channel) protects the content. Without a ``.sha256`` the bundle is
    unpacked on its SHA256SUMS alone, with a warning giving its sha256 to compare by hand.
    """
    side = bundle.with_name(bundle.name + ".sha256")
    if not side.is_file():
        warn(
            f"no {side.name} beside {bundle}: its files are checked only against the SHA256SUMS it carries, "
            f"which whoever altered it could have rewritten. Its sha256 is {file_sha256(bundle)}: compare it "
            "with the one `doit bundle` printed, obtained apart from the bundle, before trusting what it holds"
        )
        return None
    words = side.read_text().split()
    expected = words[0] if words else ""
    actual = file_sha256(bundle)
    if actual != expected:
        raise BundleError(f"{bundle}: sha256 {actual} differs from {side.name} ({expected}); refusing it")
    return expected


def _problems(listed: dict[str, str], present: set[str]) -> list[str]:
    problems = [f"missing: {rel}" for rel in sorted(set(listed) - present)]
    return problems + [f"not listed in {SUMS}: {rel}" for rel in sorted(present - set(listed))]


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


def _checked_members(tar: tarfile.TarFile, bundle: Path) -> list[tuple[tarfile.TarInfo, str]]:
    """(member, path under TOP) of every regular file, after checking every member; nothing is written."""
    infos = tar.getmembers()
    kinds = [
        members.Member(
            name=i.name,
            kind=members.FILE
            if i.isreg()
            else members.DIRECTORY
            if i.isdir()
            else members.SYMLINK
            if i.issym()
            else "hard link or special file",
            target=i.linkname,
            mode=i.mode,
        )
        for i in infos
    ]
    try:
        checked = members.check(kinds, links=False)
    except members.UnsafeMember as exc:
        raise BundleError(f"{bundle}: refused, nothing was unpacked: member {exc}") from None
    files = []
    for info, member in zip(infos, checked, strict=True):
        if member.name != TOP and not member.name.startswith(TOP + "/"):
            raise BundleError(f"{bundle}: entries outside {TOP}/; refusing it")
        if member.kind == members.FILE:
            files.append((info, member.name[len(TOP) + 1 :]))
    return files


def unpack(bundle: Path, dest: Path) -> dict[str, Any]:
    """Verify ``bundle`` and unpack it to ``dest`` (which must not exist); return its BUNDLE.json.

    Every member is checked (only files and directories under the bundle's top directory) and the
    file list compared with SHA256SUMS before anything is written; each file's bytes are hashed as
    they stream into a private temporary directory beside ``dest`` and the unpacking stops at the
    first that differs. Only a complete, verified tree is renamed to ``dest``.
    """
    if not bundle.is_file():
        raise BundleError(f"{bundle}: no such bundle file")
    if dest.exists():
        raise BundleError(f"{dest} exists; choose a new dest= (unbundling never overwrites)")
    check_transfer(bundle)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        try:
            with tarfile.open(bundle, "r:") as tar:
                files = _checked_members(tar, bundle)
                sums_member = next((info for info, rel in files if rel == SUMS), None)
                if sums_member is None:
                    raise BundleError(f"the bundle has no {TOP}/{SUMS}; refusing it")
                sums = tar.extractfile(sums_member)
                assert sums is not None
                listed = parse_sums(sums.read().decode("utf-8", "replace"))
                problems = _problems(listed, {rel for _info, rel in files} - {SUMS})
                if problems:
                    raise _refuse(problems)
                for info, rel in files:
                    target = tmp / TOP / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    source = tar.extractfile(info)
                    assert source is not None
                    digest = hashlib.sha256()
                    with source, target.open("xb") as out:
                        while chunk := source.read(1 << 20):
                            digest.update(chunk)
                            out.write(chunk)
                    if rel != SUMS and digest.hexdigest() != listed[rel]:
                        raise _refuse([f"sha256 differs: {rel}"])
                    os.chmod(target, 0o755 if info.mode & 0o100 else 0o644)
            top = tmp / TOP
            doc: dict[str, Any] = json.loads((top / "BUNDLE.json").read_text())
        except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
            raise BundleError(f"{bundle}: not a readable bundle ({exc}); nothing was unpacked") from None
        doc["verified_files"] = len(listed)
        os.replace(top, dest)
        return doc
    finally:
        rmtree(tmp)


def main(argv: list[str] | None = None) -> int:
    """``python3 -m tasks.bundle BUNDLE DEST``: verify and unpack without doit (an air-gapped host may lack it)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python3 -m tasks.bundle BUNDLE DEST", file=sys.stderr)
        return 2
    try:
        doc = unpack(Path(args[0]), Path(args[1]))
    except BundleError as exc:
        print(f"BundleError: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"verified {doc['verified_files']} files and unpacked them to {args[1]} (parts: {', '.join(doc['parts'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
