"""SBOM (CycloneDX, checked against its JSON schema) and provenance (in-toto / SLSA) of a wheelhouse."""

from __future__ import annotations

import json
import zipfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from tasks.core.treehash import file_sha256
from tasks.lock.lockfile import Package, Source, Submodule, load_lock
from tasks.stages import provenance, sbom
from tasks.store.manifest import WheelRecord, parse_manifest
from tasks.store.wheelnorm import normalize_wheel
from tasks.verify import checks

C1, C2, C3 = "1" * 40, "2" * 40, "3" * 40
FINGERPRINT = {
    "python": "3.11.7",
    "abi": "cpython-311-x86_64-linux-gnu",
    "platform": "linux-x86_64",
    "torch": "2.11.0+cu130",
    "torch_cuda": "13.0",
    "torch_cxx11_abi": True,
    "cc": "cc (Debian 12.2.0-14+deb12u1) 12.2.0",
    "cxx": "c++ (Debian 12.2.0-14+deb12u1) 12.2.0",
    "cmake": "cmake version 3.25.1",
    "ninja": "1.13.0",
    "nvcc": "Cuda compilation tools, release 13.0, V13.0.88",
    "cudnn": "9.10.2",
}
SOURCES = {
    "te": Source(
        name="te",
        kind="git",
        url="https://github.com/NVIDIA/TransformerEngine.git",
        commit=C1,
        tree_sha256="a" * 64,
        license="Apache-2.0",
        submodules=(
            Submodule(path="3rdparty/cudnn-frontend", url="https://x.invalid/cf.git", commit=C2, license="MIT"),
        ),
    ),
    "hdr": Source(
        name="hdr", kind="url", url="https://x.invalid/h.tar", sha256="b" * 64, tree_sha256="c" * 64, license="MIT"
    ),
    "fa2": Source(
        name="fa2",
        kind="pypi",
        project="flash-attn",
        version="2.7.4.post1",
        filename="flash_attn-2.7.4.post1.tar.gz",
        sha256="d" * 64,
        tree_sha256="e" * 64,
        license="BSD-3-Clause AND MIT",
    ),
}
PACKAGES = (
    Package(
        name="transformer_engine",
        source="te",
        overlays=(("extra/hdr", "hdr"),),
        cuda=True,
        toolchain_extras=("cudnn",),
        patches=("0001-fix.patch",),
    ),
    Package(name="flash_attn", source="fa2", cuda=True),
)
PATCHES = {"transformer_engine": [("patches/transformer_engine/0001-fix.patch", "f" * 64)], "flash_attn": []}


def record(package: str, filename: str, sha256: str) -> WheelRecord:
    return WheelRecord(package=package, filename=filename, sha256=sha256, size=1, action_key="k" * 64, sources=())


RECORDS = [
    record("transformer_engine", "transformer_engine-2.4.0-cp311-cp311-linux_x86_64.whl", "9" * 64),
    record("flash_attn", "flash_attn-2.7.4.post1-cp311-cp311-linux_x86_64.whl", "8" * 64),
]


def make_bom(timestamp: datetime | None = None) -> str:
    bom = sbom.build_bom(
        records=RECORDS,
        packages=PACKAGES,
        sources=SOURCES,
        patches=PATCHES,
        fingerprint=FINGERPRINT,
        nvcc_release="13.0",
        lock="sources.lock",
        lock_sha256="0" * 64,
        profile="default",
        archs=["sm_90a"],
        tool_version="0.1.0",
        timestamp=timestamp,
    )
    return sbom.render(bom)


