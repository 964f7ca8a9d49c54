"""``doit plan``: what a build would do, why, and how long, before it runs.

:func:`diff_inputs` names the inputs of an action key that differ between two key documents (``torch
2.11.0+cu130 -> 2.11.1+cu130``, ``patch 0002-x.patch changed``, ``env NVTE_CUDA_ARCHS 90a -> 90a;100a``),
and :func:`nearest` picks, of the earlier builds of a package that the cache or the remote knows, the one
with the fewest differing inputs (ties: the most recent); both pure. :func:`make_plan` reads the run's
Context, the wheelhouse and the remote, asks tasks/stages/units.py which compile units the object cache will
answer (by the records of each package's last build, against its staged tree re-derived in a scratch
directory), and asks the forecast (tasks/engine/forecast.py, on the scheduler's own policy) how long the
builds take, from the build history (tasks/store/history.py); it writes nothing but what probing the
toolchain memoises. Every record it reads is checked as the build checks it (a wheel cache entry the build
would discard is a build here). :func:`render_text` and :func:`to_json` present it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.core.procfs import process_seconds
from tasks.engine.forecast import Forecast, forecast_run, run_budget
from tasks.store import noop as noop_record
from tasks.store.history import Earlier, local_builds, read_json

if TYPE_CHECKING:
    from tasks.lock.lockfile import Package
    from tasks.stages.context import Context
    from tasks.stages.units import UnitsPlan

#: ``doit plan format=json``: the schema's name and version (docs/tasks.md, "doit plan").
SCHEMA = "reprostack-plan/2"

#: What a package's line says it would do.
UP_TO_DATE = "up to date"
CACHED = "restored from the local cache"
REMOTE = "restored from the remote"
BUILD = "built"
SKIPPED = "skipped"
PREBUILT = "placed from its prebuilt wheel"
ACTIONS = {
    UP_TO_DATE: "up-to-date",
    CACHED: "cached",
    REMOTE: "remote",
    BUILD: "build",
    SKIPPED: "skipped",
    PREBUILT: "prebuilt",
}

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX40 = re.compile(r"^[0-9a-f]{40}$")

#: Toolchain fields as a line names them.
_TOOL_LABELS = {
    "torch": "torch",
    "torch_cuda": "torch's CUDA",
    "torch_cxx11_abi": "torch's C++11 ABI",
    "python": "python",
    "abi": "python ABI",
    "platform": "platform",
    "cc": "cc",
    "cxx": "c++",
    "cmake": "cmake",
    "nvcc": "nvcc",
    "nvcc_path": "nvcc path",
    "cudnn": "cuDNN",
}


# --------------------------------------------------------------------------- key documents


def _short(value: Any, width: int = 12) -> str:
    if value is None or value == "":
        return "(none)"
    if isinstance(value, str):
        text = value[:width] if len(value) == 64 and all(c in "0123456789abcdef" for c in value) else value
        return text if len(text) <= 200 else text[:200] + "…"
    if isinstance(value, list):
        return ";".join(_short(v) for v in value[:32]) or "(none)"
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 200 else text[:200] + "…"


def _map(value: Any) -> dict[str, Any]:
    """A section of a key document as a mapping; anything else (a document of another shape, as a remote's
    history may hold: its key is computable by anyone) as an empty one."""
    return dict(value) if isinstance(value, dict) else {}


def _items(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def _change(label: str, old: Any, new: Any) -> str:
    return f"{label} {_short(old)} -> {_short(new)}"


def diff_inputs(
    old: Mapping[str, Any], new: Mapping[str, Any], *, sources: Mapping[str, tuple[str, str, str]] | None = None
) -> list[str]:
    """The inputs of an action key that differ from ``old`` to ``new`` (two key documents), one phrase each.

    ``sources``: a source's destination in the package (``.`` or an overlay's) -> (its name, how the old
    tree is named, how the new one is), e.g. ``("transformer-engine", "3cd6870", "5a1b2c3")``; without
    it, trees are named by their hashes' first 12 digits.
    """
    out: list[str] = []
    sources = sources or {}
    if old.get("package") != new.get("package"):
        out.append(_change("package", old.get("package"), new.get("package")))
    if old.get("recipe_format") != new.get("recipe_format"):
        out.append(_change("recipe format", old.get("recipe_format"), new.get("recipe_format")))
    if "prebuilt" in old or "prebuilt" in new:
        if old.get("prebuilt") != new.get("prebuilt"):
            out.append(
                _change(
                    "prebuilt wheel",
                    _map(old.get("prebuilt")).get("filename"),
                    _map(new.get("prebuilt")).get("filename"),
                )
            )
        return out
    tool_old, tool_new = _map(old.get("toolchain")), _map(new.get("toolchain"))
    for name in sorted(set(tool_old) | set(tool_new), key=lambda n: (n != "torch", n)):
        if tool_old.get(name) != tool_new.get(name):
            out.append(_change(_TOOL_LABELS.get(name, f"toolchain {name}"), tool_old.get(name), tool_new.get(name)))
    src_old, src_new = _map(old.get("sources")), _map(new.get("sources"))
    for dest in sorted(set(src_old) | set(src_new)):
        if src_old.get(dest) != src_new.get(dest):
            name, was, now = sources.get(dest, (dest, _short(src_old.get(dest)), _short(src_new.get(dest))))
            where = "" if dest == "." or name == dest else f" (at {dest})"
            out.append(
                f"source {name}{where} {was if src_old.get(dest) else '(none)'} -> "
                f"{now if src_new.get(dest) else '(none)'}"
            )
    out.extend(_patch_changes(_items(old.get("patches")), _items(new.get("patches"))))
    rec_old, rec_new = _map(old.get("recipe")), _map(new.get("recipe"))
    env_old, env_new = _map(rec_old.get("env")), _map(rec_new.get("env"))
    for name in sorted(set(env_old) | set(env_new)):
        if env_old.get(name) != env_new.get(name):
            out.append(_change(f"env {name}", env_old.get(name), env_new.get(name)))
    req_old, req_new = _map(rec_old.get("build_requires")), _map(rec_new.get("build_requires"))
    torch_said = any(line.startswith("torch ") for line in out)
    for name in sorted(set(req_old) | set(req_new)):
        if req_old.get(name) != req_new.get(name) and not (name == "torch" and torch_said):
            out.append(_change(f"build requirement {name}", req_old.get(name), req_new.get(name)))
    for name in ("subdir", "pip_args"):
        if rec_old.get(name) != rec_new.get(name):
            out.append(_change(name, rec_old.get(name), rec_new.get(name)))
    if old.get("archs") != new.get("archs"):
        out.append(_change("archs", old.get("archs"), new.get("archs")))
    for section, label in (
        ("reproducible", "reproducible"),
        ("builder", "builder"),
        ("hermetic_toolchain", "hermetic toolchain"),
    ):
        a, b = _map(old.get(section)), _map(new.get(section))
        for name in sorted(set(a) | set(b)):
            if a.get(name) != b.get(name):
                out.append(_change(f"{label} {name}", a.get(name), b.get(name)))
    known = {
        "package",
        "recipe_format",
        "prebuilt",
        "toolchain",
        "sources",
        "patches",
        "recipe",
        "archs",
        "reproducible",
        "builder",
        "hermetic_toolchain",
    }
    for name in sorted((set(old) | set(new)) - known):
        if old.get(name) != new.get(name):
            out.append(_change(name, old.get(name), new.get(name)))
    return out


def _patch_changes(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[str]:
    was = {str(p.get("name")): p.get("sha256") for p in old}
    now = {str(p.get("name")): p.get("sha256") for p in new}
    out = []
    for name in now:
        if name not in was:
            out.append(f"patch {name} added")
        elif was[name] != now[name]:
            out.append(f"patch {name} changed")
    out.extend(f"patch {name} removed" for name in was if name not in now)
    common_old = [n for n in was if n in now]
    common_new = [n for n in now if n in was]
    if common_old != common_new:
        out.append("patches reordered")
    return out


def nearest(document: Mapping[str, Any], earlier: Iterable[Earlier]) -> tuple[Earlier, list[str]] | None:
    """The earlier build with the fewest inputs differing from ``document``, ties to the most recent;
    with the differences. None when there is none."""
    best: tuple[int, float, Earlier, list[str]] | None = None
    for e in earlier:
        changes = diff_inputs(e.document, document)
        rank = (len(changes), -e.time)
        if best is None or rank < (best[0], best[1]):
            best = (rank[0], rank[1], e, changes)
    return None if best is None else (best[2], best[3])


def object_reuse(pkg: Package, changes: Sequence[str], *, objcache: bool, objects: Path) -> tuple[str, str]:
    """What the compile-object cache can still serve of a build with ``changes``: (``all``, ``partial``,
    ``none``, ``off``, ``empty`` or ``unknown``, a phrase)."""
    if not objcache:
        return "off", "object cache off: every unit compiles"
    try:
        empty = not objects.is_dir() or not any(objects.iterdir())
    except OSError:
        empty = True
    if empty:
        return "empty", "the object cache is empty: every unit compiles"
    if not changes:
        return "unknown", "no earlier build to compare: units compiled before under the same flags are hits"
    compiler = [c for c in changes if not c.startswith(("source ", "patch")) and not _torch_only(c, pkg)]
    if any(c.startswith(("torch ", "torch's ")) for c in changes) and pkg.needs_torch:
        compiler.append("torch")
    if compiler:
        return "none", "object cache: little to reuse, the compiler, its flags or headers changed"
    if all(c.startswith(("source ", "patch")) for c in changes):
        return "partial", "object cache: units whose sources and headers the change leaves alone are hits"
    return "all", "object cache: the change does not reach the compiler, so its units can all be hits"


def _torch_only(change: str, pkg: Package) -> bool:
    """A change of torch for a package that does not build against torch: it does not reach its compiles."""
    return change.startswith(("torch ", "torch's ")) and not pkg.needs_torch


# --------------------------------------------------------------------------- the plan


@dataclass
class Line:
    """One package's line of the plan."""

    package: str
    action: str
    key: str
    download_bytes: int | None = None
    changes: list[str] = field(default_factory=list)
    nearest: Earlier | None = None
    reuse: tuple[str, str] = ("", "")
    origin: str = ""  # where its forecast figures come from: cache, hints, none
    range_s: tuple[float, float] | None = None
    why: str = ""  # skipped: why
    #: Its compile units, as the object cache will answer them (None: no record of its units).
    units: UnitsPlan | None = None
    #: Its wheel cache entry, which the build would discard: why.
    discarded: str = ""


