"""Stage 3: build one package's wheel under its action key, or reuse the cached one.

The build runs ``pip wheel --no-build-isolation --no-deps --no-index``
in the venv of the package's build closure (tasks/env/buildenv.py), with the recipe's environment,
in a fresh staged tree that the build sees at a canonical path, with the
flags and environment of tasks/env/reproducible.py. Its full output goes to ``build/logs/build-<pkg>.log``.
The wheel is normalised and stored in the cache atomically; concurrent doit
processes wanting the same key wait on a file lock and then reuse it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tasks.core import proc, workspace
from tasks.core.errors import BuildError
from tasks.core.fsutil import rmtree
from tasks.engine.jobserver import killed_for_memory
from tasks.engine.timeline import Outcome, Progress, Unit, interval_union, parse_ninja_log, read_waits
from tasks.env import build_container, compilers, docker, objcache, reproducible, toolchain
from tasks.lock.fetch import ensure_wheel, verified_source
from tasks.lock.lockfile import Package
from tasks.stages import units as unit_records
from tasks.stages.context import Context
from tasks.stages.patch import stage_package
from tasks.store import history
from tasks.store.cache import WheelEntry
from tasks.store.wheelnorm import DEFAULT_EPOCH, normalize_wheel

#: Builds cannot reach the network: proxies point at a closed port on loopback.
CLOSED_PROXY = "http://127.0.0.1:9"


def build_env(ctx: Context, pkg: Package, jobs: int) -> dict[str, str]:
    env = ctx.host_env()  # with the hermetic toolchain's CUDA, when the lock pins one
    # Nothing of the host's Python: the build venv (tasks/env/buildenv.py) sees its closure and the base's torch,
    # and PYTHONPATH only the hermetic toolchain's site (its torch, where it pins one).
    env.pop("PYTHONHOME", None)
    if ctx.hermetic is not None:
        env["PYTHONPATH"] = str(ctx.hermetic.site)
    else:
        env.pop("PYTHONPATH", None)
    env = toolchain.cuda_env(env, ctx.toolchain)  # nvcc by its resolved path, whatever PATH reached it
    env.pop(compilers.GATED_MARK, None)  # only the gate's compilers carry it (a run started inside a build)
    env.update(ctx.recipe_env(pkg))
    for name in pkg.jobs_env:
        env[name] = str(jobs)
    env.update(
        SOURCE_DATE_EPOCH=str(DEFAULT_EPOCH),
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        http_proxy=CLOSED_PROXY,
        https_proxy=CLOSED_PROXY,
        HTTP_PROXY=CLOSED_PROXY,
        HTTPS_PROXY=CLOSED_PROXY,
        no_proxy="",
        NO_PROXY="",
        GIT_TERMINAL_PROMPT="0",
        PYTHONNOUSERSITE="1",
    )
    return env


def source_trees(ctx: Context, pkg: Package) -> dict[str, Path]:
    trees = {}
    for name in pkg.source_names():
        src = ctx.lock.sources[name]
        trees[name] = verified_source(
            src,
            cache=ctx.cache,
            mirror=ctx.settings.mirror,
            log=ctx.settings.logs / f"fetch-{name}.log",
        )
    return trees


def wheel_command(pkg: Package, out: str, build_dir: str, python: str = sys.executable) -> list[str]:
    """The command that builds ``pkg``'s wheel from ``build_dir`` into ``out``."""
    return [
        python,
        "-m",
        "pip",
        "wheel",
        "--no-build-isolation",
        "--no-deps",
        "--no-index",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "-v",
        "-w",
        out,
        *pkg.pip_args,
        build_dir,
    ]


#: How a build command runs (:func:`tasks.core.proc.run`'s signature, raising ``error`` on failure).
Runner = Callable[..., proc.Usage]


