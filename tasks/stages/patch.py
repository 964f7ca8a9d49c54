"""Stage 2: a fresh copy of a package's verified sources with its patches applied in order.

A patch that does not apply raises :class:`PatchError` naming the patch and
the failing hunk, and the half-patched copy is removed. A patch that leaves a
symbolic link out of the tree raises :class:`VerificationError` naming the patch
and the link, and the copy is removed too.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from tasks.core import members, proc
from tasks.core.errors import PatchError, VerificationError
from tasks.core.fsutil import rmtree
from tasks.lock.lockfile import Package
from tasks.store.wheelnorm import DEFAULT_EPOCH


class Patch(NamedTuple):
    """A patch to apply: its name (in the key and the logs), its file, ``git apply -p<strip>``."""

    name: str
    path: Path
    strip: int = 1


_FAILED_AT = re.compile(r"patch failed: (?P<path>.+):(?P<line>\d+)")


def failing_hunk(patch_text: str, path: str, line: int) -> str:
    """The ``@@`` header of the hunk of ``patch_text`` for ``path`` that starts at ``line``."""
    current = None
    for raw in patch_text.splitlines():
        if raw.startswith("+++ ") or raw.startswith("--- "):
            name = raw[4:].split("\t")[0].strip()
            if name != "/dev/null":
                current = name[2:] if name[:2] in ("a/", "b/") else name
        elif raw.startswith("@@") and current == path:
            m = re.match(r"@@ -(\d+)", raw)
            if m and int(m.group(1)) == line:
                return raw
    return ""


def apply_patches(root: Path, patches: Sequence[Patch], log: Path) -> None:
    """Apply each patch to the tree at ``root`` with ``git apply``; after each, every symbolic link of the tree
    must lead inside it (:class:`VerificationError` naming the patch and the link)."""
    env = dict(os.environ)
    # Never let git discover a repository around the staged tree (ours, say).
    env["GIT_CEILING_DIRECTORIES"] = str(root.parent)
    env["LC_ALL"] = "C"
    for name, path, strip in patches:
        data = path.read_bytes()
        applied = path.resolve()
        if data and not data.endswith(b"\n"):
            # git apply calls a diff whose last line lacks its newline corrupt (GNU patch takes it, with fuzz):
            # an editor's or a copy's artifact, as in InfiR2's sglang.patch. Apply it with the newline added.
            applied = root.parent / f".{root.name}.{path.name}"
            applied.write_bytes(data + b"\n")
            with log.open("a") as f:
                f.write(f"# {name}: the file's last line has no newline; applied with one added\n")
        try:
            proc.run(
                ["git", "apply", "--verbose", "--whitespace=nowarn", f"-p{strip}", str(applied)],
                env=env,
                cwd=root,
                log=log,
                error=PatchError,
                what=f"patch {name}",
            )
        except PatchError as exc:
            detail = ""
            m = _FAILED_AT.search(proc.tail(log, 200))
            if m:
                hunk = failing_hunk(
                    path.read_text(errors="replace"),
                    m.group("path"),
                    int(m.group("line")),
                )
                detail = f"\nfailing hunk: {m.group('path')}: {hunk or 'line ' + m.group('line')}"
            raise PatchError(
                f"patch {path} does not apply to the pinned sources{detail}\n"
                f"{exc.message}\nNo patched tree was kept. Refresh the patch against the pinned commit."
            ) from None
        finally:
            if applied != path.resolve():
                applied.unlink(missing_ok=True)
        # git apply writes symbolic links as the diff says (`new file mode 120000`), to any target: the tree the
        # build compiles must lead nowhere out of itself, followed through its own links as after the fetch.
        links = members.tree_links(root)
        bad = members.escaping_link(links)
        if bad is not None:
            raise VerificationError(
                f"patch {name} makes {bad} a symbolic link out of the tree: {bad} -> {links[bad]}; refusing to build "
                "from it, no patched tree was kept (a patch may add links only to files of the sources)"
            )


def settle_patched_mtimes(root: Path, *, since: float) -> None:
    """Give the files the patches wrote (modified at ``since`` or later) the fixed epoch as their mtime.

    nvcc records each source file's mtime in the line tables of ``-lineinfo``
    device code, so a patched header otherwise puts the time of staging into
    the wheel (FA3's patched ``sm90_pipeline_no_cluster.hpp`` did). Unpatched
    files keep the cached tree's mtimes, which are fixed already.
    """
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path) and os.stat(path).st_mtime >= since - 1:
                os.utime(path, (DEFAULT_EPOCH, DEFAULT_EPOCH))


def stage_package(
    pkg: Package,
    *,
    trees: Mapping[str, Path],
    patches: Sequence[Patch],
    dest: Path,
    log: Path,
) -> Path:
    """Copy the package's source trees to ``dest``, apply its patches; return the build directory.

    ``trees`` maps source names to their verified cached trees.
    """
    rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        shutil.copytree(trees[pkg.source], dest, symlinks=True)
        for rel, src_name in pkg.overlays:
            target = dest / rel
            if target.exists() and any(target.iterdir()):
                raise PatchError(f"package {pkg.name}: overlay {rel!r} would overwrite files of {pkg.source}")
            if target.exists():
                target.rmdir()
            shutil.copytree(trees[src_name], target, symlinks=True)
        # Cached trees are read-only inputs; the copy must be writable for the build.
        links: dict[str, str] = {}
        for dirpath, dirs, files in os.walk(dest):  # not into links to directories
            os.chmod(dirpath, 0o755)
            for i, f in enumerate((*dirs, *files)):
                p = os.path.join(dirpath, f)
                if os.path.islink(p):
                    links[os.path.relpath(p, dest)] = os.readlink(p)
                elif i >= len(dirs):
                    os.chmod(p, 0o755 if os.stat(p).st_mode & 0o100 else 0o644)
        # The build reads through every link: each must lead inside the staged tree, followed through the
        # others (overlays included, which no single source's check saw together) as the kernel follows them.
        bad = members.escaping_link(links)
        if bad is not None:
            raise VerificationError(
                f"package {pkg.name}: staged sources hold a symbolic link out of the tree: {bad} -> {links[bad]}; "
                "refusing to build from them (check the sources and overlays in the lock)"
            )
        started = time.time()
        apply_patches(dest, patches, log)
        settle_patched_mtimes(dest, since=started)
    except BaseException:
        rmtree(dest)
        raise
    build_dir = dest / pkg.subdir if pkg.subdir else dest
    if not build_dir.is_dir():
        rmtree(dest)
        raise PatchError(f"package {pkg.name}: subdir {pkg.subdir!r} does not exist in source {pkg.source}")
    return build_dir
