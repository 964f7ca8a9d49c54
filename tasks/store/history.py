"""The build history: everything a run keeps under the cache's ``timings/`` for the next one, in one place.

Three records per package, each written here and read back here:

- ``timings/<package>.json``: each compile unit's seconds at its builds (newest wins); the broker orders
  and ranks by them, the forecast runs them (:func:`record_times`, :func:`known_times`);
- ``timings/<package>.memory.json``: what each unit held, its peak and the process the peak came in
  (tasks/outside/gate.py measures, tasks/engine/jobserver.py collects; :func:`record_memory`);
- ``timings/<package>.build.json``: the package's wall time, the part of it its compiles covered, its
  slots and its ninja log's edges (:func:`record_build`);
- ``timings/noop.json``: what a `doit wheels` of a lock and profile took besides its tasks' actions (start-up,
  the lock, the keys, doit's checks): the time of a run that finds nothing to do, which `doit plan`
  forecasts from it; kept by tasks/store/noop.py, apart from this module so that a no-op, which writes it,
  does not load this one;
- ``timings/<package>.units.json``: what decided each compile unit's object-cache entry at the package's
  last build with the object cache: its command line, its compiler and the hash of every file it read,
  and what the object cache answered and when (:func:`record_units`, :class:`UnitRecords`; written by
  tasks/stages/units.py, which `doit plan` asks which units will hit).

Beside them, what the lock carries for a cache that has no record yet: ``patches/<pkg>/unit-times.json``
(:data:`TIMES_HINTS_FILE`) and ``patches/<pkg>/unit-memory.json`` (:data:`MEMORY_HINTS_FILE`), or a
profile's own ``unit-times.<profile>.json`` and ``unit-memory.<profile>.json`` (:func:`hints_path`), which
``doit hints`` writes from this cache's records (:func:`write_hints`); and the wheel cache's entries, whose
key documents are the package's earlier builds (:func:`local_builds`).

Every reader treats a missing, unreadable or malformed file or value as no record: a number that is not
finite, negative or past :data:`MAX_SECONDS` (``1e999``, NaN, ``1e20``) or of another type is no number,
and a record with one where it needs one is no record (:func:`read_build` and :func:`read_units` say so
in one warning line). The shim that reorders ninja's manifest (tasks/outside/ninjaorder.py) reads the
times files with the standard library alone, with the same check.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.core.console import warn
from tasks.core.fsutil import write_atomic
from tasks.outside.ninjaorder import HINTS_FILE as TIMES_HINTS_FILE
from tasks.outside.ninjaorder import MAX_SECONDS, load_times, read_object

__all__ = ["MAX_SECONDS", "TIMES_HINTS_FILE", "load_times", "read_object"]

#: A record's date must fall between the epoch and this (2100-01-01): ``1e20`` is no date.
MAX_TIME = 4102444800.0
#: Memory figures of a record (MB) past this (a petabyte) are no figures.
MAX_MB = 1e9
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def number(value: object, *, limit: float = MAX_SECONDS) -> float | None:
    """``value`` as a float when it is a JSON number (not a bool), finite and between 0 and ``limit``; else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0 <= value <= limit else None  # (NaN fails the comparison, infinity and 10**400 the bound)


def date(value: object) -> float | None:
    """``value`` as seconds since the epoch when it is a plausible date (:data:`MAX_TIME`); else None."""
    return number(value, limit=MAX_TIME)


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