@dataclass(frozen=True)
class Compiled:
    wheel: Path
    usage: proc.Usage
    objects: objcache.Stats
    #: (start, end) wall-clock seconds the build waited for job slots that other builds held
    waits: tuple[tuple[float, float], ...] = ()
    #: compiler -> how many of its runs escaped the gate and the object cache (tasks/env/compilers.py)
    escaped: tuple[tuple[str, int], ...] = ()
    #: (unit, node, start, seconds) of the units that compiled on a cluster node (tasks/engine/cluster.py)
    nodes: tuple[tuple[str, str, float, float], ...] = ()
    #: ccache's log of the build's compiles (tasks/stages/units.py records from it), and where the build saw
    #: its staged tree; None without the object cache
    object_log: Path | None = None
    seen: str = ""
    #: CPU-seconds of its gated units as their gates measured them (None: no gate measured one); the rest of
    #: ``usage.cpu_seconds`` is its serial part's (pip, CMake's configure, the links)
    units_cpu_s: float | None = None


def compile_wheel(
    ctx: Context,
    pkg: Package,
    *,
    stage_dir: Path,
    out: Path,
    log: Path,
    jobs: int,
    progress: Progress | None = None,
    object_cache: bool = True,
    runner: Runner = proc.run,
) -> Compiled:
    """Stage ``pkg`` at ``stage_dir`` and build its normalised wheel into ``out``; the caller removes the stage.

    The build sees the stage at its canonical path (see tasks/env/reproducible.py),
    takes its compiler jobs from the run's jobserver and, unless
    ``object_cache`` is false (``doit repro`` must really recompile), reuses
    objects from the compile-object cache. ``runner`` runs the build command (:func:`tasks.core.proc.run`'s
    signature; tests pass their own).
    """
    build_dir = stage_package(pkg, trees=source_trees(ctx, pkg), patches=ctx.patches(pkg), dest=stage_dir, log=log)
    raw = out / "raw"
    if ctx.builder is not None:
        # The toolchain is the builder image (tasks/env/build_container.py): the build runs
        # in a container at fixed paths, without the host's jobserver or object cache.
        env = build_container.build_env(ctx.recipe_env(pkg), pkg.jobs_env, jobs)
        mounts = {stage_dir: build_container.SRC_MOUNT, out: build_container.OUT_MOUNT}
        cmd = build_container.container_command(
            ctx.builder, wheel_command(pkg, str(raw), str(build_dir)), mounts=mounts, workdir=build_dir, env=env
        )
        usage = run_build(
            cmd, env=docker.client_env(), cwd=stage_dir, log=log, pkg=pkg, progress=progress, runner=runner
        )
        return Compiled(
            wheel=_normalised(raw, out, pkg, log, ctx.requires_added(pkg)), usage=usage, objects=objcache.Stats(0, 0)
        )
    place = reproducible.placement(pkg.name, stage_dir)
    tools = ctx.build_environment(pkg, log)  # the build closure's venv: its python runs the build, its bin/ first
    cmd = wheel_command(pkg, str(raw), place.path(build_dir), python=str(tools.python))
    server = ctx.jobserver()
    env = build_env(ctx, pkg, jobs)
    env["PATH"] = os.pathsep.join([str(tools.bin), env.get("PATH", os.defpath)])
    env = server.env(reproducible.apply(env, place, nvcc_seed=ctx.nvcc_seed, build_env=str(tools.root)))
    objects = ctx.objcache() if object_cache else None
    stats_log = (ctx.settings.logs / f"ccache-{pkg.name}.log").absolute()
    stats_log.unlink(missing_ok=True)
    object_log = (out / "ccache-units.log").absolute() if objects is not None else None
    if objects is not None:
        env = objects.env(env, stats_log=stats_log, log=object_log)
    env, how = server.gate_env(env, ccache=objects is not None)
    if how:
        with log.open("a") as fh:
            fh.write(how + "\n")
    # Compilers that escaped the gate (only where there is one: without it, none takes a token).
    watch = compilers.Watch() if server.broker is not None else None
    with (
        server.build_session(
            pkg.name,
            out=out,
            cache_root=ctx.cache.root,
            patches=ctx.lock.patches_dir / pkg.name,
            default_mb=pkg.mem_per_job_gb * 1024,
            log=log,
            profile=ctx.settings.profile,
        ) as session,
        server.slot(server.tokens_for(jobs), wait_log=session.wait_log),
        watch or contextlib.nullcontext(),
    ):
        usage = run_build(
            place.command(cmd, build_dir),
            env={**env, **session.env},
            cwd=build_dir,
            log=log,
            pkg=pkg,
            progress=progress,
            watch=watch,
            runner=runner,
        )
    escaped = watch.escaped() if watch is not None else {}
    if escaped:
        with log.open("a") as fh:
            fh.write(
                f"# but {sum(escaped.values())} compile(s) seen running outside the gate and the object cache: "
                f"{compilers.describe(escaped)}\n"
            )
    return Compiled(
        wheel=_normalised(raw, out, pkg, log, ctx.requires_added(pkg)),
        usage=usage,
        objects=objcache.stats(stats_log),
        waits=tuple(read_waits(session.wait_log)) + tuple(session.starved),
        escaped=tuple(sorted(escaped.items())),
        nodes=tuple(
            sorted(
                (u, str(found["node"]), float(str(found.get("since", 0))), float(str(found.get("seconds", 0))))
                for u, found in session.units.items()
                if "node" in found
            )
        ),
        object_log=object_log,
        seen=place.path(place.stage),
        units_cpu_s=_units_cpu(session.units),
    )


