"""Stage 4: assemble ``wheels/`` from verified cache entries.

``wheels/`` holds the wheels of the current lock and profile only, plus
``manifest.json``, a PEP 503 index under ``simple/``, a hash-pinned
``requirements.txt``, the CycloneDX SBOM ``sbom.cdx.json`` and one in-toto
provenance statement per wheel under ``provenance/``. Every file is written
atomically; stale wheels go.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from filelock import FileLock

from tasks import attest, index, provenance, timeline
from tasks.build import build_package
from tasks.cache import rmtree, write_atomic
from tasks.context import Context
from tasks.errors import BuildError
from tasks.index import wheel_project
from tasks.treehash import file_sha256


def expected(ctx: Context) -> dict[str, str]:
    """package -> action key for the current lock and profile."""
    return {pkg.name: ctx.key(pkg)[0] for pkg in ctx.active}


def read_manifest(wheels: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads((wheels / "manifest.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def is_current(ctx: Context) -> tuple[bool, str]:
    """Whether ``wheels/`` already matches the lock, by keys and file sizes (no hashing)."""
    doc = read_manifest(ctx.settings.wheels)
    if doc is None:
        return False, "no manifest"
    if doc.get("lock_sha256") != ctx.lock.sha256 or doc.get("profile") != ctx.settings.profile:
        return False, "lock or profile changed"
    have = {w["package"]: w["action_key"] for w in doc.get("wheels", [])}
    if have != expected(ctx):
        return False, "action keys changed"
    for w in doc["wheels"]:
        p = ctx.settings.wheels / w["filename"]
        if not p.is_file() or p.stat().st_size != w["size"]:
            return False, f"{w['filename']} missing or changed"
    statements = [f"{provenance.DIRECTORY}/{w['filename']}{provenance.SUFFIX}" for w in doc["wheels"]]
    for extra in ("requirements.txt", "simple/index.html", attest.SBOM_FILE, *statements):
        if not (ctx.settings.wheels / extra).is_file():
            return False, f"{extra} missing"
    return True, "up to date"


def assemble(ctx: Context) -> list[index.WheelRecord]:
    out = ctx.settings.wheels
    out.mkdir(parents=True, exist_ok=True)
    ctx.settings.builddir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(ctx.settings.builddir / "wheels.lock")):
        records = []
        entries = {pkg.name: build_package(ctx, pkg) for pkg in ctx.active}  # verified by hash; rebuilt when corrupted
        for pkg in ctx.active:  # before anything is written: one wheel per distribution, the package's own
            found = wheel_project(entries[pkg.name].path.name)
            if found != pkg.distribution_name:
                raise BuildError(
                    f"package {pkg.name} built {entries[pkg.name].path.name}, a wheel of {found!r}, not of "
                    f"{pkg.distribution_name!r}: set `distribution = {found!r}` for it in {ctx.lock.path} (two "
                    "packages of one lock may not build one distribution); nothing was written to wheels/"
                )
        for pkg in ctx.active:
            entry = entries[pkg.name]
            dest = out / entry.path.name
            if not (dest.is_file() and dest.stat().st_size == entry.size and file_sha256(dest) == entry.sha256):
                if dest.exists():
                    print(f"restored {dest} from the cache: it differed from the wheel built for its key", flush=True)
                tmp = dest.with_name(f".{dest.name}.tmp")
                shutil.copyfile(entry.path, tmp)
                os.chmod(tmp, 0o644)
                os.replace(tmp, dest)
            records.append(
                index.WheelRecord(
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
                )
            )
        keep = {r.filename for r in records}
        for stale in out.glob("*.whl"):
            if stale.name not in keep:
                stale.unlink()
        rmtree(out / "simple")
        for rel, content in index.simple_index(records).items():
            write_atomic(out / "simple" / rel, content)
        write_atomic(out / "requirements.txt", index.requirements(records))
        rmtree(out / provenance.DIRECTORY)
        for rel, text in attest.files(ctx, records).items():
            write_atomic(out / rel, text)
        # The manifest goes last: its presence means the wheelhouse is complete.
        write_atomic(
            out / "manifest.json",
            index.manifest(
                records,
                lock=str(ctx.lock.path),
                lock_sha256=ctx.lock.sha256,
                profile=ctx.settings.profile,
                archs=ctx.lock.toolchain.archs,
            ),
        )
    timeline.report(ctx.outcomes, [p.name for p in ctx.packages], ctx.settings.builddir / "trace.json")
    for r in records:
        print(f"  {r.filename}  sha256:{r.sha256[:16]}…", flush=True)
    print(
        f"wheelhouse {out}: {len(records)} wheel(s), manifest.json, requirements.txt, simple/, "
        f"{attest.SBOM_FILE}, {provenance.DIRECTORY}/",
        flush=True,
    )
    return records
