"""The doit task graph: thin declarations over the stage modules.

    lock            resolve refs and fill in hashes (the only task that writes the lock)
    fetch:<source>  source into the verified source cache
    mirror          export the cached sources (hermetic toolchain wheels, the tool's own) to mirror=DIR, offline use
    stage:<pkg>     a patched tree under build/stage/ for inspection
    build:<pkg>     the package's wheel into the wheel cache, under its action key
    wheels          wheels/ from the cache: wheels, manifest, simple/ index, requirements, SBOM, provenance
    verify          install the wheelhouse into a scratch venv and check it
    repro           rebuild packages in a second directory and compare the wheels bit for bit
    image           the runtime image: pinned base + wheelhouse, tagged <name>:<key12>
    verify_image    doit verify inside a container of the image
    export          the image as a docker-archive and an OCI layout, with sha256s
    bundle          one file for an air-gapped site: wheelhouse, SBOM, image, mirror, SHA256SUMS
    unbundle        verify a bundle and unpack it (refuses an altered one)
    plan            what `doit wheels` would do, why, and how long (writes nothing)
    hints           the lock's unit hints (patches/<pkg>/unit-*.json) from this cache's records, for review
    preflight       the target node checks itself against what the wheels need, before installing

Task creators only read the parsed lock; nothing here touches the network,
git or a compiler while doit loads or lists tasks.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from doit.reporter import ConsoleReporter

from tasks.cli.failures import environment_error as environment_error
from tasks.cli.failures import guarded
from tasks.core import replay
from tasks.core.errors import BundleError, FetchError, LockError, ReproError
from tasks.core.fsutil import rmtree
from tasks.lock import kinds
from tasks.lock.schema import format_problems
from tasks.stages.context import Context

TaskDict = dict[str, Any]

#: What the line of a skipped optional package adds where nvcc is what it lacks.
SKIP_HINT_NVCC = " (or nvcc from PyPI wheels: [toolchain.hermetic], docs/lock.md)"

#: Every task prints straight to the console, uncaptured. doit's capture swaps
#: the process-wide sys.stdout for a per-action writer over a StringIO; with
#: tasks in threads (the default here) two actions then write into one
#: StringIO at once, which crashed doit with a segfault in about one run of
#: five of the remote-cache tests. Each build's full output is in its own log.
CONSOLE: dict[str, Any] = {"verbosity": 2, "io": {"capture": False}}


@functools.cache
def context() -> Context:
    from tasks.core.proc import install_interrupt_handler

    install_interrupt_handler()
    try:
        return Context.load()
    except ReproError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None


def claim_workspace() -> None:
    """Take this workspace for the run before doit opens its state database (tasks/core/workspace.py)."""
    from tasks.core import workspace
    from tasks.core.settings import load_settings

    if only_plan(sys.argv[1:]):
        return  # reads only: it may run beside a build
    try:
        settings = load_settings()
    except ReproError:
        return  # the run reports it (context())
    try:
        note = workspace.claim(settings.builddir, sys.argv[1:])
    except ReproError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    if note:
        print(note, file=sys.stderr, flush=True)
    if workspace.current is not None:  # a run that may write the cache: what killed runs left there goes
        from tasks.store.cache import Cache

        with contextlib.suppress(OSError):  # a cache that cannot be read yet: the run says why
            removed = Cache(settings.cache).sweep()
            if removed:
                print(
                    f"removed {removed} temporary tree(s) that interrupted runs left in the cache {settings.cache}",
                    file=sys.stderr,
                    flush=True,
                )


def _require_pins() -> None:
    ctx = context()
    unpinned = ctx.lock.unpinned_for(ctx.settings.profile)
    if unpinned:
        raise LockError(format_problems(ctx.lock.path, list(unpinned)) + "\nRun `doit lock` first.")


# --------------------------------------------------------------------------- uptodate checks


class SourceCached:
    """Up to date when the verified tree is in the source cache (no rehashing)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __call__(self, task: Any, values: Any) -> bool:
        ctx = context()
        src = ctx.lock.sources[self.source]
        if kinds.of(src.kind).wheel:
            return bool(src.sha256) and (ctx.cache.root / "fetched" / src.sha256).is_dir()
        return bool(src.tree_sha256) and ctx.cache.has_source(src.tree_sha256)

    def __repr__(self) -> str:
        return f"SourceCached({self.source!r}: tree_sha256 present in the source cache)"


