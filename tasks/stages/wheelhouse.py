"""Stage 4: assemble ``wheels/`` from verified cache entries.

``wheels/`` holds the wheels of the current lock and profile only, plus
``manifest.json``, a PEP 503 index under ``simple/``, a hash-pinned
``requirements.txt``, the CycloneDX SBOM ``sbom.cdx.json``, one in-toto
provenance statement per wheel under ``provenance/``, and what a cluster node
checks itself with before installing: ``preflight.py`` (a copy of
tasks/outside/preflight.py, standard library only) and ``preflight.json`` (what the
wheels need: the build's CUDA, torch and glibc, the target archs, the provided
set and what each wheel needs of it). Every file is written atomically; stale wheels go.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packaging.utils import parse_wheel_filename
from packaging.version import Version

from tasks.core.errors import BuildError, LockError, VerificationError
from tasks.core.fsutil import copy_atomic, rmtree, write_atomic
from tasks.core.treehash import file_sha256
from tasks.lock.lockfile import Package
from tasks.stages import provenance
from tasks.stages.context import Context
from tasks.store import manifest, simple_index
from tasks.store.cache import WheelEntry
from tasks.store.manifest import WheelRecord
from tasks.store.simple_index import wheel_project


def expected(ctx: Context) -> dict[str, str]:
    """package -> action key for the current lock and profile."""
    return {pkg.name: ctx.key(pkg)[0] for pkg in ctx.active}


def runtime_section(ctx: Context) -> dict[str, Any] | None:
    """What manifest.json records of the lock's [runtime] (None without one): target, provided set, closure."""
    from tasks.env import closure

    runtime = ctx.runtime
    if runtime is None:
        return None
    target = closure.target_of(runtime)
    pins = sorted(pin.requirement() for pin in runtime.resolved)
    return {
        "python": target.python,
        "platforms": list(target.platforms),
        "provided": [f"{name}=={version}" if version else name for name, version in runtime.provided],
        "closure": hashlib.sha256("\n".join(pins).encode()).hexdigest(),
        "verify": {"imports": list(runtime.verify.imports), "smoke": runtime.verify.smoke},
    }


def is_current(ctx: Context) -> tuple[bool, str]:
    """Whether ``wheels/`` already matches the lock, by keys and file sizes (no hashing)."""
    doc = manifest.read_document(ctx.settings.wheels)
    if doc is None:
        return False, "no manifest"
    if doc.get("lock_sha256") != ctx.lock.sha256 or doc.get("profile") != ctx.settings.profile:
        return False, "lock or profile changed"
    wheels = doc.get("wheels")
    if not isinstance(wheels, list) or not all(
        isinstance(w, dict)
        and all(isinstance(w.get(k), str) for k in ("package", "filename"))
        and "/" not in w["filename"]
        and isinstance(w.get("size"), int)
        for w in wheels
    ):
        return False, "manifest.json is not one this tool writes"
    have = {w["package"]: w.get("action_key") for w in wheels if w.get("origin") != "fetched"}
    if have != expected(ctx):
        return False, "action keys changed"
    for w in wheels:
        p = ctx.settings.wheels / w["filename"]
        if not p.is_file() or p.stat().st_size != w["size"]:
            return False, f"{w['filename']} missing or changed"
    statements = [f"{provenance.DIRECTORY}/{w['filename']}{provenance.SUFFIX}" for w in doc["wheels"]]
    for extra in ("requirements.txt", "simple/index.html", provenance.SBOM_FILE, PREFLIGHT_SPEC, *statements):
        if not (ctx.settings.wheels / extra).is_file():
            return False, f"{extra} missing"
    shipped = ctx.settings.wheels / PREFLIGHT_SCRIPT
    if not shipped.is_file() or shipped.read_bytes() != PREFLIGHT_SOURCE.read_bytes():
        return False, f"{PREFLIGHT_SCRIPT} missing or not this checkout's"
    return True, "up to date"


#: The node's own check (`doit preflight`), shipped in the wheelhouse with what the wheels need.
PREFLIGHT_SCRIPT = "preflight.py"
PREFLIGHT_SPEC = "preflight.json"
PREFLIGHT_SOURCE = Path(__file__).resolve().parents[1] / "outside" / "preflight.py"