@dataclass
class RunPlan:
    lock: str
    profile: str
    remote: str
    slots: int
    budget_mb: float | None
    lines: list[Line]
    forecast: Forecast
    #: Seconds the plan took to re-derive the staged trees and compare the units (all packages).
    units_s: float = 0.0
    #: Nothing to build, and the forecast is the no-op time a `doit wheels` of this lock recorded.
    noop_recorded: bool = False


def _source_names(ctx: Context, pkg: Package, old: Mapping[str, Any]) -> dict[str, tuple[str, str, str]]:
    """For :func:`diff_inputs`: each source of ``pkg`` by its name, its old tree by the commit the source
    cache saw it at (else the tree hash), its new one by the lock's commit (else the tree hash)."""
    out = {}
    old_trees = _map(old.get("sources"))
    for dest, name in ((".", pkg.source), *pkg.overlays):
        src = ctx.lock.sources[name]
        was = old_trees.get(dest)
        was = was if isinstance(was, str) and _HEX64.match(was) else ""  # (a remote's document names any path)
        meta = read_json(ctx.cache.source_dir(was) / "meta.json") if was else {}
        commit = meta.get("commit")
        old_label = (commit if isinstance(commit, str) and _HEX40.match(commit) else "")[:7] or was[:12]
        out[dest] = (name, old_label, (src.commit or "")[:7] or src.tree_sha256[:12])
    return out


