"""The normalised tree hash of a source tree, and the file filter applied before it.

The hash covers, for every file and symlink under the root, its relative
POSIX path, its kind, the executable bit of files, and the sha256 of the
content (or of the link target). Owners, timestamps, other mode bits and
empty directories do not count, so the same tree unpacked from a git
checkout, a tarball or a zip hashes the same.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

TREE_HASH_VERSION = "tree-v1"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One member of a normalised tree."""

    path: str
    kind: str  # "file" or "symlink"
    executable: bool
    digest: str

    def line(self) -> bytes:
        mode = "755" if self.executable else "644"
        if self.kind == "symlink":
            mode = "120"
        return f"{self.kind} {mode} {self.digest} {self.path}\n".encode()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def bytes_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hash_entries(entries: Iterable[Entry]) -> str:
    """Combine entries (any order) into the tree hash."""
    h = hashlib.sha256(TREE_HASH_VERSION.encode() + b"\n")
    for entry in sorted(entries, key=lambda e: e.path.encode()):
        if "\n" in entry.path:
            raise ValueError(f"path with a newline cannot be hashed: {entry.path!r}")
        h.update(entry.line())
    return h.hexdigest()


def walk(root: Path) -> Iterator[Entry]:
    """Every file and symlink under ``root`` as an :class:`Entry`."""
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        names = list(filenames)
        # Symlinks to directories show up in dirnames: treat them as links.
        for d in list(dirnames):
            if (base / d).is_symlink():
                dirnames.remove(d)
                names.append(d)
        for name in names:
            full = base / name
            rel = full.relative_to(root).as_posix()
            st = full.lstat()
            if stat.S_ISLNK(st.st_mode):
                yield Entry(rel, "symlink", False, bytes_sha256(os.readlink(full).encode()))
            elif stat.S_ISREG(st.st_mode):
                yield Entry(rel, "file", bool(st.st_mode & stat.S_IXUSR), file_sha256(full))
            else:
                raise ValueError(f"{full}: only regular files and symlinks can be part of a source tree")


def tree_sha256(root: Path) -> str:
    """The normalised tree hash of the directory ``root``."""
    return hash_entries(walk(root))


@dataclass(frozen=True)
class FileFilter:
    """Which files of a source are kept: gitignore-style ``include`` and ``exclude`` patterns.

    With no include pattern everything is included; exclude wins over include.
    """

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # GitIgnoreSpec follows git exactly: a file under an excluded directory
        # is excluded too, and '!' re-includes. Imported here: a no-op run builds no filter.
        import pathspec

        object.__setattr__(self, "_inc", pathspec.GitIgnoreSpec.from_lines(self.include))
        object.__setattr__(self, "_exc", pathspec.GitIgnoreSpec.from_lines(self.exclude))

    @property
    def active(self) -> bool:
        return bool(self.include or self.exclude)

    def keeps(self, path: str) -> bool:
        if self.include and not self._inc.match_file(path):  # type: ignore[attr-defined]
            return False
        return not (self.exclude and self._exc.match_file(path))  # type: ignore[attr-defined]

    def apply(self, root: Path) -> None:
        """Delete the files under ``root`` that the filter does not keep, then empty directories."""
        if not self.active:
            return
        for entry in list(walk(root)):
            if not self.keeps(entry.path):
                (root / entry.path).unlink()
        for dirpath, _dirnames, _files in sorted(os.walk(root), key=lambda t: -len(t[0])):
            p = Path(dirpath)
            if p != root and not any(p.iterdir()):
                p.rmdir()