def preflight_spec(ctx: Context, records: list[WheelRecord]) -> dict[str, Any]:
    """What the wheels need of a node (read by tasks/outside/preflight.py there): the build's CUDA, torch and glibc,
    the target archs, each wheel (with whether it carries device code, and the provided distributions it needs),
    the provided set."""
    import os
    import platform

    from tasks.env import toolchain
    from tasks.outside import preflight

    built = [pkg for pkg in ctx.active if not pkg.prebuilt]
    info = ctx.toolchain if built else {"python": {}, "tools": {}}
    torch = info["python"].get("torch") or {}
    cuda = ""
    if any(pkg.needs_cuda for pkg in built):
        cuda = toolchain.nvcc_release(info)
    elif any(pkg.needs_torch for pkg in built):
        cuda = torch.get("cuda") or ""
    against_torch = any(pkg.pins_torch for pkg in built)  # torch_unpinned: the lock says any torch will do
    try:
        glibc = info["python"].get("glibc") or os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        glibc = ""
    runtime = runtime_section(ctx)
    cuda_packages = {pkg.name for pkg in ctx.active if pkg.cuda}
    needs, needs_from = _provided_needs(ctx, records)
    return {
        "format": preflight.SPEC_FORMAT,
        "archs": list(ctx.lock.toolchain.archs),
        "build": {
            "cuda": cuda,
            "torch": torch.get("version", "") if against_torch else "",
            "torch_cuda": (torch.get("cuda") or "") if against_torch else "",
            "torch_cxx11_abi": torch.get("cxx11_abi") if against_torch else None,
            "glibc": glibc.split()[-1] if glibc.startswith("glibc") else "",
            "machine": platform.machine(),
        },
        "provided": list(runtime["provided"]) if runtime else [],
        "needs_from": needs_from,
        "wheels": [
            {"filename": r.filename, "package": r.package, "cuda": r.package in cuda_packages, "origin": r.origin,
             "needs": needs.get(r.filename, [])}
            for r in sorted(records, key=lambda r: r.filename)
        ],
    }  # fmt: skip


def _provided_needs(ctx: Context, records: list[WheelRecord]) -> tuple[dict[str, list[str]], str]:
    """filename -> the provided distributions each wheel needs (its Requires-Dist, followed through the provided
    set's own requirements; none for a wheel installed without its dependencies), and where the provided set's
    requirements were read."""
    from tasks.env import closure

    runtime = ctx.runtime
    if runtime is None or not runtime.provided:
        return {}, ""
    base, source = closure.provided_requirements(runtime, ctx.lock.path.parent,
                                                 log=ctx.settings.logs / "wheels-base.log")  # fmt: skip
    requires = {r.filename: closure.requires_dist(ctx.settings.wheels / r.filename) for r in records if r.deps}
    return closure.provided_needs(requires, base, closure.target_of(runtime)), source


