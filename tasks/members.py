"""What may come out of an archive, a git tree or a bundle: checked before anything is written.

Upstream archives and repositories are not trusted (docs/security.md). tarfile's ``data`` filter
exists only from Python 3.11.4 (Debian bookworm ships 3.11.2) and was bypassable until 3.11.13 /
3.12.11 (CVE-2025-4517: symlink chains whose resolved path exceeds PATH_MAX), so these checks stand
alone, on names and link targets as written, never on the file system:

- a member is a regular file, a directory or a symbolic link; never a hard link, a device, a fifo;
- no setuid, setgid or sticky bit;
- its name is relative, without ``..``, empty or NUL components, and not ``.`` itself twice;
- no member lies under another member that is a symbolic link (nothing is written through a link);
- a link's target, resolved lexically from the link's directory, stays inside the tree (so a link
  can never name a host file such as ``/etc/shadow`` or ``../../secret``);
- no name appears twice.

Pure: callers pass names, kinds, modes and link targets; tasks/archive.py, tasks/bundle.py and
tasks/gitsrc.py do the I/O, and write links last.
"""

from __future__ import annotations

import posixpath
import stat
from collections.abc import Iterable
from dataclasses import dataclass

FILE, DIRECTORY, SYMLINK = "file", "directory", "symlink"


class UnsafeMember(ValueError):
    """A member that must not be extracted; the message names it and says why."""


@dataclass(frozen=True)
class Member:
    name: str  # as in the archive, '/'-separated
    kind: str  # FILE, DIRECTORY or SYMLINK; anything else is refused by the reader
    mode: int = 0o644  # permission bits as stored
    target: str = ""  # a symlink's target


def clean_name(name: str) -> str:
    """``name`` normalised ('./a//b/' -> 'a/b'), or UnsafeMember when it could leave the tree."""
    if "\0" in name:
        raise UnsafeMember(f"{name!r}: NUL in the name")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise UnsafeMember(f"{name!r}: absolute name")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeMember(f"{name!r}: '..' in the name")
    if not parts:
        raise UnsafeMember(f"{name!r}: empty name")
    return "/".join(parts)


def target_inside(link: str, target: str) -> bool:
    """Whether symlink ``link`` (a clean name) pointing at ``target`` stays inside the tree, lexically."""
    if not target or target.startswith("/") or "\0" in target:
        return False
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(link), target))
    return resolved != ".." and not resolved.startswith("../") and not resolved.startswith("/")


def check(members: Iterable[Member], *, links: bool = True) -> list[Member]:
    """The members with clean names, in order; UnsafeMember on the first that must not be written.

    ``links=False`` refuses symbolic links altogether (bundles hold only files and directories).
    """
    seen: dict[str, str] = {}
    symlinks: set[str] = set()
    out = []
    for m in members:
        name = clean_name(m.name)
        if m.kind not in (FILE, DIRECTORY, SYMLINK):
            raise UnsafeMember(f"{m.name!r}: a {m.kind}; only files, directories and symbolic links are allowed")
        if m.kind == SYMLINK and not links:
            raise UnsafeMember(f"{m.name!r}: a symbolic link; only files and directories are allowed here")
        if m.mode & (stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX) and m.kind != SYMLINK:
            raise UnsafeMember(f"{m.name!r}: setuid, setgid or sticky bit (mode {m.mode:o})")
        if name in seen and not (m.kind == DIRECTORY and seen[name] == DIRECTORY):
            raise UnsafeMember(f"{m.name!r}: appears twice")
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in symlinks:
                raise UnsafeMember(f"{m.name!r}: lies under the symbolic link {'/'.join(parts[:i])!r}")
        if m.kind == SYMLINK:
            if not target_inside(name, m.target):
                raise UnsafeMember(f"{m.name!r}: symbolic link to {m.target!r}, outside the tree")
            if any(other.startswith(name + "/") for other in seen):
                raise UnsafeMember(f"{m.name!r}: a symbolic link over members already listed under it")
            symlinks.add(name)
        seen[name] = m.kind
        out.append(Member(name=name, kind=m.kind, mode=m.mode, target=m.target))
    return out
