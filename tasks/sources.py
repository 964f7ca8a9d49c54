"""Stage 1: fetch every pinned source once into the content-addressed source cache.

A source is looked up in the cache, then in the mirror directory, then on the
network. Whatever the origin, the archive's sha256 (where the lock has one)
and the tree hash of the kept tree are checked before the tree enters the
cache; nothing unverified reaches a build.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks import gitsrc, proc, pypi
from tasks.archive import pack_tree, unpack
from tasks.cache import Cache
from tasks.console import warn
from tasks.errors import VerificationError
from tasks.fsutil import copy_atomic, rmtree, write_atomic
from tasks.lockfile import Source
from tasks.members import escaping_link
from tasks.treehash import FileFilter, file_sha256, hash_entries, tree_sha256, walk


def source_filter(src: Source) -> FileFilter:
    return FileFilter(include=src.include, exclude=src.exclude)


def _mirror_tree(mirror: Path | None, src: Source) -> Path | None:
    if mirror is None or not src.tree_sha256:
        return None
    p = mirror / "trees" / f"{src.tree_sha256}.tar.gz"
    return p if p.is_file() else None


def _mirror_archive(mirror: Path | None, src: Source) -> Path | None:
    if mirror is None or not src.sha256:
        return None
    p = mirror / "archives" / src.sha256
    return p if p.is_file() else None


def _download_archive(src: Source, dest: Path) -> str:
    """Download a url/pypi source's archive to ``dest``; return where it came from."""
    if src.kind == "url":
        pypi.download(src.url, dest)
        return src.url
    link = pypi.find_file(src.project, src.filename)
    if link.sha256 and src.sha256 and link.sha256 != src.sha256:
        raise VerificationError(
            f"source {src.name}: the index lists {src.filename} with sha256 {link.sha256} "
            f"but the lock pins {src.sha256}"
        )
    pypi.download(link.url, dest)
    return link.url


def materialize(
    src: Source, work: Path, *, cache: Cache, mirror: Path | None, log: Path
) -> tuple[Path, dict[str, Any]]:
    """Produce the kept tree of ``src`` under ``work`` (not yet verified against the tree hash).

    Returns the tree root and metadata (origin, archive path and sha256).
    """
    keep = source_filter(src)
    meta: dict[str, Any] = {"source": src.pin()}
    mirrored = _mirror_tree(mirror, src)
    if mirrored is not None:
        root = unpack(mirrored, work / "unpack", strip=0)
        meta["origin"] = str(mirrored)
        return root, meta
    if src.kind == "git":
        root = work / "tree"
        root.mkdir()
        repo = cache.git_dir(gitsrc.url_hash(src.url))
        with cache.lock(f"git-{gitsrc.url_hash(src.url)}"):
            gitsrc.ensure_commit(repo, src.url, src.commit, log)
        subs: dict[str, tuple[Path, str]] = {}
        for sub in src.submodules:
            sub_repo = cache.git_dir(gitsrc.url_hash(sub.url))
            with cache.lock(f"git-{gitsrc.url_hash(sub.url)}"):
                gitsrc.ensure_commit(sub_repo, sub.url, sub.commit, log)
            subs[sub.path] = (sub_repo, sub.commit)
        gitsrc.export_tree(repo, src.commit, root, keep=keep, submodules=subs)
        meta["origin"] = src.url
        return root, meta
    archive = work / "archive"
    origin_archive = _mirror_archive(mirror, src)
    if origin_archive is not None:
        shutil.copyfile(origin_archive, archive)
        meta["origin"] = str(origin_archive)
    else:
        meta["origin"] = _download_archive(src, archive)
    digest = file_sha256(archive)
    meta["archive_sha256"] = digest
    if src.sha256 and digest != src.sha256:
        raise VerificationError(
            f"source {src.name}: archive from {meta['origin']} has sha256 {digest} "
            f"but the lock pins {src.sha256}; refusing to use it"
        )
    proc.check_interrupted(f"fetch of source {src.name}")
    root = unpack(archive, work / "unpack", strip=src.strip)
    keep.apply(root)
    return root, meta


