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

from tasks.core import net, proc
from tasks.core.console import warn
from tasks.core.errors import VerificationError
from tasks.core.fsutil import rmtree, write_atomic
from tasks.core.members import escaping_link
from tasks.core.treehash import file_sha256, hash_entries, tree_sha256, walk
from tasks.lock import kinds
from tasks.lock.kinds import materialize
from tasks.lock.lockfile import Source
from tasks.store.cache import Cache


def ensure_source(src: Source, *, cache: Cache, mirror: Path | None, log: Path) -> Path:
    """The verified tree of ``src`` in the cache, fetching it if needed."""
    if cache.has_source(src.tree_sha256):
        return cache.source_tree(src.tree_sha256)
    with cache.lock(f"source-{src.tree_sha256}"):
        if cache.has_source(src.tree_sha256):
            return cache.source_tree(src.tree_sha256)
        print(f"fetch {src.name} ({src.kind})", flush=True)
        # In-process work the interrupt handler waits for: a stop signal ends it at a checkpoint, and
        # the staging tree goes with it (tasks/core/proc.py).
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
                net.download(src.url, path)
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
        what = kinds.of(src.kind).mirror_entry(src, cache=cache, mirror=mirror)
        index[src.name] = {"pin": src.pin(), "file": what}
        yield f"{src.name}: {what} ({(mirror / what).stat().st_size} bytes)"
    write_atomic(index_path, json.dumps(index, indent=2, sort_keys=True) + "\n")