class WheelCached:
    """Up to date when the wheel cache holds an entry for the package's current action key.

    Only the local cache counts: the remote (remote=) is asked by the action, so
    that `doit list` and `doit info` never touch the network. With
    remote_write=on it is never up to date: the action then makes sure the
    remote has the cached wheel too.
    """

    def __init__(self, package: str) -> None:
        self.package = package

    def __call__(self, task: Any, values: Any) -> bool:
        ctx = context()
        if ctx.settings.remote_write:
            return False
        try:
            _require_pins()
            pkg = ctx.package(self.package)
            why = ctx.skipped(pkg)
            if why:
                # An optional package this host cannot build: nothing to do once its action has said why (a
                # no-op then neither runs it nor imports the build); a new reason runs it to say that one.
                from tasks.core import notices

                return notices.said(ctx.settings.builddir, _skip_key(ctx, pkg.name)) == _skip_line(ctx, pkg.name, why)
            key, _ = ctx.key(pkg)
        except ReproError:
            return False  # the action reports the problem
        return ctx.cache.wheel_exists(key)

    def __repr__(self) -> str:
        return (
            f"WheelCached({self.package!r}: wheel cache has an entry for the current action key, "
            "and remote_write is off)"
        )


class WheelhouseCurrent:
    """Up to date when wheels/manifest.json lists the current keys and the files are there (and remote_write is off)."""

    def __call__(self, task: Any, values: Any) -> bool:
        ctx = context()
        if ctx.settings.remote_write:
            return False  # the action uploads what the remote lacks
        try:
            _require_pins()
            from tasks.stages.wheelhouse import is_current

            return is_current(ctx)[0]
        except ReproError:
            return False

    def __repr__(self) -> str:
        return "WheelhouseCurrent(wheels/manifest.json matches the lock, profile and action keys; remote_write is off)"


# --------------------------------------------------------------------------- actions


@guarded
def _do_lock() -> None:
    from tasks.cli.lockcmd import lock_build, lock_hermetic, lock_runtime, lock_sources
    from tasks.cli.oci import lock_image_digests, split_update
    from tasks.lock.lockfile import load_lock

    ctx = context()
    sources_update, images_update = split_update(ctx.settings.update)
    # The hermetic pins first: a lock whose sources are complete must then validate as a whole.
    for line in lock_hermetic(ctx.settings.lock, ctx.cache, update=sources_update):
        print(f"  {line}", flush=True)
    sources_update = tuple(u for u in sources_update if u != "hermetic")
    for line in lock_sources(
        ctx.settings.lock, ctx.cache, mirror=ctx.settings.mirror, logs=ctx.settings.logs, update=sources_update
    ):
        print(f"  {line}", flush=True)
    for line in lock_runtime(
        ctx.settings.lock, ctx.cache, wheels=ctx.settings.wheels, logs=ctx.settings.logs, update=sources_update
    ):
        print(f"  {line}", flush=True)
    for line in lock_build(ctx.settings.lock, logs=ctx.settings.logs, update=sources_update):
        print(f"  {line}", flush=True)
    for line in lock_image_digests(ctx.settings.lock, images_update):
        print(f"  {line}", flush=True)
    still = load_lock(ctx.settings.lock, require_pins=False).unpinned
    print(f"wrote {ctx.settings.lock}" + (f"; {len(still)} pin(s) still open:" if still else ""), flush=True)
    for line in still:
        print(f"  open: {line}", flush=True)


@guarded
def _do_fetch(name: str) -> None:
    from tasks.lock.fetch import ensure_source, ensure_wheel

    _require_pins()
    ctx = context()
    src = ctx.lock.sources[name]
    if kinds.of(src.kind).wheel:
        ensure_wheel(src, cache=ctx.cache, mirror=ctx.settings.mirror)
        return
    try:
        ensure_source(src, cache=ctx.cache, mirror=ctx.settings.mirror, log=ctx.settings.logs / f"fetch-{name}.log")
    except FetchError as exc:
        raise FetchError(f"source {name}: {exc.message}") from exc  # sources of one unreachable host: said once


