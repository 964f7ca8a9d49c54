"""The wheelhouse's software bill of materials: one CycloneDX 1.6 JSON document.

Pure (cyclonedx-python-lib builds and serialises the document). ``doit wheels``
writes it to ``wheels/sbom.cdx.json`` (see tasks/stages/attest.py). Components:

- every wheel (purl ``pkg:pypi/...``, sha256, action key), with our patches in
  its pedigree;
- every source it was built from: git sources with URL, commit and SWHID,
  archives and sdists with URL or project, and sha256; the kept tree's hash;
  the license the lock declares (SPDX); submodules as nested components;
- every patch (a file component with its sha256);
- the toolchain: Python, torch, nvcc, the C/C++ compilers, cmake, ninja,
  cuDNN, as the action key's fingerprint records them.

Each wheel depends on its sources, patches and toolchain. With
``SOURCE_DATE_EPOCH`` set the timestamp comes from it, and the serial number
is derived from the content, so the document is reproducible too.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from cyclonedx import spdx
from cyclonedx.model import (
    ExternalReference,
    ExternalReferenceType,
    HashAlgorithm,
    HashType,
    Property,
    XsUri,
)
from cyclonedx.model.bom import Bom, BomMetaData
from cyclonedx.model.component import Component, ComponentType, Diff, Patch, PatchClassification, Pedigree, Swhid
from cyclonedx.model.license import DisjunctiveLicense, LicenseAcknowledgement, LicenseExpression
from cyclonedx.model.tool import ToolRepository
from cyclonedx.output.json import JsonV1Dot6
from packageurl import PackageURL
from packaging.utils import canonicalize_name

from tasks.lock import kinds
from tasks.lock.kinds import BomEntry
from tasks.lock.lockfile import Package, Source
from tasks.store.manifest import WheelRecord

PROP = "reprostack"  # namespace of our properties (reprostack:tree_sha256, ...)


def _sha256(digest: str) -> list[HashType]:
    return [HashType(alg=HashAlgorithm.SHA_256, content=digest)] if digest else []


def licenses(value: str) -> list[DisjunctiveLicense | LicenseExpression]:
    """The lock's SPDX id or expression as CycloneDX license choices (declared by the upstream)."""
    if not value:
        return []
    if spdx.is_supported_id(value):
        return [DisjunctiveLicense(id=value, acknowledgement=LicenseAcknowledgement.DECLARED)]
    return [LicenseExpression(value, acknowledgement=LicenseAcknowledgement.DECLARED)]


#: The external references a source's SBOM entry names (tasks/lock/kinds.py BomEntry.links).
LINKS = {"vcs": ExternalReferenceType.VCS, "distribution": ExternalReferenceType.DISTRIBUTION}


def source_component(src: Source) -> Component:
    """The component of one source, as its kind describes it (tasks/lock/kinds.py)."""
    return _component(kinds.of(src.kind).sbom(src))


def _component(entry: BomEntry) -> Component:
    return Component(
        type=ComponentType.LIBRARY,
        name=entry.name,
        version=entry.version,
        bom_ref=entry.ref,
        licenses=licenses(entry.license),
        hashes=_sha256(entry.sha256),
        purl=PackageURL(
            type=entry.purl_type,
            name=entry.purl_name,
            version=entry.purl_version,
            qualifiers=dict(entry.purl_qualifiers) or None,
        ),
        external_references=[ExternalReference(type=LINKS[kind], url=XsUri(url)) for kind, url in entry.links],
        swhids=[Swhid(entry.swhid)] if entry.swhid else [],
        properties=[Property(name=f"{PROP}:{name}", value=value) for name, value in entry.properties],
        components=[_component(part) for part in entry.parts],
    )


def toolchain_components(fingerprint: Mapping[str, Any], nvcc_release: str) -> dict[str, Component]:
    """Toolchain key in the fingerprint -> component (absent tools are left out)."""
    found: dict[str, tuple[str, str, str]] = {
        "python": ("python", str(fingerprint.get("python", "")), str(fingerprint.get("abi", ""))),
        "torch": ("torch", str(fingerprint.get("torch", "")), f"CUDA {fingerprint.get('torch_cuda') or 'none'}"),
        "nvcc": ("nvcc", nvcc_release, str(fingerprint.get("nvcc", ""))),
        "cudnn": ("cudnn", str(fingerprint.get("cudnn", "")), ""),
    }
    for tool in ("cc", "cxx", "cmake", "ninja"):
        line = str(fingerprint.get(tool, ""))
        numbers = re.findall(r"\d+(?:\.\d+)+", line)
        found[tool] = (tool, numbers[-1] if numbers else "", line)
    out = {}
    for key, (name, version, description) in found.items():
        if key not in fingerprint or not version:
            continue
        out[key] = Component(
            type=ComponentType.APPLICATION,
            group="toolchain",
            name=name,
            version=version,
            description=description or None,
            bom_ref=f"toolchain:{name}",
        )
    return out


def _patch_components(patches: Mapping[str, Sequence[tuple[str, str]]]) -> dict[str, Component]:
    out = {}
    for items in patches.values():
        for path, digest in items:
            out[path] = Component(type=ComponentType.FILE, name=path, bom_ref=f"patch:{path}", hashes=_sha256(digest))
    return out


