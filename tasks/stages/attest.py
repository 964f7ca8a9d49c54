"""The wheelhouse's attestations: the SBOM and one provenance statement per wheel.

Gathers what :mod:`tasks.stages.sbom` and :mod:`tasks.stages.provenance` need from the run's
context (lock, action key documents, toolchain) and returns the files to
write, relative to ``wheels/``.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Sequence
from datetime import UTC, datetime

from tasks.env import reproducible, toolchain
from tasks.lock.lockfile import Package
from tasks.stages import provenance
from tasks.stages.build import wheel_command
from tasks.stages.context import Context
from tasks.store.manifest import WheelRecord

#: Stands for the build's output directory in the recorded command.
OUT_PLACEHOLDER = "<wheel output directory>"
#: The SBOM, beside manifest.json.
SBOM_FILE = provenance.SBOM_FILE


def tool_version() -> str:
    try:
        return importlib.metadata.version("reprostack")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def source_date() -> datetime | None:
    raw = os.environ.get("SOURCE_DATE_EPOCH", "")
    return datetime.fromtimestamp(int(raw), tz=UTC) if raw.isdigit() else None


def patch_files(ctx: Context, pkg: Package) -> list[tuple[str, str]]:
    """(path relative to the lock's directory, sha256) of each patch of ``pkg``, in order."""
    if pkg.prebuilt:
        return []
    _key, doc = ctx.key(pkg)
    digests = [p["sha256"] for p in doc["patches"]]
    paths = [
        os.path.relpath(patch.path, ctx.lock.path.parent) if isinstance(entry, str) else patch.name
        for entry, patch in zip(pkg.patches, ctx.patches(pkg), strict=True)
    ]
    return list(zip(paths, digests, strict=True))


def files(ctx: Context, records: Sequence[WheelRecord]) -> dict[str, str]:
    """``wheels/``-relative path -> content of the SBOM and the provenance statements."""
    from tasks.stages import sbom

    active = ctx.active
    by_name = {p.name: p for p in active}
    patches = {pkg.name: patch_files(ctx, pkg) for pkg in active}
    out: dict[str, str] = {}
    for rec in records:
        if rec.origin != "built":
            fetched = provenance.fetched_statement(
                filename=rec.filename,
                sha256=rec.sha256,
                url=rec.url,
                name=rec.package,
                lock=str(ctx.lock.path),
                lock_sha256=ctx.lock.sha256,
                profile=ctx.settings.profile,
                builder_version=tool_version(),
            )
            out[f"{provenance.DIRECTORY}/{rec.filename}{provenance.SUFFIX}"] = provenance.render(fetched)
            continue
        pkg = by_name[rec.package]
        key, doc = ctx.key(pkg)
        workdir = str(reproducible.canonical_dir(pkg.name) / pkg.subdir)
        statement = provenance.statement(
            filename=rec.filename,
            sha256=rec.sha256,
            pkg=pkg,
            key=key,
            key_document=doc,
            sources=ctx.lock.sources,
            patches=patches[pkg.name],
            command=wheel_command(pkg, OUT_PLACEHOLDER, workdir, python="python"),
            workdir=workdir,
            lock=str(ctx.lock.path),
            lock_sha256=ctx.lock.sha256,
            profile=ctx.settings.profile,
            builder_version=tool_version(),
        )
        out[f"{provenance.DIRECTORY}/{rec.filename}{provenance.SUFFIX}"] = provenance.render(statement)
    used = {name for pkg in active for name in (*pkg.source_names(), *pkg.patch_sources())}
    extras = sorted({e for pkg in active for e in pkg.toolchain_extras})
    # A wheelhouse of prebuilt and fetched wheels only needs no toolchain, so none is probed for it.
    info = ctx.toolchain if any(not p.prebuilt for p in active) else None
    bom = sbom.build_bom(
        records=records,
        packages=active,
        sources={name: src for name, src in ctx.lock.sources.items() if name in used},
        patches=patches,
        fingerprint=toolchain.description(info, extras=extras, cuda=any(p.needs_cuda for p in active)) if info else {},
        nvcc_release=toolchain.nvcc_release(info) if info else "",
        lock=str(ctx.lock.path),
        lock_sha256=ctx.lock.sha256,
        profile=ctx.settings.profile,
        archs=ctx.lock.toolchain.archs,
        tool_version=tool_version(),
        timestamp=source_date(),
    )
    out[SBOM_FILE] = sbom.render(bom)
    return out
