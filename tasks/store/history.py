"""The build history: everything a run keeps under the cache's ``timings/`` for the next one, in one place.

Three records per package, each written here and read back here:

- ``timings/<package>.json``: each compile unit's seconds at its builds (newest wins); the broker orders
  and ranks by them, the forecast runs them (:func:`record_times`, :func:`known_times`);
- ``timings/<package>.memory.json``: what each unit held, its peak and the process the peak came in
  (tasks/outside/gate.py measures, tasks/engine/jobserver.py collects; :func:`record_memory`);
- ``timings/<package>.build.json``: the package's wall time, the part of it its compiles covered, its
  slots and its ninja log's edges (:func:`record_build`).

Beside them, what the lock carries for a cache that has no record yet: ``patches/<pkg>/unit-times.json``
(:data:`TIMES_HINTS_FILE`) and ``patches/<pkg>/unit-memory.json`` (:data:`MEMORY_HINTS_FILE`), or a
profile's own ``unit-times.<profile>.json`` and ``unit-memory.<profile>.json`` (:func:`hints_path`), which
``doit hints`` writes from this cache's records (:func:`write_hints`); and the wheel cache's entries, whose
key documents are the package's earlier builds (:func:`local_builds`).

Every reader treats a missing, unreadable or malformed file or value as no record. The shim that reorders
ninja's manifest (tasks/outside/ninjaorder.py) reads the times files with the standard library alone.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.fsutil import write_atomic
from tasks.outside.ninjaorder import HINTS_FILE as TIMES_HINTS_FILE
from tasks.outside.ninjaorder import load_times, read_object

__all__ = ["TIMES_HINTS_FILE", "load_times", "read_object"]

#: The lock's expectations of a package's units (``patches/<pkg>/unit-memory.json``): unit file name or
#: pattern -> ``{"peak_mb": ..., "peak_in": "cicc", "after_mb": ...}``, with ``before_mb``, ``peak_from_s``
#: and ``peak_for_s`` where the peak was timed. The cache's records win.
MEMORY_HINTS_FILE = "unit-memory.json"
#: What a unit's memory hint keeps of its record (not its seconds, a kill or an exit status).
HINT_FIELDS = ("peak_mb", "peak_in", "after_mb", "before_mb", "peak_from_s", "peak_for_s")
#: A profile whose name can be part of a file name (another profile reads the plain hints).
_PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def times_path(cache_root: Path, package: str) -> Path:
    return cache_root / "timings" / f"{package}.json"


def memory_path(cache_root: Path, package: str) -> Path:
    return cache_root / "timings" / f"{package}.memory.json"


def build_path(cache_root: Path, package: str) -> Path:
    return cache_root / "timings" / f"{package}.build.json"


# --------------------------------------------------------------------------- unit times


def known_times(cache_root: Path, hints: Path | None, package: str) -> dict[str, float]:
    """Unit times for ``package``: the lock's hints (``patches/<pkg>/unit-times.json``), then this cache's record."""
    times = load_times(hints) if hints is not None else {}
    times.update(load_times(times_path(cache_root, package)))
    return times


def record_times(cache_root: Path, package: str, seconds: Mapping[str, float]) -> None:
    """Add a build's unit times to the cache's record for ``package`` (newest wins)."""
    if not seconds:
        return
    path = times_path(cache_root, package)
    times = load_times(path)
    times.update({k: round(v, 1) for k, v in seconds.items()})
    write_atomic(path, json.dumps(dict(sorted(times.items())), indent=0) + "\n")


def package_weights(patches_dir: Path, packages: Iterable[str], profile: str = "default") -> dict[str, float]:
    """Each package's compile seconds from the lock's ``patches/<pkg>/unit-times.json`` (the profile's own, where
    it has one: :func:`hints_path`), what shards weigh."""
    return {
        name: sum(load_times(hints_path(patches_dir / name, TIMES_HINTS_FILE, profile)).values()) for name in packages
    }


# --------------------------------------------------------------------------- the lock's hints


def _profile_file(name: str, profile: str) -> str | None:
    """``unit-times.json`` as ``unit-times.<profile>.json`` (None: the default profile's, or a name that is
    not one a file can carry)."""
    if profile in ("", "default") or not _PROFILE_NAME.fullmatch(profile):
        return None
    stem, _, ext = name.rpartition(".")
    return f"{stem}.{profile}.{ext}"


def hints_path(patches: Path, name: str, profile: str = "default") -> Path:
    """The lock's hints ``name`` (:data:`TIMES_HINTS_FILE`, :data:`MEMORY_HINTS_FILE`) in ``patches`` (a package's
    folder) for ``profile``: its own (``unit-times.<profile>.json``) where the folder has one, else the plain
    file, which is the default profile's and that of every profile without its own."""
    own = _profile_file(name, profile)
    if own is not None and (patches / own).is_file():
        return patches / own
    return patches / name