@guarded
def _do_mirror() -> None:
    _require_pins()
    ctx = context()
    mirror = ctx.settings.mirror
    if mirror is None:
        raise ReproError("doit mirror needs a destination: doit mirror mirror=DIR (or REPRO_MIRROR=DIR)")
    from tasks.image.offline import write_mirror

    for line in write_mirror(ctx, mirror, source=mirror):  # what the mirror already holds is kept
        print(line, flush=True)
    from tasks.image.offline import tool_wheels

    for line in tool_wheels(ctx, mirror / "tool"):  # the tool itself, for a build host without network
        print(f"  {line}", flush=True)
    print(f"mirror written to {mirror}", flush=True)


@guarded
def _do_stage(name: str) -> None:
    from tasks.stages.build import source_trees
    from tasks.stages.patch import stage_package

    _require_pins()
    ctx = context()
    pkg = ctx.package(name)
    dest = (ctx.settings.builddir / "stage" / pkg.name).absolute()
    stage_package(
        pkg,
        trees=source_trees(ctx, pkg),
        patches=ctx.patches(pkg),
        dest=dest,
        log=ctx.settings.logs / f"stage-{name}.log",
    )
    print(f"staged {name} at {dest}", flush=True)


@guarded
def _do_build(name: str) -> None:
    from tasks.stages.build import build_package

    _require_pins()
    ctx = context()
    pkg = ctx.package(name)
    why = ctx.skipped(pkg)
    from tasks.core import notices

    if why:
        from tasks.engine.timeline import Outcome

        ctx.record(Outcome(package=name, status="skipped"))
        # Said once, and again when the reason changes: a no-op run does not repeat it (tasks/core/notices.py),
        # and does not run this action once it was said (WheelCached).
        notices.say_once(ctx.settings.builddir, _skip_key(ctx, name), _skip_line(ctx, name, why))
        return
    notices.forget(ctx.settings.builddir, _skip_key(ctx, name))
    build_package(ctx, pkg)
    _report_asked_builds(ctx)


def _skip_key(ctx: Context, name: str) -> str:
    return f"skipped:{ctx.lock.path.name}:{name}"


def _skip_line(ctx: Context, name: str, why: str) -> str:
    """What a run says of optional package ``name`` left out for ``why``."""
    hint = SKIP_HINT_NVCC if "nvcc not found" in why else ""
    return f"skipped {name} (optional in {ctx.lock.path.name}): {why}{hint}"


def _report_asked_builds(ctx: Context) -> None:
    """Where the command line names ``build:`` tasks (``doit build:flash_attn``), the summary and the build
    timeline of those packages, as ``doit wheels`` gives them for its own: each build task that ends
    reports the asked packages that have ended so far, so the last one reports them all."""
    from tasks.core.startup import requested_tasks
    from tasks.engine import timeline

    asked = [t.removeprefix("build:") for t in sorted(requested_tasks(sys.argv[1:])) if t.startswith("build:")]
    ended = [n for n in asked if n in ctx.outcomes]
    if ended:
        timeline.report(ctx.outcomes, ended, ctx.settings.builddir / "trace.json")


@guarded
def _do_wheels() -> None:
    from tasks.stages.wheelhouse import assemble

    _require_pins()
    assemble(context())


@guarded
def _do_shard(names: list[str]) -> None:
    from tasks.engine import timeline
    from tasks.stages.build import build_package

    _require_pins()
    ctx = context()
    shard = ctx.settings.shard
    assert shard is not None
    for name in names:
        if ctx.skipped(ctx.package(name)):
            print(f"  {name}: skipped (see above)", flush=True)
            continue
        entry = build_package(ctx, ctx.package(name))  # cached, restored or built by build:<name>
        print(f"  {name}: {entry.path.name}", flush=True)
    timeline.report(ctx.outcomes, names, ctx.settings.builddir / "trace.json")
    where = f"; uploaded to {ctx.settings.remote}" if ctx.settings.remote_write else ""
    print(
        f"shard {shard[0]}/{shard[1]}: {len(names)} of {len(ctx.packages)} package(s) in the wheel cache{where}; "
        "wheels/ is not assembled by a shard (run `doit wheels remote=...` without shard= once all shards ran)",
        flush=True,
    )