def ensure_source(src: Source, *, cache: Cache, mirror: Path | None, log: Path) -> Path:
    """The verified tree of ``src`` in the cache, fetching it if needed."""
    if cache.has_source(src.tree_sha256):
        return cache.source_tree(src.tree_sha256)
    with cache.lock(f"source-{src.tree_sha256}"):
        if cache.has_source(src.tree_sha256):
            return cache.source_tree(src.tree_sha256)
        print(f"fetch {src.name} ({src.kind})", flush=True)
        # In-process work the interrupt handler waits for: a stop signal ends it at a checkpoint, and
        # the staging tree goes with it (tasks/proc.py).
        with proc.in_process(f"fetch of source {src.name}"), cache.staging(f"src-{src.name}") as work:
            root, meta = materialize(src, work, cache=cache, mirror=mirror, log=log)
            proc.check_interrupted(f"fetch of source {src.name}")
            actual = tree_sha256(root)
            if actual != src.tree_sha256:
                raise VerificationError(
                    f"source {src.name}: tree hash {actual} of what was fetched from {meta['origin']} "
                    f"does not match the lock's tree_sha256 {src.tree_sha256}; nothing was cached. "
                    "If the lock is wrong, fix it with `doit lock`."
                )
            entry = work / "entry"
            entry.mkdir()
            os.rename(root, entry / "tree")
            if (work / "archive").is_file():
                os.rename(work / "archive", entry / "archive")
            meta["tree_sha256"] = actual
            (entry / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            cache.publish_dir(entry, cache.source_dir(src.tree_sha256))
    return cache.source_tree(src.tree_sha256)


def ensure_wheel(src: Source, *, cache: Cache, mirror: Path | None) -> Path:
    """The wheel file of a source of kind "wheel", in the cache's fetched store: stored, mirrored or downloaded.

    Its sha256 must be the lock's; a mismatch is refused and nothing is kept.
    """
    found = cache.fetched_wheel(src.sha256)
    if found is not None:
        return found
    with cache.lock(f"fetched-{src.sha256}"):
        found = cache.fetched_wheel(src.sha256)
        if found is not None:
            return found
        mirrored = mirror / "wheels" / src.filename if mirror is not None else None
        origin = str(mirrored) if mirrored is not None and mirrored.is_file() else src.url
        print(f"fetch {src.name} (wheel {src.filename})", flush=True)
        with proc.in_process(f"fetch of wheel {src.name}"), cache.staging(f"wheel-{src.name}") as work:
            path = work / src.filename
            if origin == src.url:
                pypi.download(src.url, path)
            else:
                shutil.copyfile(origin, path)
            digest = file_sha256(path)
            if digest != src.sha256:
                raise VerificationError(
                    f"source {src.name}: the wheel from {origin} has sha256 {digest} but the lock pins "
                    f"{src.sha256}; refusing it, nothing was kept"
                )
            final = cache.fetched / src.sha256
            final.mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o644)
            os.replace(path, final / src.filename)
            (final / "origin").write_text(src.url + "\n")
    found = cache.fetched_wheel(src.sha256)
    assert found is not None
    return found


def verified_source(src: Source, *, cache: Cache, mirror: Path | None, log: Path) -> Path:
    """:func:`ensure_source`, then the cached tree hashed again before a build reads it.

    The cache is trusted to hold what was verified, but a byte changed in it since (a disk error, a
    hand edit) would otherwise build, silently, a different wheel under the right key. A tree whose hash
    differs, or that holds a link out of the tree, is discarded with a warning and fetched again.
    Cost: one read of the tree (well under a second for the real stack's largest), next to a compile.
    """
    tree = ensure_source(src, cache=cache, mirror=mirror, log=log)
    problem = tree_problem(tree, src.tree_sha256)
    if problem is None:
        return tree
    warn(f"source {src.name}: the cached tree {tree} {problem}; discarded, fetching it again")
    with cache.lock(f"source-{src.tree_sha256}"):
        if tree_problem(tree, src.tree_sha256) is not None:
            rmtree(cache.source_dir(src.tree_sha256))
    tree = ensure_source(src, cache=cache, mirror=mirror, log=log)
    problem = tree_problem(tree, src.tree_sha256)
    if problem is not None:
        raise VerificationError(f"source {src.name}: the tree fetched again {problem}; refusing to build from it")
    return tree


def tree_problem(tree: Path, expected: str) -> str | None:
    """Why ``tree`` is not the verified tree ``expected`` (None when it is)."""
    try:
        entries = list(walk(tree))
    except (OSError, ValueError) as exc:
        return f"cannot be read ({exc})"
    # Each link followed through the tree's other links, as the kernel would (never os.path.realpath).
    links = {e.path: os.readlink(tree / e.path) for e in entries if e.kind == "symlink"}
    bad = escaping_link(links)
    if bad is not None:
        return f"has a symbolic link out of the tree: {bad} -> {links[bad]}"
    actual = hash_entries(entries)
    return None if actual == expected else f"hashes to {actual}, not the lock's tree_sha256 {expected}"


def export_mirror(sources: list[Source], *, cache: Cache, mirror: Path) -> Iterator[str]:
    """Copy the cached sources into a mirror directory; yield one line per source."""
    (mirror / "trees").mkdir(parents=True, exist_ok=True)
    (mirror / "archives").mkdir(parents=True, exist_ok=True)
    index: dict[str, Any] = {}
    index_path = mirror / "index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    for src in sources:
        if src.kind == "wheel":
            wheel = cache.fetched_wheel(src.sha256)
            if wheel is None:
                raise VerificationError(
                    f"source {src.name}: its wheel is not in the cache; run `doit fetch:{src.name}`"
                )
            (mirror / "wheels").mkdir(parents=True, exist_ok=True)
            dest = mirror / "wheels" / src.filename
            if not dest.is_file() or file_sha256(dest) != src.sha256:
                copy_atomic(wheel, dest)
            index[src.name] = {"pin": src.pin(), "file": f"wheels/{src.filename}"}
            yield f"{src.name}: wheels/{src.filename} ({dest.stat().st_size} bytes)"
            continue
        entry = cache.source_dir(src.tree_sha256)
        archive = entry / "archive"
        if archive.is_file() and src.sha256:
            dest = mirror / "archives" / src.sha256
            what = f"archives/{src.sha256}"
            if not dest.is_file():
                copy_atomic(archive, dest)
        else:
            dest = mirror / "trees" / f"{src.tree_sha256}.tar.gz"
            what = f"trees/{src.tree_sha256}.tar.gz"
            if not dest.is_file():
                tmp = dest.with_name(f".{dest.name}.tmp")
                try:
                    pack_tree(entry / "tree", tmp)
                    os.replace(tmp, dest)
                finally:
                    tmp.unlink(missing_ok=True)
        index[src.name] = {"pin": src.pin(), "file": what}
        yield f"{src.name}: {what} ({dest.stat().st_size} bytes)"
    write_atomic(index_path, json.dumps(index, indent=2, sort_keys=True) + "\n")
