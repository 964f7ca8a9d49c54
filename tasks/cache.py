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
    timings/<package>.json    compile seconds per unit at the package's last build (tasks/ninjaorder.py)
    timings/<package>.memory.json  each unit's peak memory at its last build (tasks/gate.py, tasks/jobserver.py)
    tmp/                      work in progress, renamed into place when complete

Entries appear atomically (a directory renamed into place), so a reader sees
either a whole entry or none. Wheel entries are verified by hash when used.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from filelock import FileLock

from tasks.treehash import file_sha256

CACHEDIR_TAG = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by reprostack.\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)


def warn(message: str) -> None:
    print(f"WARNING: {message}", file=sys.stderr, flush=True)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write ``path`` through a temporary file in the same directory and ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with _whole_or_nothing(tmp, path):
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)


@contextlib.contextmanager
def _whole_or_nothing(tmp: str, dest: Path) -> Iterator[None]:
    """Remove ``tmp`` when writing it fails; an OSError without a path (a write on a full disk) names ``dest``."""
    try:
        yield
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None and exc.errno:
            raise OSError(exc.errno, exc.strerror, str(dest)) from exc
        raise


def copy_atomic(src: Path, dest: Path) -> None:
    """Copy ``src`` to ``dest`` (mode 0644) through a temporary file beside it; on any failure (a full
    disk) nothing of the copy is left and ``dest`` is as it was."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    with _whole_or_nothing(tmp, dest):
        with os.fdopen(fd, "wb") as out, src.open("rb") as source:
            shutil.copyfileobj(source, out, 1 << 20)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)


def rmtree(path: Path) -> None:
    """Remove a tree, including read-only files left by builds."""
    if not path.exists() and not path.is_symlink():
        return

    def _onerror(func: Any, p: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(p, 0o700)
            func(p)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=_onerror)
    else:  # pragma: no cover - Python 3.11
        shutil.rmtree(path, onerror=_onerror)


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
        """A fresh temporary directory in the cache, removed unless moved away."""
        from tasks import workspace

        self.ensure()
        tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}.", dir=self.root / "tmp"))
        workspace.tree(tmp, live=True)  # removed by the next run, should this one be killed
        try:
            yield tmp
        finally:
            rmtree(tmp)
            workspace.tree(tmp, live=False)

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

    def get_wheel(self, key: str) -> WheelEntry | None:
        """The verified entry for ``key``; a corrupted entry is discarded with a warning."""
        d = self.wheel_dir(key)
        try:
            meta = json.loads((d / "entry.json").read_text())
            path = d / meta["filename"]
            digest = file_sha256(path)
        except FileNotFoundError:
            if d.exists():
                warn(f"incomplete wheel cache entry {d} discarded; the package will be rebuilt")
                rmtree(d)
            return None
        except (ValueError, KeyError, TypeError) as exc:
            warn(f"unreadable wheel cache entry {d} ({exc}) discarded; the package will be rebuilt")
            rmtree(d)
            return None
        if digest != meta["sha256"]:
            warn(
                f"corrupted wheel cache entry {path}: sha256 {digest} but {meta['sha256']} was stored; "
                "entry discarded, the package will be rebuilt"
            )
            rmtree(d)
            return None
        return WheelEntry(key=key, path=path, sha256=digest, size=path.stat().st_size, meta=meta)

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
