"""Unpack source archives safely, and pack trees for the mirror.

Every member is checked (tasks/core/members.py) before anything is written, on every Python from 3.11.0:
the stdlib's extraction filter is a second line where this Python has one.
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat
import tarfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from tasks.core import members
from tasks.core.errors import FetchError, VerificationError

Info = TypeVar("Info", tarfile.TarInfo, zipfile.ZipInfo)


def _tar_member(info: tarfile.TarInfo) -> members.Member:
    if info.isreg():
        kind = members.FILE
    elif info.isdir():
        kind = members.DIRECTORY
    elif info.issym():
        kind = members.SYMLINK
    elif info.islnk():
        kind = "hard link"
    elif info.ischr() or info.isblk():
        kind = "device"
    elif info.isfifo():
        kind = "fifo"
    else:
        kind = f"member of tar type {info.type!r}"
    return members.Member(name=info.name, kind=kind, mode=info.mode, target=info.linkname)


def _extract_tar(archive: Path, dest: Path) -> None:
    with tarfile.open(archive, "r:*") as tf:
        infos = tf.getmembers()
        checked = members.check(_tar_member(i) for i in infos)  # all of them, before anything is written
        # The stdlib's filter as a second line, where this Python has it (3.11.4 and later).
        data_filter = getattr(tarfile, "data_filter", None)
        if data_filter is not None:
            for info in infos:
                data_filter(info, str(dest))

        def write(info: tarfile.TarInfo, target: Path) -> None:
            source = tf.extractfile(info)
            assert source is not None  # a regular file
            with source, target.open("xb") as out:
                shutil.copyfileobj(source, out)
            os.utime(target, (info.mtime, info.mtime))

        _write(dest, infos, checked, write)


def _write(
    dest: Path, infos: Sequence[Info], checked: Sequence[members.Member], write: Callable[[Info, Path], None]
) -> None:
    """Create the checked members under ``dest``: directories, files (by ``write``, then 644 or 755), links last."""
    links = []
    for info, member in zip(infos, checked, strict=True):
        target = dest / member.name
        if member.kind == members.DIRECTORY:
            target.mkdir(parents=True, exist_ok=True)
        elif member.kind == members.SYMLINK:
            links.append(member)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            write(info, target)
            os.chmod(target, 0o755 if member.mode & stat.S_IXUSR else 0o644)
    _make_links(dest, links)


def _make_links(dest: Path, links: list[members.Member]) -> None:
    """Symbolic links last: nothing is ever written through one (members.check refused members under them)."""
    for link in links:
        path = dest / link.name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(link.target, path)


def _zip_member(info: zipfile.ZipInfo) -> members.Member:
    mode = info.external_attr >> 16
    if info.is_dir():
        kind = members.DIRECTORY
    elif stat.S_ISLNK(mode):
        kind = members.SYMLINK
    elif stat.S_IFMT(mode) == 0 or stat.S_ISREG(mode):
        kind = members.FILE  # no file type recorded (zipfile.writestr, zips made on Windows): a plain file
    else:
        kind = f"special file (mode {mode:o})"
    return members.Member(name=info.filename, kind=kind, mode=stat.S_IMODE(mode))


def _extract_zip(archive: Path, dest: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        listed = [_zip_member(i) for i in infos]
        # A link's target is its content: read before any check, write nothing yet.
        listed = [
            members.Member(name=m.name, kind=m.kind, mode=m.mode, target=zf.read(i).decode("utf-8", "surrogateescape"))
            if m.kind == members.SYMLINK
            else m
            for i, m in zip(infos, listed, strict=True)
        ]
        checked = members.check(listed)

        def write(info: zipfile.ZipInfo, target: Path) -> None:
            with zf.open(info) as source, target.open("xb") as out:
                shutil.copyfileobj(source, out)

        _write(dest, infos, checked, write)


def unpack(archive: Path, dest: Path, strip: int | None = None) -> Path:
    """Unpack ``archive`` under ``dest`` and return the root of the source tree.

    ``strip`` removes that many leading directories; ``None`` strips a single
    top-level directory when the archive has exactly one (as sdists do).
    """
    raw = dest / "raw"
    raw.mkdir(parents=True)
    try:
        if zipfile.is_zipfile(archive):
            _extract_zip(archive, raw)
        else:
            _extract_tar(archive, raw)
    except members.UnsafeMember as exc:
        raise VerificationError(f"{archive}: refused, nothing of it was used: member {exc}") from None
    except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as exc:
        raise FetchError(f"{archive}: cannot unpack: {exc}") from None
    root = raw
    levels = strip
    if levels is None:
        children = list(root.iterdir())
        levels = 1 if len(children) == 1 and children[0].is_dir() and not children[0].is_symlink() else 0
    for _ in range(levels):
        children = list(root.iterdir())
        if len(children) != 1 or not children[0].is_dir():
            raise FetchError(f"{archive}: strip={strip} but the archive has no single top-level directory")
        root = children[0]
    if levels:
        # Links were checked against the archive's root; the tree is now a directory below it.
        links = members.tree_links(root)
        bad = members.escaping_link(links)
        if bad is not None:
            raise VerificationError(
                f"{archive}: refused, nothing of it was used: member {bad!r}: symbolic link to {links[bad]!r}, "
                f"outside the tree once {levels} leading director{'y is' if levels == 1 else 'ies are'} stripped"
            )
    return root


def pack_tree(root: Path, out: Path) -> None:
    """Write ``root`` as a gzip tarball with normalised metadata (for mirrors)."""

    def norm(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        if info.isfile():
            info.mode = 0o755 if info.mode & stat.S_IXUSR else 0o644
        elif info.isdir():
            info.mode = 0o755
        return info

    # gzip's header carries a time and a file name unless told otherwise: fix both, so
    # the same tree always packs to the same bytes (mirrors and bundles compare by hash).
    with (
        out.open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tf,
    ):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]):
                full = Path(dirpath) / name
                tf.add(
                    full,
                    arcname=full.relative_to(root).as_posix(),
                    recursive=False,
                    filter=norm,
                )