def build_bom(
    *,
    records: Sequence[WheelRecord],
    packages: Iterable[Package],
    sources: Mapping[str, Source],
    patches: Mapping[str, Sequence[tuple[str, str]]],
    fingerprint: Mapping[str, Any],
    nvcc_release: str,
    lock: str,
    lock_sha256: str,
    profile: str,
    archs: Sequence[str],
    tool_version: str,
    timestamp: datetime | None = None,
) -> Bom:
    """The SBOM of a wheelhouse. ``patches``: package -> (path relative to the lock, sha256) in order."""
    by_name = {p.name: p for p in packages}
    source_comps = {name: source_component(src) for name, src in sorted(sources.items())}
    patch_comps = _patch_components(patches)
    tools = toolchain_components(fingerprint, nvcc_release)
    house = Component(
        type=ComponentType.APPLICATION,
        name="wheelhouse",
        version=f"{profile}@{lock_sha256[:12]}",
        bom_ref="wheelhouse",
        properties=[
            Property(name=f"{PROP}:lock", value=lock),
            Property(name=f"{PROP}:lock_sha256", value=lock_sha256),
            Property(name=f"{PROP}:profile", value=profile),
            Property(name=f"{PROP}:archs", value=" ".join(archs)),
        ],
    )
    reprostack = Component(type=ComponentType.APPLICATION, name="reprostack", version=tool_version)
    wheels = []
    for rec in sorted(records, key=lambda r: r.package):
        if rec.origin == "fetched":
            wheels.append(_fetched_component(rec))
            continue
        pkg_patches = patches.get(rec.package, ())
        pedigree = None
        if pkg_patches:
            pedigree = Pedigree(
                patches=[
                    Patch(type=PatchClassification.UNOFFICIAL, diff=Diff(url=XsUri(path))) for path, _ in pkg_patches
                ]
            )
        wheels.append(
            Component(
                type=ComponentType.LIBRARY,
                name=rec.name,
                version=rec.version,
                bom_ref=f"wheel:{rec.filename}",
                hashes=_sha256(rec.sha256),
                purl=PackageURL(
                    type="pypi",
                    name=str(canonicalize_name(rec.name)),
                    version=rec.version,
                    qualifiers={"file_name": rec.filename},
                ),
                pedigree=pedigree,
                properties=[
                    Property(name=f"{PROP}:package", value=rec.package),
                    Property(name=f"{PROP}:origin", value=rec.origin),
                    Property(name=f"{PROP}:action_key", value=rec.action_key),
                    Property(name=f"{PROP}:cuda", value=str(rec.cuda).lower()),
                ],
            )
        )
    bom = Bom(
        components=[*wheels, *source_comps.values(), *patch_comps.values(), *tools.values()],
        metadata=BomMetaData(
            component=house,
            tools=ToolRepository(components=[reprostack]),
            timestamp=timestamp,
            properties=[Property(name=f"{PROP}:generator", value="doit wheels")],
        ),
    )
    for rec, wheel in zip(sorted(records, key=lambda r: r.package), wheels, strict=True):
        if rec.origin == "fetched":
            continue
        pkg = by_name[rec.package]
        if pkg.prebuilt:
            bom.register_dependency(wheel, [source_comps[pkg.source]])
            continue
        deps = [source_comps[name] for name in (*pkg.source_names(), *pkg.patch_sources())]
        deps += [patch_comps[path] for path, _ in patches.get(rec.package, ())]
        wanted = ["python", "torch", "cc", "cxx", "cmake", "ninja"]
        if pkg.cuda:
            wanted.append("nvcc")
        if "cudnn" in pkg.toolchain_extras:
            wanted.append("cudnn")
        deps += [tools[t] for t in wanted if t in tools]
        bom.register_dependency(wheel, deps)
    for comp in source_comps.values():
        if comp.components:
            bom.register_dependency(comp, list(comp.components))
    bom.register_dependency(house, wheels)
    if timestamp is not None:
        # Same content, same time: the same serial number (the whole document is reproducible).
        digest = hashlib.sha256(render(bom, serial=False).encode()).hexdigest()
        bom.serial_number = uuid.uuid5(uuid.NAMESPACE_URL, f"urn:reprostack:sbom:{digest}")
    return bom


def _fetched_component(rec: WheelRecord) -> Component:
    """A wheel of the runtime closure: fetched from its index as it is, checked against the lock's sha256."""
    return Component(
        type=ComponentType.LIBRARY,
        name=rec.name,
        version=rec.version,
        bom_ref=f"wheel:{rec.filename}",
        hashes=_sha256(rec.sha256),
        purl=PackageURL(
            type="pypi",
            name=str(canonicalize_name(rec.name)),
            version=rec.version,
            qualifiers={"file_name": rec.filename},
        ),
        external_references=[ExternalReference(type=ExternalReferenceType.DISTRIBUTION, url=XsUri(rec.url))]
        if rec.url
        else [],
        properties=[
            Property(name=f"{PROP}:origin", value="fetched"),
            Property(name=f"{PROP}:package", value=rec.package),
        ],
    )


def render(bom: Bom, *, serial: bool = True) -> str:
    """The document as CycloneDX 1.6 JSON (``serial=False`` leaves the serial number out, for hashing)."""
    text = JsonV1Dot6(bom).output_as_string(indent=2)
    if not serial:
        text = re.sub(r'\n\s*"serialNumber": "[^"]*",?', "", text)
    return text + "\n"