def _touched(ctx: Context, pkg: Package, changes: Sequence[str]) -> list[str]:
    """The files that the added or changed patches of ``changes`` edit (their ``+++`` lines)."""
    named = {c[len("patch ") :].rsplit(" ", 1)[0] for c in changes if c.endswith((" changed", " added"))}
    files: list[str] = []
    for patch in ctx.patches(pkg):
        if patch.name not in named:
            continue
        try:
            text = patch.path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("+++ ") and not line.startswith("+++ /dev/null"):
                path = line[4:].split("\t")[0].strip()
                path = path.split("/", 1)[1] if path.startswith(("b/", "a/")) else path
                if path not in files:
                    files.append(path)
    return files[:8]


def _shard(ctx: Context) -> tuple[Package, ...]:
    """The profile's packages this run would build: with ``shard=i/N``, that shard's (as `doit wheels` splits)."""
    if ctx.settings.shard is None:
        return ctx.packages
    from tasks.engine.admission import shard_packages
    from tasks.store.history import package_weights

    weights = package_weights(ctx.lock.patches_dir, [p.name for p in ctx.packages], ctx.settings.profile)
    names = set(shard_packages([p.name for p in ctx.packages], ctx.settings.shard, weights))
    return tuple(p for p in ctx.packages if p.name in names)