@guarded
def _do_verify() -> None:
    from tasks.verify.checks import run_verify

    ctx = context()
    run_verify(
        wheel_dir=ctx.settings.wheels,
        work_dir=ctx.settings.builddir / "verify",
        gpu=ctx.settings.gpu,
        isolated=ctx.settings.isolated,
        train=ctx.settings.train,
        log_dir=ctx.settings.logs,
    )


@guarded
def _do_repro() -> None:
    from tasks.verify.repro import run_repro

    _require_pins()
    ctx = context()
    run_repro(ctx, ctx.settings.pkgs)


@guarded
def _do_image() -> None:
    from tasks.image.image import build_image

    build_image(context())


@guarded
def _do_verify_image() -> None:
    from tasks.verify.image import verify_in_image

    verify_in_image(context())


@guarded
def _do_export() -> None:
    from tasks.image.export import export_image

    export_image(context())


@guarded
def _do_bundle() -> None:
    from tasks.image.offline import make_bundle

    _require_pins()
    for line in make_bundle(context()):
        print(line, flush=True)


@guarded
def _do_unbundle() -> None:
    from tasks.core.settings import load_settings
    from tasks.image.bundle import unpack

    st = load_settings()  # no lock: the air-gapped host unbundles before it has one (tasks/cli/dodo.py)
    if st.bundle is None:
        raise BundleError("doit unbundle needs the bundle file: doit unbundle bundle=FILE dest=DIR")
    doc = unpack(st.bundle, st.dest)
    print(f"verified {doc['verified_files']} files of {st.bundle} and unpacked them to {st.dest}", flush=True)
    print(f"  parts: {', '.join(doc['parts'])}; lock sha256 {doc['lock_sha256']}, profile {doc['profile']}", flush=True)
    print(
        f"  install: pip install --no-index --find-links {st.dest}/wheels --require-hashes "
        f"-r {st.dest}/wheels/requirements.txt",
        flush=True,
    )


def _clean_wheels() -> None:
    rmtree(context().settings.wheels)


# --------------------------------------------------------------------------- task creators


def task_lock() -> TaskDict:
    """Resolve refs to commits and fill in hashes in the lock file (update=NAMES|hermetic|all re-resolves)."""
    return {"actions": [_do_lock], "uptodate": [False], **CONSOLE}


def task_fetch() -> Iterator[TaskDict]:
    """Download and verify every source into the source cache."""
    ctx = context()
    for name in ctx.lock.sources:
        yield {
            "name": name,
            "actions": [(_do_fetch, [name])],
            "uptodate": [SourceCached(name)],
            **CONSOLE,
            "doc": f"fetch and verify source {name}",
        }


def task_mirror() -> TaskDict:
    """Export the profile's sources, hermetic toolchain, runtime closure and the tool's wheels to mirror=DIR."""
    ctx = context()
    return {
        "actions": [_do_mirror],
        "task_dep": [f"fetch:{n}" for n in ctx.lock.sources_for(ctx.settings.profile)],
        "uptodate": [False],
        **CONSOLE,
    }


def task_stage() -> Iterator[TaskDict]:
    """Stage a package's patched tree under build/stage/<pkg> for inspection."""
    ctx = context()
    for pkg in ctx.packages:
        yield {
            "name": pkg.name,
            "actions": [(_do_stage, [pkg.name])],
            "task_dep": [f"fetch:{s}" for s in (*pkg.source_names(), *pkg.patch_sources())],
            "uptodate": [False],
            **CONSOLE,
            "doc": f"stage patched sources of {pkg.name}",
        }