def test_sbom_is_valid_cyclonedx_and_lists_wheels_sources_patches_toolchain() -> None:
    text = make_bom()
    validator = JsonStrictValidator(SchemaVersion.V1_6)
    assert validator.validate_str(text) is None
    doc = json.loads(text)
    comps = {c["bom-ref"]: c for c in doc["components"]}
    te = comps["wheel:transformer_engine-2.4.0-cp311-cp311-linux_x86_64.whl"]
    assert te["hashes"] == [{"alg": "SHA-256", "content": "9" * 64}]
    assert te["purl"] == f"pkg:pypi/transformer-engine@2.4.0?file_name={RECORDS[0].filename}"
    assert te["pedigree"]["patches"][0]["diff"]["url"] == "patches/transformer_engine/0001-fix.patch"
    git = comps["source:te"]
    assert git["version"] == C1 and git["swhid"] == [f"swh:1:rev:{C1}"]
    assert git["licenses"] == [{"license": {"id": "Apache-2.0", "acknowledgement": "declared"}}]
    assert git["externalReferences"][0]["url"] == "https://github.com/NVIDIA/TransformerEngine.git"
    sub = git["components"][0]
    assert sub["version"] == C2 and sub["licenses"][0]["license"]["id"] == "MIT"
    assert comps["source:hdr"]["hashes"][0]["content"] == "b" * 64
    fa2 = comps["source:fa2"]
    assert fa2["purl"] == "pkg:pypi/flash-attn@2.7.4.post1"
    assert fa2["licenses"] == [{"expression": "BSD-3-Clause AND MIT", "acknowledgement": "declared"}]
    assert comps["patch:patches/transformer_engine/0001-fix.patch"]["hashes"][0]["content"] == "f" * 64
    tools = {c["name"]: c["version"] for c in doc["components"] if c.get("group") == "toolchain"}
    assert tools == {
        "python": "3.11.7",
        "torch": "2.11.0+cu130",
        "nvcc": "13.0",
        "cudnn": "9.10.2",
        "cc": "12.2.0",
        "cxx": "12.2.0",
        "cmake": "3.25.1",
        "ninja": "1.13.0",
    }
    deps = {d["ref"]: set(d.get("dependsOn", [])) for d in doc["dependencies"]}
    assert deps[te["bom-ref"]] >= {"source:te", "source:hdr", "patch:patches/transformer_engine/0001-fix.patch"}
    assert {"toolchain:nvcc", "toolchain:cudnn"} <= deps[te["bom-ref"]]
    assert "toolchain:cudnn" not in deps["wheel:flash_attn-2.7.4.post1-cp311-cp311-linux_x86_64.whl"]


def test_schema_validation_can_fail() -> None:
    doc = json.loads(make_bom())
    doc["components"][0]["hashes"] = [{"alg": "SHA-256", "content": "not hex"}]
    errors = JsonStrictValidator(SchemaVersion.V1_6).validate_str(json.dumps(doc))
    assert errors is not None


def test_sbom_with_source_date_epoch_is_reproducible() -> None:
    when = datetime(2024, 1, 1, tzinfo=UTC)
    first, second = make_bom(when), make_bom(when)
    assert first == second
    assert json.loads(first)["metadata"]["timestamp"].startswith("2024-01-01T00:00:00")
    assert json.loads(make_bom(datetime(2024, 1, 2, tzinfo=UTC)))["serialNumber"] != json.loads(first)["serialNumber"]


def statement_for(filename: str, sha256: str) -> dict[str, Any]:
    pkg = PACKAGES[0]
    return provenance.statement(
        filename=filename,
        sha256=sha256,
        pkg=pkg,
        key="k" * 64,
        key_document={
            "recipe": {"env": {"NVTE_FRAMEWORK": "pytorch"}},
            "archs": ["sm_90a"],
            "toolchain": FINGERPRINT,
            "reproducible": {"format": 1},
        },
        sources=SOURCES,
        patches=PATCHES[pkg.name],
        command=["python", "-m", "pip", "wheel", "/tmp/reprostack-build/transformer_engine"],
        workdir="/tmp/reprostack-build/transformer_engine",
        lock="sources.lock",
        lock_sha256="0" * 64,
        profile="default",
        builder_version="0.1.0",
    )


def test_provenance_statement_names_every_material() -> None:
    doc = statement_for("te.whl", "9" * 64)
    assert doc["_type"] == "https://in-toto.io/Statement/v1"
    assert doc["predicateType"] == "https://slsa.dev/provenance/v1"
    assert doc["subject"] == [{"name": "te.whl", "digest": {"sha256": "9" * 64}}]
    build = doc["predicate"]["buildDefinition"]
    assert build["externalParameters"]["package"] == "transformer_engine"
    assert build["internalParameters"]["command"][-1] == "/tmp/reprostack-build/transformer_engine"
    deps = {d["name"]: d for d in build["resolvedDependencies"]}
    assert deps["source:te"]["digest"] == {"gitCommit": C1}
    assert deps["source:te"]["uri"] == f"git+https://github.com/NVIDIA/TransformerEngine.git@{C1}"
    assert deps["source:te/3rdparty/cudnn-frontend"]["digest"] == {"gitCommit": C2}
    assert deps["source:hdr"]["digest"] == {"sha256": "b" * 64}
    assert deps["source:hdr"]["annotations"]["path"] == "extra/hdr"
    assert deps["patches/transformer_engine/0001-fix.patch"]["digest"] == {"sha256": "f" * 64}
    assert deps["toolchain"]["annotations"]["nvcc"] == FINGERPRINT["nvcc"]
    assert len(deps["toolchain"]["digest"]["sha256"]) == 64