def _units_cpu(units: dict[str, dict[str, object]]) -> float | None:
    """The CPU-seconds the gates measured of a build's units (None where none did)."""
    found = [float(v) for u in units.values() if isinstance(v := u.get("cpu_s"), int | float)]
    return sum(found) if found else None


def _normalised(raw: Path, out: Path, pkg: Package, log: Path, requires: list[str]) -> Path:
    """The build's one wheel, normalised, with ``requires`` (the torch it was compiled against) in its metadata."""
    wheels = sorted(raw.glob("*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"build of {pkg.name} produced {len(wheels)} wheels, expected one; see {log}")
    norm = out / wheels[0].name
    normalize_wheel(wheels[0], norm, epoch=DEFAULT_EPOCH, requires=requires)
    if requires:
        with log.open("a") as fh:
            fh.write(f"# added to the wheel's METADATA: {'; '.join(f'Requires-Dist: {r}' for r in requires)}\n")
    return norm


def build_package(ctx: Context, pkg: Package) -> WheelEntry:
    """The verified cache entry of ``pkg``'s wheel: the local cache's, the remote's (remote=), or built now.

    With remote_write=on, a wheel built here goes to the remote, and so does
    one from the local cache that the remote does not have yet (built before
    the remote was set, or by a run without remote_write).
    """
    key, doc = ctx.key(pkg)
    entry = ctx.cache.get_wheel(key)
    if entry is None and pkg.prebuilt:
        with ctx.cache.lock(f"wheel-{key}"):
            return ctx.cache.get_wheel(key) or _place_prebuilt(ctx, pkg, key, doc)
    if entry is None:
        with ctx.cache.lock(f"wheel-{key}"):
            entry = ctx.cache.get_wheel(key)
            if entry is None:
                return _restore_or_build(ctx, pkg, key, doc)
    if ctx.remote is not None:
        ctx.remote.upload(entry, pkg.name, doc, if_missing=True)
    return entry


def _place_prebuilt(ctx: Context, pkg: Package, key: str, doc: dict[str, object]) -> WheelEntry:
    """A prebuilt package's wheel (its source is the wheel file), verified by sha256, into the wheel cache as is."""
    src = ctx.lock.sources[pkg.source]
    wheel = ensure_wheel(src, cache=ctx.cache, mirror=ctx.settings.mirror)
    entry = ctx.cache.put_wheel(key, wheel, {"package": pkg.name, "key_document": doc, "prebuilt": src.url})
    ctx.record(Outcome(package=pkg.name, status="prebuilt"))
    print(f"placed {pkg.name}: {entry.path.name} (prebuilt, sha256:{entry.sha256[:16]}…, from {src.url})", flush=True)
    return entry


def _restore_or_build(ctx: Context, pkg: Package, key: str, doc: dict[str, object]) -> WheelEntry:
    """Called with the key's lock held and no local entry."""
    if ctx.remote is not None:
        entry = ctx.remote.restore(ctx.cache, pkg.name, key, distribution=pkg.distribution_name)
        if entry is not None:
            ctx.record(Outcome(package=pkg.name, status="restored"))
            return entry
    entry = _build(ctx, pkg, key, doc)
    if ctx.remote is not None:
        ctx.remote.upload(entry, pkg.name, doc)
    return entry


def _build(ctx: Context, pkg: Package, key: str, doc: dict[str, object]) -> WheelEntry:
    log = ctx.settings.logs / f"build-{pkg.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"# build of {pkg.name}, action key {key}\n# key document: {json.dumps(doc, sort_keys=True)}\n")
    jobs = ctx.jobs_for(pkg)
    stage_dir = (ctx.settings.builddir / "stage" / f"{pkg.name}-{key[:12]}").absolute()
    print(f"build {pkg.name} (key {key[:12]}, {jobs} jobs), log: {log}", flush=True)
    started, wall_start = time.monotonic(), time.time()
    status = ctx.status  # (made with the job server: the run's progress and the time left, one line for all builds)
    progress = Progress(pkg.name, lambda line: print(line, flush=True), every=15.0 if status is None else 0.0)
    workspace.tree(stage_dir, live=True)
    try:
        with ctx.cache.staging(f"out-{pkg.name}") as out, status.follow(progress) if status else progress:
            built = compile_wheel(ctx, pkg, stage_dir=stage_dir, out=out, log=log, jobs=jobs, progress=progress)
            norm, usage, (hits, misses, remote_failed) = built.wheel, built.usage, built.objects
            seconds = round(time.monotonic() - started, 3)
            entry = ctx.cache.put_wheel(
                key,
                norm,
                {
                    "package": pkg.name,
                    "key_document": doc,
                    "build_seconds": seconds,
                    "cpu_seconds": round(usage.cpu_seconds, 1),
                    "max_rss_mb": round(usage.max_rss_mb),
                    "jobs": jobs,
                    "object_cache": {"hits": hits, "misses": misses, "remote_failed": remote_failed},
                },
            )
            ran = _record_units(ctx, pkg, key, doc, built, stage_dir)
        units = ninja_units(stage_dir, wall_start)
        history.record_times(
            ctx.cache.root, pkg.name, {os.path.basename(u.output): (u.end_ms - u.start_ms) / 1000 for u in units}
        )
        ctx.record(
            Outcome(
                package=pkg.name,
                status="built",
                start=wall_start,
                wall_s=seconds,
                cpu_s=usage.cpu_seconds,
                max_rss_mb=usage.max_rss_mb,
                units=units,
                object_hits=hits,
                object_misses=misses,
                wait_s=interval_union(built.waits, wall_start, wall_start + seconds),
                escaped=dict(built.escaped),
                nodes=list(built.nodes),
            )
        )
        # For the next forecast (tasks/engine/forecast.py): the part of the wall time its compiles ran or waited.
        # (Where no ninja log placed the compiles in time, the object cache's log did: their runs, hits included.)
        spans = [(wall_start + u.start_ms / 1000, wall_start + u.end_ms / 1000) for u in units] or ran
        covered = interval_union([*spans, *built.waits], wall_start, wall_start + seconds) if spans else None
        edges = [os.path.basename(u.output) for u in units]
        history.record_build(ctx.cache.root, pkg.name, key=key, wall_s=seconds, wait_s=ctx.outcomes[pkg.name].wait_s,
                          compile_s=covered, slots=jobs, ninja_units=edges, cpu_s=usage.cpu_seconds,
                          units_cpu_s=built.units_cpu_s)  # fmt: skip
    finally:
        if os.environ.get("REPRO_KEEP_STAGE", "") in ("", "0"):
            rmtree(stage_dir)
            workspace.tree(stage_dir, live=False)
    print(
        f"built {pkg.name} in {seconds:.1f}s (CPU {usage.cpu_seconds:.0f}s, largest process "
        f"{usage.max_rss_mb:.0f} MB, object cache {hits} hits / {misses} misses): {entry.path.name}",
        flush=True,
    )
    if built.escaped:
        print(
            f"warning: {pkg.name}: {sum(n for _, n in built.escaped)} compile(s) seen running outside the run's "
            f"gate and object cache ({compilers.describe(dict(built.escaped))}): they took no job token and no memory "
            f"admission, and were not cached: the build runs it by a path of its own or a name the gate does not "
            f"know (see docs/building.md)",
            flush=True,
        )
    if remote_failed:
        shared = " and not uploaded" if ctx.settings.remote_write else ""
        print(
            f"warning: {pkg.name}: the remote object cache did not answer (timeout or error) for {remote_failed} "
            f"of {hits + misses} compiles; they were compiled here{shared} (remote_timeout is "
            f"{ctx.settings.remote_timeout:g} s; details in {ctx.settings.logs / f'ccache-{pkg.name}.log'})",
            flush=True,
        )
    largest_gb = usage.max_rss_mb / 1024
    if largest_gb > pkg.mem_per_job_gb:
        # The job budget (mem= / mem_per_job_gb) let this many jobs run at once on that assumption;
        # with every slot this large, a host whose memory is the limit meets the OOM killer.
        print(
            f"warning: {pkg.name}: its largest process used {largest_gb:.1f} GB, more than mem_per_job_gb = "
            f"{pkg.mem_per_job_gb:g} GB, which the job budget counts per job; raise mem_per_job_gb for "
            f"{pkg.name} in the lock (or its profile) to at least {math.ceil(largest_gb)} before a larger "
            f"build runs out of memory",
            flush=True,
        )
    return entry


def _record_units(
    ctx: Context, pkg: Package, key: str, doc: dict[str, object], built: Compiled, stage: Path
) -> list[tuple[float, float]]:
    """Keep what decided each compile unit's object-cache entry (tasks/stages/units.py), for `doit plan`; the
    (start, end) of each unit's run. A record that cannot be made is a line, never a failed build."""
    objects = ctx.objcache()
    if built.object_log is None or objects is None:
        return []
    try:
        return unit_records.record(
            ctx, pkg, key=key, doc=doc, log=built.object_log, stage=stage, seen=built.seen, ccache=objects.ccache
        )
    except Exception as exc:  # (the record is for the next plan; this build is done)
        print(f"note: {pkg.name}: its compile units were not recorded ({exc.__class__.__name__}: {exc})", flush=True)
        return []


def run_build(
    cmd: list[str],
    *,
    env: dict[str, str],
    cwd: Path,
    log: Path,
    pkg: Package,
    progress: Progress | None = None,
    watch: compilers.Watch | None = None,
    runner: Runner = proc.run,
) -> proc.Usage:
    """Run the build command with ``runner``; a full disk and a compiler killed for memory are reported as
    that, not as a compile error."""

    def started(pid: int) -> None:
        for each in (progress, watch):
            if each is not None:
                each.started(pid)

    try:
        return runner(
            cmd,
            env=env,
            cwd=cwd,
            log=log,
            error=BuildError,
            what=f"build of {pkg.name}",
            on_line=progress.feed if progress else None,
            on_start=started,
        )
    except BuildError as exc:
        text = log.read_text(errors="replace")
        if "No space left on device" in text:
            raise BuildError(
                f"build of {pkg.name} ran out of disk space (No space left on device): free space where the cache "
                f"({ctx_cache_hint(log)}) and the build directory are, or point cache=/builddir= at another disk, "
                f"and rerun; nothing partial was kept. Log: {log}"
            ) from None
        line = killed_for_memory(text)
        if line is None:
            raise
        raise BuildError(
            f"build of {pkg.name} ran out of memory: a compiler was killed ({line!r}).\n"
            f"Its jobs need more than mem_per_job_gb = {pkg.mem_per_job_gb:g} GB each: raise mem_per_job_gb for "
            f"{pkg.name} in the lock, or lower jobs= / mem= for this run.\n{exc}"
        ) from None


def ctx_cache_hint(log: Path) -> str:
    """The directories a build's ENOSPC may come from, as its log names them (for the message)."""
    m = re.search(r"-w (\S+)/tmp/", log.read_text(errors="replace"))
    return f"cache={m.group(1)}" if m else "cache="


def ninja_units(tree: Path, build_start: float) -> list[Unit]:
    """Translation units from every ``.ninja_log`` under ``tree``, in ms after ``build_start``.

    A ninja log holds times relative to that ninja's own start; the file's
    mtime (written when ninja finished) anchors them on the wall clock.
    """
    units: list[Unit] = []
    for log in tree.rglob(".ninja_log"):
        found = parse_ninja_log(log.read_text(errors="replace"))
        if not found:
            continue
        offset = round((log.stat().st_mtime - build_start) * 1000) - max(u.end_ms for u in found)
        units.extend(Unit(u.output, u.start_ms + offset, u.end_ms + offset) for u in found)
    return sorted(units, key=lambda u: u.start_ms)
