"""Stage 3: build one package's wheel under its action key, or reuse the cached one.

The build runs ``pip wheel --no-build-isolation --no-deps --no-index``
against the current interpreter's toolchain, with the recipe's environment,
in a fresh staged tree. Its full output goes to ``build/logs/build-<pkg>.log``.
The wheel is normalised and stored in the cache atomically; concurrent doit
processes wanting the same key wait on a file lock and then reuse it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tasks import builder, docker, proc
from tasks.cache import WheelEntry, rmtree
from tasks.context import Context
from tasks.errors import BuildError
from tasks.lockfile import Package
from tasks.sources import ensure_source
from tasks.stage import stage_package
from tasks.timeline import Outcome, Progress, Unit, parse_ninja_log
from tasks.wheelnorm import DEFAULT_EPOCH, normalize_wheel

#: Builds cannot reach the network: proxies point at a closed port on loopback.
CLOSED_PROXY = "http://127.0.0.1:9"


def build_env(ctx: Context, pkg: Package, jobs: int) -> dict[str, str]:
    env = dict(os.environ)
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
        trees[name] = ensure_source(
            src,
            cache=ctx.cache,
            mirror=ctx.settings.mirror,
            log=ctx.settings.logs / f"fetch-{name}.log",
        )
    return trees


def build_package(ctx: Context, pkg: Package) -> WheelEntry:
    """The verified cache entry of ``pkg``'s wheel, built now if absent or corrupted."""
    key, doc = ctx.key(pkg)
    entry = ctx.cache.get_wheel(key)
    if entry is not None:
        return entry
    with ctx.cache.lock(f"wheel-{key}"):
        entry = ctx.cache.get_wheel(key)
        if entry is not None:
            return entry
        return _build(ctx, pkg, key, doc)


def _build(ctx: Context, pkg: Package, key: str, doc: dict[str, object]) -> WheelEntry:
    trees = source_trees(ctx, pkg)
    log = ctx.settings.logs / f"build-{pkg.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"# build of {pkg.name}, action key {key}\n# key document: {json.dumps(doc, sort_keys=True)}\n")
    jobs = ctx.jobs_for(pkg)
    stage_dir = (ctx.settings.builddir / "stage" / f"{pkg.name}-{key[:12]}").absolute()
    print(f"build {pkg.name} (key {key[:12]}, {jobs} jobs), log: {log}", flush=True)
    started, wall_start = time.monotonic(), time.time()
    progress = Progress(pkg.name, lambda line: print(line, flush=True))
    build_dir = stage_package(pkg, trees=trees, patches=ctx.patches(pkg), dest=stage_dir, log=log)
    try:
        with ctx.cache.staging(f"out-{pkg.name}") as out:
            raw = out / "raw"
            cmd = [
                sys.executable,
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
                str(raw),
                *pkg.pip_args,
                str(build_dir),
            ]
            env, cwd = build_env(ctx, pkg, jobs), build_dir
            if ctx.builder is not None:  # the toolchain is the builder image: tasks/builder.py
                env = builder.build_env(ctx.recipe_env(pkg), pkg.jobs_env, jobs)
                mounts = {stage_dir: builder.SRC_MOUNT, out: builder.OUT_MOUNT}
                cmd = builder.container_command(ctx.builder, cmd, mounts=mounts, workdir=build_dir, env=env)
                env, cwd = docker.client_env(), stage_dir
            usage = proc.run(
                cmd,
                env=env,
                cwd=cwd,
                log=log,
                error=BuildError,
                what=f"build of {pkg.name}",
                on_line=progress.feed,
            )
            wheels = sorted(raw.glob("*.whl"))
            if len(wheels) != 1:
                raise BuildError(f"build of {pkg.name} produced {len(wheels)} wheels, expected one; see {log}")
            norm = out / wheels[0].name
            normalize_wheel(wheels[0], norm, epoch=DEFAULT_EPOCH)
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
                },
            )
        ctx.record(
            Outcome(
                package=pkg.name,
                status="built",
                start=wall_start,
                wall_s=seconds,
                cpu_s=usage.cpu_seconds,
                max_rss_mb=usage.max_rss_mb,
                units=ninja_units(stage_dir, wall_start),
            )
        )
    finally:
        if os.environ.get("REPRO_KEEP_STAGE", "") in ("", "0"):
            rmtree(stage_dir)
    print(
        f"built {pkg.name} in {seconds:.1f}s (CPU {usage.cpu_seconds:.0f}s, largest process "
        f"{usage.max_rss_mb:.0f} MB): {entry.path.name}",
        flush=True,
    )
    return entry


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
