"""The on-disk cache: verified source trees, git object stores, built wheels.

Layout under the cache root::

    CACHEDIR.TAG
    sources/<tree_sha256>/    tree/ (the kept, verified tree), meta.json, archive (url/pypi)
    git/<url hash>.git        bare repositories, fetched into and reused
    wheels/<k[:2]>/<key>/     <wheel file>, entry.json (filename, sha256, size, key document)
    toolchain/                memoised toolchain fingerprints
    toolchains/<set hash>/    hermetic toolchains: site/ (the pinned wheels, installed), meta.json
    locks/                    file locks shared by concurrent doit processes
    objects/                  ccache's compile-object cache (size-limited by ccache)
    fetched/<sha256>/         wheels used as they are: the runtime closure's, prebuilt ones (file, origin)
    timings/<package>.json    compile seconds per unit at the package's last build (tasks/outside/ninjaorder.py)
    timings/<package>.memory.json  each unit's peak memory at its last build (tasks/outside/gate.py,
                              tasks/engine/jobserver.py)
    timings/<package>.build.json   the package's last build: wall time, compile span, slots (tasks/store/history.py)
    timings/<package>.units.json   what decided each compile unit's object-cache entry at its last build
                              with the object cache (tasks/stages/units.py; `doit plan` reads it)
    tmp/                      work in progress, renamed into place when complete; each <name> held
                              by its run through the lock tmp/<name>.lock (see temporary_dir)

Entries appear atomically (a directory renamed into place), so a reader sees
either a whole entry or none. Wheel entries are verified by hash when used.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from filelock import FileLock

from tasks.core.console import warn
from tasks.core.fsutil import rmtree, write_atomic
from tasks.core.treehash import file_sha256

CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by reprostack.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)


#: The suffix of the lock file beside each temporary directory (its run holds it until the directory is gone).
HELD = ".lock"


def _hold(lock: Path, *, wait: bool) -> int | None:
    """An open descriptor holding ``lock`` (flock, released by the kernel when the process ends, also on
    SIGKILL), or None when another process holds it and ``wait`` is false."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # a sweep removed the file between our open and our lock: take the new one


