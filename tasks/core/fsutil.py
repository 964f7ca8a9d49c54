"""Writing files so that a reader sees a whole file or none, and removing trees builds leave read-only.

The base beneath the feature modules: it imports nothing of this project.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


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