def assemble(ctx: Context) -> list[WheelRecord]:
    from filelock import FileLock

    from tasks.engine import timeline
    from tasks.stages import attest
    from tasks.stages.build import build_package

    out = ctx.settings.wheels
    out.mkdir(parents=True, exist_ok=True)
    ctx.settings.builddir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(ctx.settings.builddir / "wheels.lock")):
        records = []
        entries = {pkg.name: build_package(ctx, pkg) for pkg in ctx.active}  # verified by hash; rebuilt when corrupted
        for pkg in ctx.active:  # before anything is written: one wheel per distribution, the package's own
            check_wheel(ctx, pkg, entries[pkg.name])
        fetched = fetch_closure(ctx, entries)  # checks the built wheels' requirements first
        # From here wheels/ changes: without its manifest it reads as incomplete until the manifest is
        # written last, whatever stops this part (a full disk, a signal).
        (out / manifest.MANIFEST_FILE).unlink(missing_ok=True)
        for pkg in ctx.active:
            entry = entries[pkg.name]
            _place(entry.path, entry.size, entry.sha256, out)
            records.append(
                WheelRecord(
                    package=pkg.name,
                    filename=entry.path.name,
                    sha256=entry.sha256,
                    size=entry.size,
                    action_key=entry.key,
                    sources=tuple(ctx.lock.sources[s].pin() for s in pkg.source_names()),
                    cuda=pkg.cuda,
                    verify={
                        "imports": list(pkg.verify.imports),
                        "smoke": pkg.verify.smoke,
                    },
                    origin="prebuilt" if pkg.prebuilt else "built",
                    url=ctx.lock.sources[pkg.source].url if pkg.prebuilt else "",
                    deps=pkg.deps,
                )
            )
        for name, (path, origin) in sorted(fetched.items()):
            sha = path.parent.name
            size = path.stat().st_size
            _place(path, size, sha, out)
            records.append(
                WheelRecord(
                    package=name, filename=path.name, sha256=sha, size=size, action_key="", sources=(),
                    origin="fetched", url=origin,
                )
            )  # fmt: skip
        keep = {r.filename for r in records}
        for stale in out.glob("*.whl"):
            if stale.name not in keep:
                stale.unlink()
        rmtree(out / "simple")
        for rel, content in simple_index.simple_index(records).items():
            write_atomic(out / "simple" / rel, content)
        write_atomic(out / "requirements.txt", simple_index.requirements(records))
        rmtree(out / provenance.DIRECTORY)
        for rel, text in attest.files(ctx, records).items():
            write_atomic(out / rel, text)
        write_atomic(out / PREFLIGHT_SCRIPT, PREFLIGHT_SOURCE.read_text())
        write_atomic(out / PREFLIGHT_SPEC, json.dumps(preflight_spec(ctx, records), indent=2, sort_keys=True) + "\n")
        # The manifest goes last: its presence means the wheelhouse is complete.
        write_atomic(
            out / manifest.MANIFEST_FILE,
            manifest.render(
                records,
                lock=str(ctx.lock.path),
                lock_sha256=ctx.lock.sha256,
                profile=ctx.settings.profile,
                archs=ctx.lock.toolchain.archs,
                runtime=runtime_section(ctx),
            ),
        )
    for pkg in ctx.packages:  # a skipped optional package whose build task was up to date (its line said before)
        if pkg.name not in ctx.outcomes and ctx.skipped(pkg):
            ctx.record(timeline.Outcome(package=pkg.name, status="skipped"))
    timeline.report(ctx.outcomes, [p.name for p in ctx.packages], ctx.settings.builddir / "trace.json", ctx.forecast_s)
    for r in records:
        if r.origin != "fetched":
            print(f"  {r.filename}  sha256:{r.sha256[:16]}…", flush=True)
    closure_count = sum(r.origin == "fetched" for r in records)
    if closure_count:
        closure_mb = sum(r.size for r in records if r.origin == "fetched") / 1e6
        print(f"  + the runtime closure: {closure_count} wheel(s), {closure_mb:.1f} MB", flush=True)
    print(
        f"wheelhouse {out}: {len(records)} wheel(s), manifest.json, requirements.txt, simple/, "
        f"{provenance.SBOM_FILE}, {provenance.DIRECTORY}/, {PREFLIGHT_SCRIPT} (on a node, before installing: "
        f"python3 {out}/{PREFLIGHT_SCRIPT})",
        flush=True,
    )
    return records


def check_wheel(ctx: Context, pkg: Package, entry: WheelEntry) -> None:
    """Refuse ``pkg``'s wheel unless it is of the package's distribution, by its file name and its own METADATA
    (``Name``, and ``Version`` as its file name says; a prebuilt one's, as its pinned file name says)."""
    found = wheel_project(entry.path.name)
    if found != pkg.distribution_name:
        raise BuildError(
            f"package {pkg.name} built {entry.path.name}, a wheel of {found!r}, not of "
            f"{pkg.distribution_name!r}: set `distribution = {found!r}` for it in {ctx.lock.path} (two "
            "packages of one lock may not build one distribution); nothing was written to wheels/"
        )
    version = wheel_version(ctx.lock.sources[pkg.source].filename) if pkg.prebuilt else ""
    problem = simple_index.wheel_problem(entry.path, pkg.distribution_name, version)
    if problem is None:
        return
    if pkg.prebuilt:
        src = ctx.lock.sources[pkg.source]
        raise VerificationError(
            f"package {pkg.name}: the prebuilt wheel of source {src.name} ({src.url}, sha256 {entry.sha256[:12]}…) "
            f"is not a wheel of {pkg.distribution_name} {version}: {problem}; nothing was written to wheels/"
        )
    raise BuildError(
        f"package {pkg.name}: its wheel {entry.path.name} (key {entry.key[:12]}) is not a wheel of "
        f"{pkg.distribution_name}: {problem}; nothing was written to wheels/"
    )