def _wheelhouse_current(ctx: Context) -> bool:
    """Whether `doit wheels` would find wheels/ up to date and do nothing (its own check)."""
    from tasks.core.errors import ReproError
    from tasks.stages.wheelhouse import is_current

    if ctx.settings.remote_write:
        return False
    try:
        return is_current(ctx)[0]
    except ReproError:
        return False


def _units_reuse(units: UnitsPlan, objcache: bool) -> tuple[str, str]:
    """The line's object-cache kind and phrase from its units' outcomes."""
    c = units.counts
    total = sum(c.values())
    if not objcache:
        return "off", f"object cache off: every unit compiles ({total})"
    served = c["hit"] + c["remote"]
    if not c["compile"] and not c["preprocessed"]:
        kind = "all"
    elif not served and not c["preprocessed"]:
        kind = "none"
    else:
        kind = "partial"
    parts = [f"{c['compile']} compile{'s' if c['compile'] == 1 else ''}"]
    if c["preprocessed"]:
        parts.append(f"{c['preprocessed']} preprocessed then hit")
    parts.append(f"{c['hit']} hit{'s' if c['hit'] == 1 else ''}")
    if c["remote"]:
        parts.append(f"{c['remote']} from the remote object cache")
    return kind, f"object cache: of {total} unit(s), {', '.join(parts)}"