def real_wheel(tmp_path: Path) -> Path:
    raw = tmp_path / "raw.whl"
    with zipfile.ZipFile(raw, "w") as zf:
        zf.writestr("demo/__init__.py", "X = 1\n")
        zf.writestr("demo-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: demo\nVersion: 0.1\n")
        zf.writestr("demo-0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("demo-0.1.dist-info/RECORD", "")
    house = tmp_path / "wheels"
    house.mkdir()
    out = house / "demo-0.1-py3-none-any.whl"
    normalize_wheel(raw, out)
    return out


def test_tampered_wheel_fails_the_provenance_check(tmp_path: Path) -> None:
    whl = real_wheel(tmp_path)
    house = whl.parent
    path = provenance.statement_path(house, whl.name)
    path.parent.mkdir()
    path.write_text(provenance.render(statement_for(whl.name, file_sha256(whl))))
    assert provenance.check_statements(house, [whl.name]) == []
    manifest = parse_manifest(
        {
            "format": 1,
            "archs": ["sm_90a"],
            "wheels": [
                {
                    "package": "demo",
                    "name": "demo",
                    "version": "0.1",
                    "filename": whl.name,
                    "sha256": file_sha256(whl),
                    "cuda": False,
                }
            ],
        }
    )
    assert checks._check_provenance(house, manifest).status == "PASS"

    data = bytearray(whl.read_bytes())
    data[40] ^= 0x01
    whl.write_bytes(bytes(data))
    problems = provenance.check_statements(house, [whl.name])
    assert len(problems) == 1 and problems[0].startswith(f"{whl.name}: sha256 {file_sha256(whl)[:16]}")
    row = checks._check_provenance(house, manifest)
    assert row.status == "FAIL" and "do not install" in row.detail

    path.write_text(json.dumps({"_type": "https://in-toto.io/Statement/v0.1", "subject": [], "predicateType": "x"}))
    assert "not an in-toto v1 SLSA provenance v1 statement" in provenance.check_statements(house, [whl.name])[0]
    path.unlink()
    assert "no provenance statement" in provenance.check_statements(house, [whl.name])[0]


def test_sbom_of_the_real_lock_is_valid() -> None:
    root = Path(__file__).resolve().parents[2]
    lock = load_lock(root / "sources.lock")
    packages = lock.resolve("default")
    records = [record(p.name, f"{p.name}-1.0-cp312-cp312-linux_x86_64.whl", "7" * 64) for p in packages]
    patches = {
        p.name: [(f"patches/{p.name}/{name}", file_sha256(lock.patch_path(p.name, name))) for name in p.patches]
        for p in packages
    }
    bom = sbom.build_bom(
        records=records,
        packages=packages,
        sources=lock.sources,
        patches=patches,
        fingerprint=FINGERPRINT,
        nvcc_release="13.0",
        lock="sources.lock",
        lock_sha256=lock.sha256,
        profile="default",
        archs=lock.toolchain.archs,
        tool_version="0.1.0",
    )
    text = sbom.render(bom)
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text, all_errors=True) is None
    comps = {c["bom-ref"]: c for c in json.loads(text)["components"]}
    te = comps["source:transformer-engine"]
    assert te["licenses"][0]["license"]["id"] == "Apache-2.0"
    assert te["components"][0]["name"] == "transformer-engine/3rdparty/cudnn-frontend"
    assert te["components"][0]["licenses"][0]["license"]["id"] == "MIT"
    assert comps["source:flash-attn-sdist"]["purl"] == "pkg:pypi/flash-attn@2.7.4.post1"
    assert sum(1 for ref in comps if ref.startswith("patch:")) == sum(len(v) for v in patches.values())