def write_hints(
    patches: Path, profile: str, times: Mapping[str, float], memory: Mapping[str, Mapping[str, object]]
) -> list[Path]:
    """Write a package's hints for ``profile`` into ``patches`` (its folder of the lock's patches): ``times``
    (unit -> seconds) replace its times file; ``memory`` (unit -> record) its memory file's entries of those
    units, keeping its patterns (``flash_fwd_*``, for units without an entry). The files written, one unit
    a line, for review with the rest of the lock."""
    own = _profile_file(TIMES_HINTS_FILE, profile)
    if profile not in ("", "default") and own is None:
        raise ValueError(f"profile {profile!r}: not a name a hints file can carry")
    names = (own or TIMES_HINTS_FILE, _profile_file(MEMORY_HINTS_FILE, profile) or MEMORY_HINTS_FILE)
    times_file, memory_file = (patches / n for n in names)
    kept = {k: v for k, v in load_memory(memory_file).items() if any(c in k for c in "*?[")}
    hints = {
        u: {k: _rounded(k, v) for k, v in found.items() if k in HINT_FIELDS} for u, found in sorted(memory.items())
    }
    patches.mkdir(parents=True, exist_ok=True)
    write_atomic(times_file, _one_a_line({u: round(t, 1) for u, t in sorted(times.items())}))
    write_atomic(memory_file, _one_a_line({**hints, **{k: v for k, v in kept.items() if k not in hints}}))
    return [times_file, memory_file]


def _one_a_line(doc: Mapping[str, object]) -> str:
    """A JSON object with one entry a line (as the lock's hint files are written: a diff shows each unit)."""
    lines = [f"{json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in doc.items()]
    return "{\n" + ",\n".join(lines) + "\n}\n"


# --------------------------------------------------------------------------- unit memory


def _mb(value: object) -> float:
    return float(value) if isinstance(value, int | float) else 0.0


def _rounded(key: str, value: object) -> object:
    """A figure as the records keep it: MB whole, seconds to a tenth."""
    if isinstance(value, float) and key.endswith("_mb"):
        return round(value)
    if isinstance(value, float) and key.endswith("_s"):
        return round(value, 1)
    return value


def load_memory(path: Path) -> dict[str, dict[str, object]]:
    """A unit-memory file (records or hints); anything unreadable counts as empty."""
    return {k: v for k, v in read_object(path).items() if isinstance(v, dict)}


def record_memory(cache_root: Path, package: str, results: dict[str, dict[str, object]]) -> None:
    """Add what a build's units held to the cache's record for ``package``: the newest run wins, except
    that a unit killed for memory keeps the larger of its peaks."""
    if not results:
        return
    path = memory_path(cache_root, package)
    known = load_memory(path)
    for unit, found in results.items():
        entry = {k: _rounded(k, v) for k, v in found.items() if k not in ("node", "since")}
        if found.get("killed") and unit in known:
            entry["peak_mb"] = max(_mb(entry.get("peak_mb")), _mb(known[unit].get("peak_mb")))
        known[unit] = entry
    write_atomic(path, json.dumps(known, indent=0, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- package builds


def record_build(
    cache_root: Path,
    package: str,
    *,
    key: str,
    wall_s: float,
    wait_s: float,
    compile_s: float | None,
    slots: int,
    ninja_units: Sequence[str] = (),
) -> None:
    """After a build: its wall time, the part of it its compiles ran or waited for a token (None where no
    ninja log said), its slots and its ninja log's edges, for the next forecast (``timings/<package>.build.json``)."""
    doc = {
        "key": key,
        "wall_s": round(wall_s, 2),
        "wait_s": round(wait_s, 2),
        "slots": slots,
        "time": time.time(),
        "compile_s": None if compile_s is None else round(compile_s, 2),
        "ninja_units": sorted(set(ninja_units)),
    }
    write_atomic(build_path(cache_root, package), json.dumps(doc, indent=1, sort_keys=True) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a missing, unreadable or other file counts as empty."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def read_build(cache_root: Path, package: str) -> dict[str, Any]:
    """``package``'s last build record (:func:`record_build`), or an empty one."""
    return read_json(build_path(cache_root, package))


# --------------------------------------------------------------------------- earlier builds


@dataclass(frozen=True)
class Earlier:
    """A build of the package that the cache or the remote knows: its key, key document, when, where."""

    key: str
    document: Mapping[str, Any]
    time: float
    where: str  # "local" or "remote"


def local_builds(cache_root: Path, package: str) -> list[Earlier]:
    """The wheel cache's entries of ``package`` that keep their key document (every entry since the cache
    stored them, built, placed or restored from a remote)."""
    found = []
    for meta_path in (cache_root / "wheels").glob("*/*/entry.json"):
        meta = read_json(meta_path)
        doc = meta.get("key_document")
        if meta.get("package") == package and isinstance(doc, dict):
            try:
                when = meta_path.stat().st_mtime
            except OSError:
                continue
            found.append(Earlier(str(meta.get("key") or meta_path.parent.name), doc, when, "local"))
    return found