def _let_go(lock: Path, fd: int) -> None:
    """Remove ``lock`` (while still holding it), then release it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock)
    os.close(fd)


@contextlib.contextmanager
def temporary_dir(parent: Path, prefix: str) -> Iterator[Path]:
    """A fresh directory ``<parent>/<prefix><random>``, removed on the way out, whatever happens.

    The run holds ``<directory>.lock`` from before the directory exists until after it is removed,
    so a directory whose lock nobody holds belongs to a run that is gone (killed, or ended by a signal
    while the work was in one of doit's threads): :func:`sweep` removes those, never one a live run
    uses, from whatever workspace that run started (flock works across processes and containers on
    one file system). The directory is also listed in the workspace's run record (tasks/core/workspace.py).
    """
    from tasks.core import workspace

    parent.mkdir(parents=True, exist_ok=True)
    while True:
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        lock = path.with_name(path.name + HELD)
        fd = _hold(lock, wait=False)
        if fd is None:
            continue
        try:
            path.mkdir()
            break
        except FileExistsError:
            _let_go(lock, fd)
        except BaseException:
            _let_go(lock, fd)
            raise
    try:
        workspace.tree(path, live=True)  # removed by the next run, should this one be killed
        yield path
    finally:
        try:
            rmtree(path)
            workspace.tree(path, live=False)
        finally:
            _let_go(lock, fd)


def sweep(parent: Path, match: Callable[[str], bool] = lambda name: True) -> int:
    """Remove the temporary directories of ``parent`` (those ``match`` names) that no live run holds
    (:func:`temporary_dir`); return how many. A lock left without its directory goes too."""
    removed = 0
    try:
        names = sorted(os.listdir(parent))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for name in names:
        if not match(name):
            continue
        path = parent / name
        if name.endswith(HELD):
            if (parent / name.removesuffix(HELD)).exists():
                continue  # taken with its directory, below
            lock, directory = path, None
        elif path.is_dir() and not path.is_symlink():
            lock, directory = path.with_name(name + HELD), path
        else:
            continue
        try:
            fd = _hold(lock, wait=False)
        except OSError:
            continue  # not ours to judge (no permission): leave it
        if fd is None:
            continue  # a live run holds it
        try:
            if directory is not None and directory.is_dir():
                rmtree(directory)
                removed += 1
        finally:
            _let_go(lock, fd)
    return removed


_WHEEL_FILE = re.compile(r"^[A-Za-z0-9_.+!-]+\.whl$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _entry_problem(meta: object) -> str:
    """What is wrong with an ``entry.json`` document ("" when it names a wheel file and its sha256)."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    filename, sha256 = meta.get("filename"), meta.get("sha256")
    if not isinstance(filename, str) or not _WHEEL_FILE.match(filename):
        return f"filename {filename!r} is not a wheel file name"
    if not isinstance(sha256, str) or not _SHA256.match(sha256):
        return f"sha256 {sha256!r} is not a sha256"
    return ""


@dataclass(frozen=True)
class WheelEntry:
    key: str
    path: Path
    sha256: str
    size: int
    meta: dict[str, Any]


class Cache:
    def __init__(self, root: Path) -> None:
        self.root = root

    # -- layout
    def ensure(self) -> None:
        for sub in ("sources", "git", "wheels", "toolchain", "locks", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        tag = self.root / "CACHEDIR.TAG"
        if not tag.exists():
            write_atomic(tag, CACHEDIR_TAG)

    @property
    def objects(self) -> Path:
        return self.root / "objects"

    @property
    def fetched(self) -> Path:
        """Wheels fetched as they are (the runtime closure, prebuilt wheels): ``<sha256>/<file>``, ``origin``."""
        path = self.root / "fetched"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def fetched_wheel(self, sha256: str) -> Path | None:
        """The stored wheel whose sha256 is ``sha256``, checked again (a changed file is discarded)."""
        folder = self.root / "fetched" / sha256
        for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
            if file_sha256(path) == sha256:
                return path
            warn(f"corrupted fetched wheel {path}: its sha256 changed; discarded, it is fetched again")
            rmtree(folder)
        return None

    def source_dir(self, tree_sha256: str) -> Path:
        return self.root / "sources" / tree_sha256

    def source_tree(self, tree_sha256: str) -> Path:
        return self.source_dir(tree_sha256) / "tree"

    def has_source(self, tree_sha256: str) -> bool:
        return (self.source_dir(tree_sha256) / "meta.json").is_file()

    def git_dir(self, url_hash: str) -> Path:
        return self.root / "git" / f"{url_hash}.git"

    def wheel_dir(self, key: str) -> Path:
        return self.root / "wheels" / key[:2] / key

    # -- concurrency
    def lock(self, name: str) -> FileLock:
        self.ensure()
        from filelock import FileLock  # here: a no-op run takes no lock

        return FileLock(str(self.root / "locks" / f"{name}.lock"))

    @contextlib.contextmanager
    def staging(self, prefix: str) -> Iterator[Path]:
        """A fresh temporary directory in the cache, removed unless moved away (:func:`temporary_dir`)."""
        self.ensure()
        with temporary_dir(self.root / "tmp", f"{prefix}.") as tmp:
            yield tmp

    def sweep(self) -> int:
        """Remove what runs that are gone left in ``tmp/`` and ``fetched/.fetch-*``; return how many."""
        found = sweep(self.root / "tmp")
        return found + sweep(self.root / "fetched", lambda name: name.startswith(".fetch-"))

    def publish_dir(self, tmp: Path, final: Path) -> None:
        """Move a completed directory into place; a concurrent winner is kept."""
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise

    # -- wheels
    def wheel_exists(self, key: str) -> bool:
        return (self.wheel_dir(key) / "entry.json").is_file()

    def check_wheel(self, key: str) -> WheelEntry | str | None:
        """The entry for ``key``, verified by hash, or what is wrong with it (a message naming the entry);
        None when there is none. Reads only: :meth:`get_wheel` discards a wrong entry, `doit plan` says the
        package will be built. An entry is wrong when its ``entry.json`` is not a JSON object naming a plain
        wheel file name and a sha256, when that file is gone, or when its bytes hash to another sha256."""
        d = self.wheel_dir(key)
        try:
            meta = json.loads((d / "entry.json").read_text())
        except FileNotFoundError:
            return f"incomplete wheel cache entry {d}" if d.exists() else None
        except (OSError, ValueError, RecursionError) as exc:
            return f"unreadable wheel cache entry {d} ({exc.__class__.__name__}: {exc})"
        problem = _entry_problem(meta)
        if problem:
            return f"unreadable wheel cache entry {d} ({problem})"
        path = d / meta["filename"]
        try:
            digest = file_sha256(path)
        except FileNotFoundError:
            return f"incomplete wheel cache entry {d} (its wheel {meta['filename']} is gone)"
        except OSError as exc:
            return f"unreadable wheel cache entry {d} ({exc})"
        if digest != meta["sha256"]:
            return f"corrupted wheel cache entry {path}: sha256 {digest} but {meta['sha256']} was stored"
        return WheelEntry(key=key, path=path, sha256=digest, size=path.stat().st_size, meta=meta)

    def get_wheel(self, key: str) -> WheelEntry | None:
        """The verified entry for ``key``; a wrong entry (:meth:`check_wheel`) is discarded with a warning."""
        found = self.check_wheel(key)
        if isinstance(found, str):
            warn(f"{found}; entry discarded, the package will be rebuilt")
            rmtree(self.wheel_dir(key))
            return None
        return found

    def put_wheel(self, key: str, wheel: Path, meta: dict[str, Any]) -> WheelEntry:
        """Store ``wheel`` under ``key`` atomically and return the entry."""
        with self.staging("wheel") as tmp:
            entry_dir = tmp / "entry"
            entry_dir.mkdir()
            dest = entry_dir / wheel.name
            shutil.copyfile(wheel, dest)
            os.chmod(dest, 0o644)
            digest = file_sha256(dest)
            full = dict(
                meta,
                filename=wheel.name,
                sha256=digest,
                size=dest.stat().st_size,
                key=key,
            )
            (entry_dir / "entry.json").write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")
            final = self.wheel_dir(key)
            if final.exists():
                rmtree(final)
            self.publish_dir(entry_dir, final)
        entry = self.get_wheel(key)
        assert entry is not None
        return entry