def make_plan(ctx: Context) -> RunPlan:
    """What `doit wheels` would do with this lock, profile, cache and remote; nothing is written."""
    from tasks.core.errors import FetchError
    from tasks.env.objcache import shared_remote
    from tasks.stages import units as unit_records
    from tasks.store.cache import WheelEntry
    from tasks.store.history import read_units
    from tasks.store.manifest import read_document

    manifest = read_document(ctx.settings.wheels) or {}
    current = manifest.get("lock_sha256") == ctx.lock.sha256 and manifest.get("profile") == ctx.settings.profile
    listed = manifest.get("wheels")
    placed = {
        w.get("package"): w.get("action_key")
        for w in (listed if isinstance(listed, list) else [])
        if isinstance(w, dict)
        and w.get("origin") != "fetched"
        and isinstance(w.get("filename"), str)
        and "/" not in w["filename"]
        and (ctx.settings.wheels / w["filename"]).is_file()
    }
    whole = _wheelhouse_current(ctx) if current else False
    remote = ctx.remote if ctx.settings.remote else None  # (not imported without one)
    sizes = (
        unit_records.RemoteSizes(remote)
        if remote is not None and ctx.settings.objcache and shared_remote(ctx.settings.remote)
        else None
    )
    lines: list[Line] = []
    building: list[Package] = []
    units_s = 0.0
    for pkg in _shard(ctx):
        why = ctx.skipped(pkg)
        if why:
            lines.append(Line(pkg.name, SKIPPED, "", why=why))
            continue
        try:
            key, doc = ctx.key(pkg)
        except FetchError as exc:  # a patch of another source, not fetched yet: its key needs the file
            lines.append(Line(pkg.name, BUILD, "", changes=[f"key unknown: {exc.message}"]))
            building.append(pkg)
            continue
        discarded = ""
        if ctx.cache.wheel_exists(key):
            if whole:  # `doit wheels` finds wheels/ as it would make it: it reads no cache entry
                lines.append(Line(pkg.name, UP_TO_DATE, key))
                continue
            found = ctx.cache.check_wheel(key)  # as the build checks it (Cache.get_wheel)
            if isinstance(found, WheelEntry):
                action = UP_TO_DATE if current and placed.get(pkg.name) == key else CACHED
                lines.append(Line(pkg.name, action, key))
                continue
            discarded = found or ""
        if pkg.prebuilt:
            lines.append(Line(pkg.name, PREBUILT, key, discarded=discarded))
            continue
        size = remote.lookup(key) if remote is not None else None
        if size is not None:
            lines.append(Line(pkg.name, REMOTE, key, download_bytes=size, discarded=discarded))
            continue
        earlier = local_builds(ctx.cache.root, pkg.name)
        if remote is not None:
            earlier += remote.history(pkg.name)
        found_earlier = nearest(doc, [e for e in earlier if e.key != key])
        line = Line(pkg.name, BUILD, key, discarded=discarded)
        if found_earlier is not None:
            line.nearest = found_earlier[0]
            line.changes = diff_inputs(
                found_earlier[0].document, doc, sources=_source_names(ctx, pkg, found_earlier[0].document)
            )
        line.reuse = object_reuse(pkg, line.changes, objcache=ctx.settings.objcache, objects=ctx.cache.objects)
        records = read_units(ctx.cache.root, pkg.name)
        if records is not None:
            line.units = unit_records.predict(
                ctx, pkg, records, key, doc, diff_inputs(records.document, doc), remote_sizes=sizes
            )
            units_s += line.units.stage_s
            line.reuse = _units_reuse(line.units, ctx.settings.objcache)
        lines.append(line)
        building.append(pkg)
    if not building:  # nothing to build: the no-op's time as this cache's last `doit wheels` of this lock and
        # profile measured it (tasks/cli/graph.py's Reporter); without one, this plan's own time so far (a no-op
        # plan imports no more than a no-op `doit wheels`, and does what it does up to doit's checks)
        noop = noop_record.read(ctx.cache.root, ctx.lock.sha256, ctx.settings.profile)
        return RunPlan(lock=str(ctx.lock.path), profile=ctx.settings.profile, remote=ctx.settings.remote,
                    slots=ctx.settings.jobs or os.cpu_count() or 1, budget_mb=None, lines=lines,
                    forecast=Forecast(round(noop if noop is not None else process_seconds(), 2), 0.0),
                    noop_recorded=noop is not None)  # fmt: skip
    predicted = {line.package: unit_records.for_forecast(line.units) for line in lines if line.units is not None}
    forecast, where = forecast_run(ctx.cache.root, ctx.lock.patches_dir, ctx.settings, building, predicted=predicted)
    for line in lines:
        if line.package in where:
            line.origin, line.range_s = where[line.package]
            told = forecast.packages.get(line.package)
            if line.units is not None:
                continue
            if line.origin == "cache" and told is not None and not told.units and line.reuse[0] != "off":
                line.reuse = ("all", "no compile units at its last build: nothing for the object cache to do")
            elif line.reuse[0] == "partial":
                touched = _touched(ctx, ctx.package(line.package), line.changes)
                if touched:
                    line.reuse = ("partial", f"{line.reuse[1]} (the changed patches touch {', '.join(touched)})")
    slots, budget = run_budget(ctx.settings, building)
    return RunPlan(
        lock=str(ctx.lock.path),
        profile=ctx.settings.profile,
        remote=ctx.settings.remote,
        slots=slots,
        budget_mb=budget,
        lines=lines,
        forecast=forecast,
        units_s=units_s,
    )


