"""``doit repro``: rebuild packages elsewhere, later, and prove the wheels are bit-for-bit the same.

Each chosen package is staged again from the verified sources into a second,
differently named directory (``build/repro/<pkg>-rebuild`` instead of
``build/stage/<pkg>-<key>``), built again with the same recipe, bypassing the
wheel cache, and its normalised wheel compared by sha256 with the one in
``wheels/``. Where they differ, the rebuilt wheel is kept under
``build/repro/wheels/`` and the report says which members differ and how
(sizes, hashes, ELF sections, strings only one side has, a diff of text
files), plus diffoscope's full report where diffoscope is installed.

The rebuilds run at once, as many as ``doit wheels`` builds (:data:`AT_ONCE`),
in threads of the one task: their compilers take the run's job tokens and
memory room through the same broker and gate as the builds of ``doit
wheels`` (tasks/engine/jobserver.py), at their packages' priorities, so a repro of
the stack costs about one cold build, not the sum of its packages'. Each
rebuild logs to ``build/logs/repro-<pkg>.log`` and has its own heartbeat.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tasks.core import proc
from tasks.core.console import warn
from tasks.core.errors import ReproError, ReproMismatch
from tasks.core.fsutil import rmtree, write_atomic
from tasks.core.treehash import file_sha256
from tasks.engine.timeline import Progress
from tasks.lock.lockfile import Package
from tasks.stages.build import compile_wheel
from tasks.stages.context import Context
from tasks.stages.wheelhouse import is_current
from tasks.store.manifest import read_document
from tasks.verify.wheeldiff import compare_wheels

#: How many packages ``doit repro`` rebuilds at once: as many as ``doit wheels`` builds, doit's
#: ``num_process`` (tasks/cli/dodo.py). Their compilers share the run's job budget either way.
AT_ONCE = 8


@dataclass(frozen=True, kw_only=True)
class Result:
    package: str
    filename: str
    built: str  # the wheel in wheels/
    built_sha256: str
    rebuilt_sha256: str
    rebuilt_filename: str
    seconds: float
    differences: str = ""
    kept: str = ""  # the rebuilt wheel, kept when it differs
    diffoscope: str = ""  # diffoscope's text report, when diffoscope ran

    @property
    def identical(self) -> bool:
        return self.built_sha256 == self.rebuilt_sha256 and self.filename == self.rebuilt_filename

    def render(self) -> list[str]:
        status = "identical" if self.identical else "DIFFERENT"
        lines = [f"{self.package:<20} {status:<10} {self.filename}  sha256 {self.built_sha256[:16]}…"]
        if self.identical:
            return lines
        lines.append(f"    built:   sha256 {self.built_sha256}  {self.built}")
        lines.append(f"    rebuilt: sha256 {self.rebuilt_sha256}  {self.kept}")
        lines.extend(f"    {line}" for line in self.differences.splitlines())
        if self.diffoscope:
            lines.append(f"    diffoscope: {self.diffoscope}")
        return lines


@dataclass(frozen=True, kw_only=True)
class Report:
    results: tuple[Result, ...]
    wheels: str
    directory: str

    @property
    def ok(self) -> bool:
        return all(r.identical for r in self.results)

    def summary(self) -> str:
        same = sum(r.identical for r in self.results)
        return f"{same} of {len(self.results)} wheel(s) identical"

    def render(self) -> str:
        lines = [f"doit repro: rebuilt in {self.directory}/<pkg>-rebuild and compared with {self.wheels}/"]
        for result in self.results:
            lines.extend(result.render())
        lines.append(self.summary())
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        doc = {
            "ok": self.ok,
            "wheels": self.wheels,
            "results": [dict(asdict(r), identical=r.identical) for r in self.results],
        }
        return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def select(packages: Sequence[Package], names: Sequence[str]) -> list[Package]:
    """The packages named (all when none is), in lock order; unknown names are an error."""
    known = {p.name: p for p in packages}
    unknown = [n for n in names if n not in known]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
            hints.append(f"{name!r}" + (f" (perhaps you meant {close[0]!r}?)" if close else ""))
        raise ReproError(
            f"pkgs=: unknown package(s) {', '.join(hints)}; packages of this lock and profile: {', '.join(known)}"
        )
    chosen = set(names)
    return [p for p in packages if not chosen or p.name in chosen]


def diffoscope(built: Path, rebuilt: Path, dest: Path, log: Path) -> Path | None:
    """diffoscope's text report of two wheels at ``dest``, where diffoscope is installed."""
    if shutil.which("diffoscope") is None:
        return None
    # diffoscope exits 1 when it found differences: that is its result, not a failure.
    script = 'diffoscope --text "$1" "$2" "$3"; test $? -le 1'
    try:
        proc.run(
            ["sh", "-c", script, "diffoscope", str(dest), str(built), str(rebuilt)],
            env=dict(os.environ),
            log=log,
            error=ReproError,
            what="diffoscope",
        )
    except ReproError as exc:
        warn(f"diffoscope could not compare the wheels, the built-in comparison stands: {exc}")
        return None
    return dest