def units_path(cache_root: Path, package: str) -> Path:
    return cache_root / "timings" / f"{package}.units.json"


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
    units, keeping its patterns (``flash_fwd_*``) and its entries of the units in ``times`` without a record
    (a build whose memory the gate did not measure keeps the lock's figures). The files written, one unit
    a line, for review with the rest of the lock."""
    own = _profile_file(TIMES_HINTS_FILE, profile)
    if profile not in ("", "default") and own is None:
        raise ValueError(f"profile {profile!r}: not a name a hints file can carry")
    names = (own or TIMES_HINTS_FILE, _profile_file(MEMORY_HINTS_FILE, profile) or MEMORY_HINTS_FILE)
    times_file, memory_file = (patches / n for n in names)
    # kept: its patterns, and the entries of the build's units that this cache has no record of
    kept = {k: v for k, v in load_memory(memory_file).items() if any(c in k for c in "*?[") or k in times}
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
    return number(value, limit=MAX_MB) or 0.0


def _rounded(key: str, value: object) -> object:
    """A figure as the records keep it: MB whole, seconds to a tenth."""
    if isinstance(value, float) and key.endswith("_mb"):
        return round(value)
    if isinstance(value, float) and key.endswith("_s"):
        return round(value, 1)
    return value


def load_memory(path: Path) -> dict[str, dict[str, object]]:
    """A unit-memory file (records or hints); anything unreadable counts as empty. Of each unit's entry only
    the fields of the kinds the broker and the forecast read are kept: figures (``*_mb``, ``seconds`` and
    ``*_s``) that are numbers (:func:`number`), ``peak_in`` a word, ``killed`` a bool, ``exit`` an int."""
    out: dict[str, dict[str, object]] = {}
    for unit, found in read_object(path).items():
        if not isinstance(found, dict):
            continue
        entry: dict[str, object] = {}
        for name, value in found.items():
            if name.endswith("_mb"):
                figure = number(value, limit=MAX_MB)
            elif name == "seconds" or name.endswith("_s"):  # (``peak_from_s``, ``peak_for_s``: when a peak came)
                figure = number(value)
            elif name == "peak_in" and isinstance(value, str) and len(value) <= 64:
                entry[name] = value
                continue
            elif name == "killed" and isinstance(value, bool):
                entry[name] = value
                continue
            elif name == "exit" and isinstance(value, int) and not isinstance(value, bool):
                entry[name] = value
                continue
            else:
                continue
            if figure is not None:
                entry[name] = value  # (as written: a whole number stays one, in the hints written from it)
        out[unit] = entry
    return out


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


def record_results(cache_root: Path, package: str, results: Mapping[str, Mapping[str, object]]) -> None:
    """Add what units of ``package`` reported (the broker's results: what each held, its seconds) to the cache's
    records: their memory, and the seconds of those that passed (an interrupted or failed build leaves no ninja
    log to take them from)."""
    record_memory(cache_root, package, {u: dict(found) for u, found in results.items()})
    record_times(
        cache_root,
        package,
        {u: float(s) for u, f in results.items() if isinstance(s := f.get("seconds"), int | float) and "exit" not in f},
    )


def record_unit(cache_root: Path, package: str, unit: str, found: Mapping[str, object]) -> None:
    """One unit's :func:`record_results` as it ends (the broker's journal): a build cut off before its end keeps
    what its finished units measured."""
    record_results(cache_root, package, {unit: found})


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
    cpu_s: float | None = None,
    units_cpu_s: float | None = None,
) -> None:
    """After a build: its wall time, the part of it its compiles ran or waited for a token (None where no
    ninja log said), its slots and its ninja log's edges, for the next forecast (``timings/<package>.build.json``);
    the CPU-seconds of its whole process tree and of its gated units, where measured (the difference is what
    its serial part used: beside the serial part's wall time, how much of that the host's other work made)."""
    doc = {
        "key": key,
        "wall_s": round(wall_s, 2),
        "wait_s": round(wait_s, 2),
        "slots": slots,
        "time": time.time(),
        "compile_s": None if compile_s is None else round(compile_s, 2),
        "ninja_units": sorted(set(ninja_units)),
        "cpu_s": None if cpu_s is None else round(cpu_s, 1),
        "units_cpu_s": None if units_cpu_s is None else round(units_cpu_s, 1),
    }
    write_atomic(build_path(cache_root, package), json.dumps(doc, indent=1, sort_keys=True) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a missing, unreadable or other file counts as empty."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # (RecursionError: nested deeper than Python's parser goes)
        return {}
    return doc if isinstance(doc, dict) else {}


def read_build(cache_root: Path, package: str) -> dict[str, Any]:
    """``package``'s last build record (:func:`record_build`), checked field by field; an empty one when
    there is none, or when a field is not what :func:`record_build` writes (one warning line then: the
    forecast runs without it)."""
    path = build_path(cache_root, package)
    doc = read_json(path)
    if not doc:
        return {}
    problem = _build_problem(doc)
    if problem:
        warn(f"{path}: {problem}; the record is ignored (the forecast goes without it)")
        return {}
    return doc


def _build_problem(doc: Mapping[str, Any]) -> str:
    for name in ("wall_s", "wait_s"):
        if number(doc.get(name)) is None:
            return f"{name} is not a number of seconds ({doc.get(name)!r})"
    for name in ("compile_s", "cpu_s", "units_cpu_s"):
        if doc.get(name) is not None and number(doc.get(name)) is None:
            return f"{name} is not a number of seconds ({doc.get(name)!r})"
    slots = doc.get("slots")
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= 1 << 20:
        return f"slots is not a number of job slots ({slots!r})"
    if "time" in doc and date(doc.get("time")) is None:
        return f"time is not a date ({doc.get('time')!r})"
    units = doc.get("ninja_units", [])
    if not isinstance(units, list) or not all(isinstance(u, str) for u in units):
        return "ninja_units is not a list of unit names"
    return ""


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
    stored them, built, placed or restored from a remote); an entry whose key is not a sha256 is none."""
    found = []
    for meta_path in (cache_root / "wheels").glob("*/*/entry.json"):
        meta = read_json(meta_path)
        doc = meta.get("key_document")
        key = meta.get("key") or meta_path.parent.name
        if meta.get("package") == package and isinstance(doc, dict) and isinstance(key, str) and _HEX64.match(key):
            try:
                when = meta_path.stat().st_mtime
            except OSError:
                continue
            found.append(Earlier(key, doc, when, "local"))
    return found


# --------------------------------------------------------------------------- compile units


#: What the object cache answered a unit at the build recorded: served whole (``hit``), after its
#: preprocessor run (``preprocessed``), compiled (``compiled``), or never cacheable (``uncached``).
UNIT_OUTCOMES = ("hit", "preprocessed", "compiled", "uncached")
UNITS_FORMAT = 1


@dataclass(frozen=True)
class UnitRecord:
    """One compile unit at the build recorded: its name (its object's file name, as the unit times name
    it), its object and command line, the compiler that ran, the object cache's keys (ccache's manifest and
    result), the files it read (indexes into :attr:`UnitRecords.files`, its source first), and what
    happened and how long it took."""

    name: str
    object: str
    command: str
    compiler: str
    manifest: str
    result: str
    inputs: tuple[int, ...]
    outcome: str
    why: str = ""
    seconds: float = 0.0
    preprocess_s: float | None = None
    compile_s: float | None = None
    #: What serving it from the object cache took (its last hit; None: it has not hit yet).
    hit_s: float | None = None


@dataclass(frozen=True)
class UnitRecords:
    """A package's compile units at its last build with the object cache (``timings/<package>.units.json``).

    ``files``: (path, sha256, digest of its code without comments) of each file a unit read: a path
    relative to the staged tree for the package's own files, an absolute one for the host's (the toolchain's
    and the Python environment's headers, kept without a code digest: any change of one compiles); a file
    the build wrote itself (a generated header) has no hashes. ``compilers``: each compiler's resolved path
    and the sha256 of its content (ccache hashes it so). ``root``: the directory the build saw its tree at
    (the canonical path, or the stage with prefix-map).
    """

    key: str
    time: float
    document: Mapping[str, Any]
    root: str
    ccache: str
    files: tuple[tuple[str, str, str], ...]
    compilers: Mapping[str, str]
    units: tuple[UnitRecord, ...]


def record_units(cache_root: Path, package: str, records: UnitRecords) -> None:
    """Keep ``records`` as ``package``'s compile units (replacing the last build's)."""
    doc = {
        "format": UNITS_FORMAT,
        "key": records.key,
        "time": records.time,
        "document": records.document,
        "root": records.root,
        "ccache": records.ccache,
        "files": [list(f) for f in records.files],
        "compilers": dict(records.compilers),
        "units": [
            {
                "name": u.name,
                "object": u.object,
                "command": u.command,
                "compiler": u.compiler,
                "manifest": u.manifest,
                "result": u.result,
                "inputs": list(u.inputs),
                "outcome": u.outcome,
                "why": u.why,
                "seconds": round(u.seconds, 3),
                "preprocess_s": None if u.preprocess_s is None else round(u.preprocess_s, 3),
                "compile_s": None if u.compile_s is None else round(u.compile_s, 3),
                "hit_s": None if u.hit_s is None else round(u.hit_s, 3),
            }
            for u in records.units
        ],
    }
    write_atomic(units_path(cache_root, package), json.dumps(doc, separators=(",", ":")) + "\n")


def read_units(cache_root: Path, package: str) -> UnitRecords | None:
    """``package``'s compile units (:func:`record_units`), checked field by field; None when there is no
    record, or when anything in it is not what :func:`record_units` writes (one warning line then)."""
    path = units_path(cache_root, package)
    if not path.is_file():
        return None
    doc = read_json(path)
    try:
        return _units(doc)
    except ValueError as exc:
        warn(f"{path}: {exc}; the record is ignored (the plan counts its units as compiling)")
        return None


def _text(value: object, what: str, *, limit: int = 1 << 16) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{what} is not a string")
    return value


def _seconds_or_none(value: object, what: str) -> float | None:
    if value is None:
        return None
    found = number(value)
    if found is None:
        raise ValueError(f"{what} is not a number of seconds ({value!r})")
    return found


def _units(doc: Mapping[str, Any]) -> UnitRecords:
    if doc.get("format") != UNITS_FORMAT:
        raise ValueError(f"format {doc.get('format')!r} is not {UNITS_FORMAT}")
    key = _text(doc.get("key"), "key")
    if not _HEX64.match(key):
        raise ValueError("key is not an action key")
    when = date(doc.get("time"))
    if when is None:
        raise ValueError(f"time is not a date ({doc.get('time')!r})")
    document = doc.get("document")
    if not isinstance(document, dict):
        raise ValueError("document is not a key document")
    raw_files = doc.get("files")
    if not isinstance(raw_files, list):
        raise ValueError("files is not a list")
    files = []
    for f in raw_files:
        if not (isinstance(f, list) and len(f) == 3 and all(isinstance(x, str) for x in f)):
            raise ValueError("a file is not [path, sha256, digest]")
        if (f[1] and not _HEX64.match(f[1])) or (f[2] and not (f[1] and _HEX64.match(f[2]))):
            raise ValueError(f"the hashes of {f[0]!r} are not sha256s")
        files.append((f[0], f[1], f[2]))
    compilers = doc.get("compilers")
    if not isinstance(compilers, dict) or not all(
        isinstance(v, str) and (not v or _HEX64.match(v)) for v in compilers.values()
    ):
        raise ValueError("compilers is not a map of paths to sha256s")
    raw_units = doc.get("units")
    if not isinstance(raw_units, list):
        raise ValueError("units is not a list")
    units = []
    for u in raw_units:
        if not isinstance(u, dict):
            raise ValueError("a unit is not an object")
        inputs = u.get("inputs")
        if not isinstance(inputs, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(files) for i in inputs
        ):
            raise ValueError(f"the inputs of unit {u.get('name')!r} are not indexes of its files")
        outcome = u.get("outcome")
        if outcome not in UNIT_OUTCOMES:
            raise ValueError(f"outcome {outcome!r} of unit {u.get('name')!r} is not one of {', '.join(UNIT_OUTCOMES)}")
        seconds = number(u.get("seconds"))
        if seconds is None:
            raise ValueError(f"seconds of unit {u.get('name')!r} is not a number of seconds ({u.get('seconds')!r})")
        units.append(
            UnitRecord(
                name=_text(u.get("name"), "a unit's name", limit=4096),
                object=_text(u.get("object"), "a unit's object"),
                command=_text(u.get("command"), "a unit's command line", limit=1 << 20),
                compiler=_text(u.get("compiler"), "a unit's compiler"),
                manifest=_text(u.get("manifest"), "a unit's manifest key", limit=64),
                result=_text(u.get("result"), "a unit's result key", limit=64),
                inputs=tuple(inputs),
                outcome=str(outcome),
                why=_text(u.get("why", ""), "a unit's reason"),
                seconds=seconds,
                preprocess_s=_seconds_or_none(u.get("preprocess_s"), "preprocess_s"),
                compile_s=_seconds_or_none(u.get("compile_s"), "compile_s"),
                hit_s=_seconds_or_none(u.get("hit_s"), "hit_s"),
            )
        )
    return UnitRecords(
        key=key,
        time=when,
        document=document,
        root=_text(doc.get("root"), "root"),
        ccache=_text(doc.get("ccache", ""), "ccache"),
        files=tuple(files),
        compilers={str(k): str(v) for k, v in compilers.items()},
        units=tuple(units),
    )
