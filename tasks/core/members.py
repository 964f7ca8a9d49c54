"""What may come out of an archive, a git tree or a bundle: checked before anything is written.

Upstream archives and repositories are not trusted (docs/security.md). tarfile's ``data`` filter
exists only from Python 3.11.4 (Debian bookworm ships 3.11.2) and was bypassable until 3.11.13 /
3.12.11 (CVE-2025-4517: symlink chains whose resolved path exceeds PATH_MAX), so these checks stand
alone, on names and link targets as written, never on the file system:

- a member is a regular file, a directory or a symbolic link; never a hard link, a device, a fifo;
- no setuid, setgid or sticky bit;
- its name is relative, without ``..``, empty or NUL components, and not ``.`` itself twice;
- no member lies under another member that is a symbolic link (nothing is written through a link);
- a link's target, followed component by component from the link's directory through the tree's
  own links as the kernel follows it, stays inside the tree (so a link can never name a host file
  such as ``/etc/shadow`` or ``../../secret``, not even through a chain such as ``d/l -> ..`` and
  ``x -> d/l/d/l/../../../etc/shadow``, which normalises inside but climbs out; :func:`resolve`);
- no name appears twice.

Pure but for :func:`tree_links`: callers pass names, kinds, modes and link targets; tasks/core/archive.py,
tasks/image/bundle.py and tasks/lock/git.py do the I/O, and write links last. Staging and the cached-tree
check (tasks/stages/patch.py, tasks/lock/fetch.py) run :func:`escaping_link` on the links of the tree on disk,
staging again after each patch (git apply writes the links a diff adds, to any target).
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

FILE, DIRECTORY, SYMLINK = "file", "directory", "symlink"

#: The most symbolic links one lookup follows (Linux's MAXSYMLINKS: the kernel gives up there too, ELOOP).
MAX_HOPS = 40


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


def resolve(path: str, links: Mapping[str, str]) -> str | None:
    """Where ``path`` (relative to the tree's root) leads, following the tree's links (name -> target).

    Component by component, as the kernel resolves a path: a name that is a link is replaced by its
    target, read from the link's directory; ``..`` goes to the parent of the directory reached so far,
    which never contains a link, so this is the real parent, not a lexical one. Never touches the file
    system, so no path grows past PATH_MAX (os.path.realpath gives up there and goes on lexically,
    which is how CVE-2025-4517 escaped tarfile's filter). None when the path leaves the tree at any
    step, meets an absolute target, or needs more than :data:`MAX_HOPS` links. A name the tree does not
    have counts as a directory: the kernel would stop there, so this errs on the side of refusing.
    """
    reached: list[str] = []
    pending = path.split("/")[::-1]  # a stack: the next component last
    hops = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not reached:
                return None
            reached.pop()
            continue
        reached.append(part)
        target = links.get("/".join(reached))
        if target is None:
            continue
        hops += 1
        if hops > MAX_HOPS or not target or target.startswith("/") or "\0" in target:
            return None
        reached.pop()
        pending.extend(target.split("/")[::-1])
    return "/".join(reached)


def escaping_link(links: Mapping[str, str]) -> str | None:
    """The first link (by name) of a tree whose links are ``links`` that leads outside it, or None."""
    for name in sorted(links):
        if resolve(name, links) is None:
            return name
    return None


def tree_links(root: Path) -> dict[str, str]:
    """The symbolic links under ``root`` (relative '/'-separated name -> target), read, never followed."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):  # does not descend into links to directories
        for name in (*dirnames, *filenames):
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                found[Path(full).relative_to(root).as_posix()] = os.readlink(full)
    return found


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
    # Each link followed through all the others (wherever they are listed): a chain that climbs out is refused.
    targets = {m.name: m.target for m in out if m.kind == SYMLINK}
    bad = escaping_link(targets)
    if bad is not None:
        raise UnsafeMember(
            f"{bad!r}: symbolic link to {targets[bad]!r}, outside the tree once the tree's own symbolic links "
            f"are followed (or a chain of more than {MAX_HOPS})"
        )
    return out