def _place(path: Path, size: int, sha256: str, out: Path) -> None:
    """Copy a verified wheel into ``out`` unless the same file is there; say so when it replaces a changed one."""
    dest = out / path.name
    if dest.is_file() and dest.stat().st_size == size and file_sha256(dest) == sha256:
        return
    if dest.exists():
        print(f"restored {dest} from the cache: it differed from the wheel of its key", flush=True)
    copy_atomic(path, dest)


def fetch_closure(ctx: Context, entries: Mapping[str, WheelEntry]) -> dict[str, tuple[Path, str]]:
    """The runtime closure's wheels in the cache (name -> (file, origin)), after checking that the wheels of
    this lock need nothing the closure, the provided set and each other do not give.

    Errors name the package and the requirement; nothing is written to wheels/ before this returns.
    """
    from tasks.env import closure

    runtime = ctx.runtime
    if runtime is None:
        return {}
    target = closure.target_of(runtime)
    ours = {pkg.distribution_name: pkg for pkg in ctx.active}
    doubled = sorted(ours.keys() & {pin.name for pin in runtime.resolved})
    if doubled:
        raise LockError(
            f"{ctx.lock.path}: [runtime] resolved pins {', '.join(doubled)}, which this lock builds itself; "
            "run `doit lock update=runtime` to resolve the closure around them"
        )
    # The pins stand for their files here, and are made true of them below: closure.fetch refuses a file that is not
    # its pin's project at its version by its own METADATA (a sha256 repointed at another wheel), before wheels/.
    available = {pin.name: pin.version for pin in runtime.resolved}
    available.update(runtime.provided_versions)
    for pkg in ctx.active:
        available[pkg.distribution_name] = wheel_version(entries[pkg.name].path.name)
    problems = []
    for pkg in ctx.active:
        built = wheel_version(entries[pkg.name].path.name)
        base = runtime.provided_versions.get(pkg.distribution_name)
        if base and Version(base) != Version(built):
            problems.append(
                f"package {pkg.name} builds {pkg.distribution_name} {built}, but the target provides {base} "
                f"([runtime] provided): its patches were written for {base}; pin the source at {base}, or change "
                "the provided version to the base's"
            )
        if pkg.deps and pkg.distribution_name not in runtime.provided_versions:  # a patched base package: the
            # base installs what it needs (a rebuilt SGLang's requirements are the base's, not the closure's)
            for req in closure.unmet(closure.requires_dist(entries[pkg.name].path), available, target):
                problems.append(f"package {pkg.name} requires {req}")
    if problems:
        raise LockError(
            f"the runtime closure of {ctx.lock.path} does not cover the wheels it builds:\n  - "
            + "\n  - ".join(problems)
            + "\nRun `doit lock` (it takes the built wheels' requirements into the resolution), or add what is "
            "missing to [runtime] requirements (or provided) first; nothing was written to wheels/."
        )
    found: dict[str, tuple[Path, str]] = {}
    store = ctx.cache.fetched
    for pin in runtime.resolved:
        path = closure.fetch(closure.Pin(pin.name, pin.version, pin.hashes), store, mirror=ctx.settings.mirror,
                             indexes=None, target=target)  # fmt: skip
        origin = (path.parent / "origin").read_text().strip() if (path.parent / "origin").is_file() else ""
        found[pin.name] = (path, origin)
    # The closure covers itself too (a pin lost in an edit of `resolved` would leave a wheel's need unmet).
    for name, (path, _origin) in sorted(found.items()):
        problems += [f"{name} {available[name]} requires {req}" for req in
                     closure.unmet(closure.requires_dist(path), available, target)]  # fmt: skip
    if problems:
        raise LockError(
            f"the runtime closure of {ctx.lock.path} does not cover itself:\n  - " + "\n  - ".join(problems)
            + "\nRun `doit lock update=runtime` to resolve it again; nothing was written to wheels/."
        )  # fmt: skip
    return found


def wheel_version(filename: str) -> str:
    return str(parse_wheel_filename(filename)[1])