def task_build() -> Iterator[TaskDict]:
    """Build each package's wheel into the wheel cache (reused while its action key is unchanged)."""
    ctx = context()
    for pkg in ctx.packages:
        yield {
            "name": pkg.name,
            "actions": [(_do_build, [pkg.name])],
            "task_dep": [f"fetch:{s}" for s in (*pkg.source_names(), *pkg.patch_sources())],
            "uptodate": [WheelCached(pkg.name)],
            **CONSOLE,
            "doc": f"build the wheel of {pkg.name}",
        }


def task_wheels() -> TaskDict:
    """Assemble wheels/: the lock's wheels, manifest.json, simple/ index, requirements.txt (shard=i/N: a share)."""
    ctx = context()
    if ctx.settings.shard is not None:
        from tasks.engine.admission import shard_packages
        from tasks.store.history import package_weights

        weights = package_weights(ctx.lock.patches_dir, [p.name for p in ctx.packages], ctx.settings.profile)
        names = shard_packages([p.name for p in ctx.packages], ctx.settings.shard, weights)
        return {
            "actions": [(_do_shard, [names])],
            "task_dep": [f"build:{n}" for n in names],
            "uptodate": [False],
            **CONSOLE,
        }
    return {
        "actions": [_do_wheels],
        "task_dep": [f"build:{p.name}" for p in ctx.packages],
        "uptodate": [WheelhouseCurrent()],
        "clean": [_clean_wheels],
        **CONSOLE,
    }


def _same_wheelhouse(task: str) -> None:
    """`doit verify` (repro, bundle) asked without `wheels`, where wheels/ holds what `doit wheels` made for
    another profile or lock than this run's: its dependency on `wheels` would first rebuild wheels/ for
    this run's profile (for a real lock's default profile, hours of compiles and fetches), replacing the
    wheelhouse the user meant to check. Refused before anything runs, naming the command for each intent."""
    from tasks.core.startup import requested_tasks
    from tasks.store import manifest

    asked = requested_tasks(sys.argv[1:])
    if task not in asked or "wheels" in asked:
        return
    ctx = context()
    doc = manifest.read_document(ctx.settings.wheels)
    if doc is None or not isinstance(doc.get("profile"), str) or not isinstance(doc.get("lock"), str):
        return
    profile, lock = doc["profile"], Path(doc["lock"])
    if profile == ctx.settings.profile and lock.name == ctx.lock.path.name:  # (a wheelhouse from another checkout too)
        return
    print(
        f"error: {ctx.settings.wheels}/ holds profile '{profile}' of {lock.name}, and this run's is profile "
        f"'{ctx.settings.profile}' of {ctx.lock.path.name}: `doit {task}` would first rebuild {ctx.settings.wheels}/ "
        f"for it. To {task} what is there, give the variables it was built with: `doit {task} profile={profile}` "
        f"(lock=, mirror= as for that build); to build this run's profile and then {task} it: "
        f"`doit wheels {task} profile={ctx.settings.profile}`.",
        file=sys.stderr,
    )
    raise SystemExit(ReproError.exit_code)


def task_verify() -> TaskDict:
    """Install the wheelhouse into a scratch venv and check imports, linkage, archs, GPU smoke tests."""
    _same_wheelhouse("verify")
    return {"actions": [_do_verify], "task_dep": ["wheels"], "uptodate": [False], **CONSOLE}


def task_repro() -> TaskDict:
    """Rebuild packages (pkgs=a,b; default all) in a second directory and compare with wheels/ bit for bit."""
    _same_wheelhouse("repro")
    return {"actions": [_do_repro], "task_dep": ["wheels"], "uptodate": [False], **CONSOLE}


class Deferred:
    """An up-to-date check whose module is imported only when doit asks it (`doit wheels` never does):
    ``Deferred("tasks.image.image", "ImageCurrent")`` is ``tasks.image.image.ImageCurrent(context())``."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def check(self) -> Callable[[Any, Any], bool]:
        import importlib

        made: Callable[[Any, Any], bool] = getattr(importlib.import_module(self.module), self.name)(context())
        return made

    def __call__(self, task: Any, values: Any) -> bool:
        return self.check()(task, values)

    def __repr__(self) -> str:
        return repr(self.check())


def task_image() -> TaskDict:
    """Build the runtime image: the lock's pinned base plus the wheelhouse, installed offline."""
    return {
        "actions": [_do_image],
        "task_dep": ["wheels"],
        "uptodate": [Deferred("tasks.image.image", "ImageCurrent")],
        **CONSOLE,
    }