# --------------------------------------------------------------------------- output


def _seconds(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s" if s >= 10 else f"{s:.1f} s"
    return f"{int(s // 60)} min {int(s % 60):02d} s"


def _bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _when(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "(no date)"


def _unit_lines(units: UnitsPlan, pad: str) -> list[str]:
    """The units that will not simply hit, the first few, and what the counts leave out."""
    from tasks.stages.units import COMPILE

    out = []
    first = units.first()
    gated = sum(1 for u in units.units if u.gated)
    for u in first:
        verb = "compiles" if u.outcome == COMPILE else "is preprocessed, then a hit"
        out.append(f"{pad}  {u.name} {verb} (about {_seconds(u.seconds)}): {u.why}")
    if gated > len(first):
        out.append(f"{pad}  … and {gated - len(first)} more")
    out.extend(f"{pad}  {note}" for note in units.notes)
    return out


def render_text(plan: RunPlan) -> str:
    """The plan for a person: one line per package, its reasons under it, then the forecast."""
    out = [f"plan for {plan.lock}, profile {plan.profile}" + (f", remote {plan.remote}" if plan.remote else "")]
    width = max((len(line.package) for line in plan.lines), default=0)
    for line in plan.lines:
        head = f"  {line.package.ljust(width)}  {line.action}"
        if line.action == REMOTE and line.download_bytes is not None:
            head += f" ({_bytes(line.download_bytes)} to download)"
        if line.action == SKIPPED:
            head += f": {line.why}"
        if line.action == BUILD:
            head += f" (key {line.key[:12]})" if line.key else ""
            pf = plan.forecast.packages.get(line.package)
            if line.origin == "cache" and pf is not None:
                head += f", about {_seconds(pf.wall_s)}"
            elif line.range_s is not None:
                head += (
                    f", no record in this cache: {_seconds(line.range_s[0])} to {_seconds(line.range_s[1])} "
                    "of compiles by the lock's hints"
                )
            else:
                head += ", no record in this cache and no hints in the lock: time unknown"
        out.append(head)
        pad = " " * (width + 4)
        if line.discarded:
            out.append(f"{pad}its wheel cache entry would be discarded: {line.discarded}")
        if line.action != BUILD:
            continue
        if line.nearest is None:
            out.append(f"{pad}no earlier build of {line.package} in the cache or the remote")
        elif line.changes:
            where = "this cache" if line.nearest.where == "local" else "the remote"
            out.append(
                f"{pad}changed since the build of {_when(line.nearest.time)} in {where} (key {line.nearest.key[:12]}):"
            )
            out.extend(f"{pad}  {change}" for change in line.changes)
        if line.units is not None:
            out.append(f"{pad}{line.reuse[1]} (by its units at the build of {_when(line.units.since)}):")
            out.extend(_unit_lines(line.units, pad))
        else:
            out.append(f"{pad}{line.reuse[1]}")
    builds = [line for line in plan.lines if line.action == BUILD]
    restored = [line for line in plan.lines if line.action == REMOTE]
    if restored:
        total = sum(line.download_bytes or 0 for line in restored)
        out.append(f"remote: {len(restored)} wheel(s), {_bytes(total)} to download")
    if not builds:
        how = (
            "what the last `doit wheels` of this lock and profile took besides its tasks"
            if plan.noop_recorded
            else "what this plan took to find it out"
        )
        out.append(f"forecast: nothing to build: {_seconds(plan.forecast.wall_s)}, {how}")
        return "\n".join(out)
    budget = f"{plan.budget_mb / 1024:.0f} GB" if plan.budget_mb is not None else "tokens only (memory=job)"
    unknown = [line.package for line in builds if line.origin != "cache"]
    note = ""
    if unknown:
        note = f"; without a record of {', '.join(unknown)} (their compiles by the lock's hints, if any)"
    if len(unknown) == len(builds) and not any(line.origin == "hints" for line in builds):
        out.append(f"forecast: none, no package to build has a record in this cache or hints in the lock{note[1:]}")
        return "\n".join(out)
    unrecorded = [line.package for line in builds if line.units is None and line.origin == "cache"]
    if unrecorded:
        how = (
            f"every unit of {', '.join(unrecorded)} compiled (no record of its units: object cache hits make it "
            "shorter)"
        )
    else:
        how = "each unit as the object cache will answer it"
    remote_note = ""
    if plan.remote and any(line.units is not None for line in builds):
        checked = any(line.units is not None and line.units.remote == "checked" for line in builds)
        remote_note = (
            "; remote object-cache hits at 2 round trips and their size at 100 MB/s"
            if checked
            else "; the remote's object cache not counted (it is shared only through an http(s) remote=)"
        )
    out.append(
        f"forecast: {_seconds(plan.forecast.wall_s)} of wall time for {len(builds)} build(s), peak memory "
        f"{plan.forecast.peak_mb / 1024:.1f} GB of compiles, on {plan.slots} job slots and {budget}{note}; "
        f"{how}{remote_note}"
    )
    return "\n".join(out)


def to_json(plan: RunPlan) -> dict[str, Any]:
    """The plan for CI, schema :data:`SCHEMA` (documented in docs/tasks.md)."""
    packages = []
    for line in plan.lines:
        pf = plan.forecast.packages.get(line.package)
        entry: dict[str, Any] = {
            "package": line.package,
            "action": ACTIONS[line.action],
            "key": line.key or None,
            "download_bytes": line.download_bytes,
            "changes": list(line.changes),
            "nearest": None,
            "object_cache": line.reuse[0] or None,
            "units": None,
            "discarded": line.discarded or None,
            "forecast": None,
        }
        if line.action == SKIPPED:
            entry["reason"] = line.why
        if line.nearest is not None:
            entry["nearest"] = {"key": line.nearest.key, "where": line.nearest.where, "time": line.nearest.time}
        if line.units is not None:
            entry["units"] = {
                "since": line.units.since,
                "counts": dict(line.units.counts),
                "compile_s": round(line.units.compile_s, 1),
                "stage_s": round(line.units.stage_s, 2),
                "remote": line.units.remote or None,
                "notes": list(line.units.notes),
                "list": [
                    {"unit": u.name, "outcome": u.outcome, "seconds": round(u.seconds, 2), "why": u.why or None}
                    for u in line.units.units
                ],
            }
        if line.action == BUILD:
            entry["forecast"] = {
                "wall_s": round(pf.wall_s, 1) if pf is not None else None,
                "start_s": round(pf.start_s, 1) if pf is not None else None,
                "record": line.origin,
                "range_s": [round(x, 1) for x in line.range_s] if line.range_s else None,
            }
        packages.append(entry)
    counts = {a: sum(1 for line in plan.lines if ACTIONS[line.action] == a) for a in ACTIONS.values()}
    builds = [line for line in plan.lines if line.action == BUILD]
    return {
        "schema": SCHEMA,
        "lock": plan.lock,
        "profile": plan.profile,
        "remote": plan.remote or None,
        "packages": packages,
        "counts": counts,
        "download_bytes": sum(line.download_bytes or 0 for line in plan.lines if line.action == REMOTE),
        "forecast": {
            "wall_s": round(plan.forecast.wall_s, 1 if builds else 2),
            "peak_mb": round(plan.forecast.peak_mb),
            "slots": plan.slots,
            "mem_budget_mb": round(plan.budget_mb) if plan.budget_mb is not None else None,
            "complete": all(line.origin == "cache" for line in builds),
            "units_known": all(line.units is not None for line in builds if line.origin == "cache"),
            "compile_s": round(sum(line.units.compile_s for line in builds if line.units is not None), 1),
            "noop": ("recorded" if plan.noop_recorded else "this plan") if not builds else None,
        },
    }
