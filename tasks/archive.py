"""Unpack source archives safely, and pack trees for the mirror."""

from __future__ import annotations

import gzip
import os
import stat
import tarfile
import zipfile
from pathlib import Path

from tasks.errors import FetchError


def _extract_tar(archive: Path, dest: Path) -> None:
    with tarfile.open(archive, "r:*") as tf:
        # The 'data' filter refuses absolute paths, '..', devices and links out of the tree.
        tf.extractall(dest, filter="data")


def _extract_zip(archive: Path, dest: Path) -> None:
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            target = (dest / info.filename).resolve()
            if not str(target).startswith(str(dest.resolve()) + os.sep) and target != dest.resolve():
                raise FetchError(f"{archive}: member {info.filename!r} would be written outside the tree")
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                target.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(zf.read(info).decode(), target)
                continue
            zf.extract(info, dest)
            if mode & stat.S_IXUSR and not info.is_dir():
                os.chmod(target, 0o755)


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