def rebuild(ctx: Context, pkg: Package, filename: str, directory: Path) -> Result:
    """Build ``pkg`` again under ``directory`` and compare it with ``wheels/<filename>``."""
    built = ctx.settings.wheels / filename
    stage = directory / f"{pkg.name}-rebuild"
    log = ctx.settings.logs / f"repro-{pkg.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"# rebuild of {pkg.name} for doit repro, compared with {built}\n")
    print(f"rebuild {pkg.name} in {stage}, log: {log}", flush=True)
    started = time.monotonic()
    progress = Progress(pkg.name, lambda line: print(line, flush=True))
    with ctx.cache.staging(f"repro-{pkg.name}") as out, progress:
        try:
            # The object cache stays out: a hit would hand back the first build's objects.
            wheel = compile_wheel(
                ctx,
                pkg,
                stage_dir=stage,
                out=out,
                log=log,
                jobs=ctx.jobs_for(pkg),
                progress=progress,
                object_cache=False,
            ).wheel
        finally:
            if os.environ.get("REPRO_KEEP_STAGE", "") in ("", "0"):
                rmtree(stage)
        result = Result(
            package=pkg.name,
            filename=filename,
            built=str(built),
            built_sha256=file_sha256(built),
            rebuilt_sha256=file_sha256(wheel),
            rebuilt_filename=wheel.name,
            seconds=round(time.monotonic() - started, 1),
        )
        if result.identical:
            return result
        kept = directory / "wheels" / wheel.name
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(wheel, kept)
    if wheel.name != filename:
        differences = f"the rebuild is named {wheel.name}, not {filename}"
    else:
        differences = compare_wheels(built, kept).render()
    report = diffoscope(built, kept, directory / f"{pkg.name}.diffoscope.txt", log)
    return replace(result, differences=differences, kept=str(kept), diffoscope=str(report or ""))


def rebuild_all(
    ctx: Context, chosen: Sequence[Package], filenames: dict[str, str], directory: Path
) -> tuple[Result, ...]:
    """Rebuild ``chosen`` at once (at most :data:`AT_ONCE`, started in lock order) and return their results in
    lock order.

    Their compilers share the run's job budget, priorities and memory admission (compile_wheel opens each
    package's session with the run's broker), as ``doit wheels``'s builds do. As doit does with failed
    build tasks, the first failure starts no further rebuild (a line says so at once), lets the running ones
    end, and is raised (the others' in a line each). On Ctrl-C the interrupt handler (tasks/core/proc.py) stops
    every rebuild's process group, and each ends with its "interrupted" error.
    """
    if not chosen:
        return ()
    results: dict[str, Result] = {}
    failures: list[tuple[str, BaseException]] = []
    pool = ThreadPoolExecutor(max_workers=min(AT_ONCE, len(chosen)), thread_name_prefix="repro")
    try:
        futures: dict[Future[Result], str] = {
            pool.submit(rebuild, ctx, pkg, filenames[pkg.name], directory): pkg.name for pkg in chosen
        }
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                name = futures[future]
                exc = future.exception()
                if exc is None:
                    result = results[name] = future.result()
                    status = "identical" if result.identical else "DIFFERENT"
                    print(f"rebuilt {name} in {result.seconds:.1f}s: {status}", flush=True)
                    continue
                failures.append((name, exc))
                pending = {f for f in pending if not f.cancel()}  # start no other rebuild
                line = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
                if len(failures) > 1:  # the first is raised in full below
                    print(f"doit repro: the rebuild of {name} failed too: {line}", file=sys.stderr, flush=True)
                elif pending:
                    print(
                        f"doit repro: the rebuild of {name} failed: {line}; waiting for the {len(pending)} running "
                        "rebuild(s) to end",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    if failures:
        raise failures[0][1]
    return tuple(results[pkg.name] for pkg in chosen)


def run_repro(ctx: Context, names: Sequence[str] = ()) -> Report:
    """Rebuild the chosen packages and compare; raise :class:`ReproMismatch` when any wheel differs."""
    wheels = ctx.settings.wheels
    current, why = is_current(ctx)
    if not current:
        raise ReproError(
            f"{wheels}/ does not match the lock ({why}); run `doit wheels` first, doit repro compares with it"
        )
    doc = read_document(wheels)
    assert doc is not None  # is_current read it
    filenames = {w["package"]: w["filename"] for w in doc["wheels"]}
    chosen = select(ctx.active, names)
    directory = (ctx.settings.builddir / "repro").absolute()
    rmtree(directory)
    directory.mkdir(parents=True)
    results = rebuild_all(ctx, chosen, filenames, directory)
    report = Report(results=results, wheels=str(wheels), directory=str(directory))
    write_atomic(directory / "report.txt", report.render())
    write_atomic(directory / "report.json", report.to_json())
    print(report.render(), end="", flush=True)
    if not report.ok:
        differ = ", ".join(r.package for r in results if not r.identical)
        raise ReproMismatch(
            f"doit repro: {report.summary()}; not reproducible: {differ}.\n"
            f"Report: {directory / 'report.txt'} (and report.json); rebuilt wheels: {directory / 'wheels'}/.\n"
            "Find what differs in the report (a timestamp, a build path, a temporary file name, an order), "
            "remove it with a flag, an environment variable or a patch in the lock, then rerun "
            "`doit wheels` and `doit repro`."
        )
    return report