def task_verify_image() -> TaskDict:
    """Run doit verify inside a container of the runtime image (--gpus all where a GPU is usable)."""
    return {"actions": [_do_verify_image], "task_dep": ["image"], "uptodate": [False], **CONSOLE}


def task_export() -> TaskDict:
    """Write the runtime image as a docker-archive and an OCI layout, with their sha256s (export=DIR)."""
    return {
        "actions": [_do_export],
        "task_dep": ["image"],
        "uptodate": [Deferred("tasks.image.export", "ExportCurrent")],
        **CONSOLE,
    }


def task_bundle() -> TaskDict:
    """Write one file for an air-gapped site: wheelhouse, SBOM, SHA256SUMS (+ bundle_image, bundle_mirror)."""
    _same_wheelhouse("bundle")
    settings = context().settings
    deps = ["wheels", *(["export"] if settings.bundle_image else [])]
    return {"actions": [_do_bundle], "task_dep": deps, "uptodate": [False], **CONSOLE}


def task_unbundle() -> TaskDict:
    """Verify a bundle (bundle=FILE) against its SHA256SUMS and unpack it to dest=DIR; an altered bundle is refused."""
    return {"actions": [_do_unbundle], "uptodate": [False], **CONSOLE}


# --------------------------------------------------------------------------- doit plan


def only_plan(argv: list[str]) -> bool:
    """Whether doit's command line runs the ``plan`` task and nothing else (it takes no workspace lock)."""
    from tasks.core.startup import requested_tasks

    return requested_tasks(argv) == {"plan"}


@guarded
def _do_plan() -> None:
    import json

    from tasks.cli import plan

    _require_pins()
    ctx = context()
    made = plan.make_plan(ctx)
    if ctx.settings.format == "json":
        print(json.dumps(plan.to_json(made), indent=1, sort_keys=True), flush=True)
    else:
        print(plan.render_text(made), flush=True)


@guarded
def _do_hints() -> None:
    from tasks.engine.forecast import recorded_units
    from tasks.store import history
    from tasks.verify.repro import select

    ctx = context()
    profile = ctx.settings.profile
    written = []
    for pkg in select(ctx.packages, ctx.settings.pkgs):
        times, memory = recorded_units(ctx.cache.root, pkg.name)
        if not times:
            print(f"  {pkg.name}: no compile unit recorded in this cache", flush=True)
            continue
        try:
            files = history.write_hints(ctx.lock.patches_dir / pkg.name, profile, times, memory)
        except ValueError as exc:
            raise ReproError(f"doit hints: {exc}; name the profile with letters, digits, '.', '_' and '-'") from None
        except OSError as exc:
            raise ReproError(f"doit hints: cannot write {pkg.name}'s hints ({exc})") from None
        timed = sum(1 for found in memory.values() if "peak_for_s" in found)
        where = ", ".join(str(f) for f in files)
        print(f"  {pkg.name}: {len(times)} units, {len(memory)} with their memory ({timed} with their peak timed): "
              f"{where}", flush=True)  # fmt: skip
        written.append(pkg.name)
    if not written:
        raise ReproError(
            f"doit hints: no package of profile {profile} has compile units recorded in the cache "
            f"{ctx.cache.root}: build them first (doit wheels profile={profile})"
        )
    print(f"wrote the hints of {', '.join(written)} for profile {profile}: review them with the lock "
          "(git diff), then commit them", flush=True)  # fmt: skip


def task_hints() -> TaskDict:
    """Write the lock's unit hints (patches/<pkg>/unit-*.json) from this cache's records (pkgs=a,b; default all)."""
    return {"actions": [_do_hints], "uptodate": [False], **CONSOLE}


def task_plan() -> TaskDict:
    """Say what `doit wheels` would do for each package, which inputs of its key changed, and how long (format=json)."""
    return {"actions": [_do_plan], "uptodate": [False], "verbosity": 2, "io": {"capture": False}}


class Reporter(ConsoleReporter):  # type: ignore[misc]  # doit has no type hints
    """doit's console reporter, without the ``.  plan`` title when ``doit plan format=json`` prints its
    document: stdout is then the JSON alone.

    It also measures what a `doit wheels` took besides its tasks' actions (start-up, the lock, the keys,
    doit's checks: a no-op's time, which `doit plan` forecasts a no-op by) and keeps it in the cache's
    build history (tasks/store/noop.py, ``timings/noop.json``)."""

    def initialize(self, tasks: Any, selected_tasks: Any) -> None:
        super().initialize(tasks, selected_tasks)
        self._selected = list(selected_tasks or ())
        self._running = 0
        self._since = 0.0
        self._busy = 0.0  # seconds in which some task's actions ran (doit runs tasks in threads: their union)

    def execute_task(self, task: Any) -> None:
        replay.spoil()  # a task runs: not a no-op to replay (tasks/core/replay.py)
        self._running = getattr(self, "_running", 0) + 1
        if self._running == 1:
            self._since = time.monotonic()
        if task.name == "plan" and context().settings.format == "json":
            return
        super().execute_task(task)

    def _ended(self) -> None:
        running = getattr(self, "_running", 0)
        if running > 0:
            self._running = running - 1
            if self._running == 0:
                self._busy += time.monotonic() - self._since

    def add_success(self, task: Any) -> None:
        self._ended()
        super().add_success(task)

    def add_failure(self, task: Any, fail: Any) -> None:
        self._ended()
        super().add_failure(task, fail)

    def complete_run(self) -> None:
        super().complete_run()
        if "wheels" not in getattr(self, "_selected", ()) or self.failures or self.runtime_errors:
            replay.spoil()
            return
        from tasks.core.procfs import process_seconds
        from tasks.store import noop
        from tasks.store.manifest import MANIFEST_FILE

        # Where this run traced its reads and ran no task: the no-op's record (tasks/core/replay.py), before the
        # no-op's time is kept, which reads what it replaces and changes nothing a no-op prints (another
        # workspace's no-op of the same lock in the same cache rewrites it).
        ctx = context()
        replay.finish(str(ctx.settings.lock), str(ctx.settings.wheels / MANIFEST_FILE))
        noop.record(ctx.cache.root, ctx.lock.sha256, ctx.settings.profile, process_seconds() - self._busy)


@guarded
def _do_preflight(python: str, report: str, strict: bool) -> None:
    """The wheelhouse's own check (wheels/preflight.py, the same code as tasks/outside/preflight.py) on this node."""
    from tasks.core.errors import PreflightFailed
    from tasks.outside import preflight

    ctx = context()
    out = Path(report) if report else ctx.settings.builddir / "preflight" / "report.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    args = ["--wheels", str(ctx.settings.wheels), "--json", str(out), "--gpu", ctx.settings.gpu]
    status = preflight.main([*args, *(["--python", python] if python else []), *(["--strict"] if strict else [])])
    if status == preflight.EXIT_UNREADABLE:
        raise ReproError(
            f"{ctx.settings.wheels} cannot be read as a wheelhouse (the line above says why): run `doit wheels` "
            "(or unpack a bundle)"
        )
    if status != preflight.EXIT_OK:
        raise PreflightFailed(
            f"this node cannot take the wheels in {ctx.settings.wheels}: see the FAIL lines above (report: {out}); "
            "fix the node (driver, GPU allocation, interpreter, torch), or build the wheels for it"
        )


def task_preflight() -> TaskDict:
    """Check this node (driver, GPUs, glibc, Python, torch, provided set) against wheels/ before installing."""
    return {
        "actions": [_do_preflight],
        "params": [
            {"name": "python", "long": "python", "default": "", "help": "the interpreter the wheels go into"},
            {"name": "report", "long": "report", "default": "", "help": "the JSON report's path"},
            {
                "name": "strict",
                "long": "strict",
                "type": bool,
                "default": False,
                "help": "every provided distribution at its captured version, not only those the wheels need",
            },
        ],
        "uptodate": [False],
        **CONSOLE,
    }
