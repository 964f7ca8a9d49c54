"""Build provenance: one in-toto Statement (v1) with a SLSA Provenance v1 predicate per wheel.

Pure. ``doit wheels`` writes ``wheels/provenance/<wheel>.intoto.json``: the
subject is the wheel (file name and sha256); the predicate names what the
build resolved (every source with its commit or archive sha256 and tree hash,
every patch with its sha256, the toolchain fingerprint), the recipe and the
command that ran. The statements are not signed (no DSSE envelope): sign them
with the key management of the host that publishes the wheelhouse.

:func:`check_statements` is what ``doit verify`` runs: each wheel's statement
must exist, be of the types above and name the wheel with its actual sha256.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.core.digest import canonical_json
from tasks.core.treehash import file_sha256

#: The wheelhouse's CycloneDX SBOM (tasks/stages/attest.py writes it).
SBOM_FILE = "sbom.cdx.json"

if TYPE_CHECKING:  # checking statements (doit verify, also inside an image) needs neither
    from tasks.lock.lockfile import Package, Source

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
#: Our build type: ``externalParameters`` (lock, profile, package) determine the
#: build; ``internalParameters`` hold the action key, the recipe, the
#: reproducibility settings and the command (README, "Provenance").
BUILD_TYPE = "https://reprostack.invalid/build-types/pip-wheel/v1"
BUILDER_ID = "https://reprostack.invalid/builders/doit"
DIRECTORY = "provenance"
SUFFIX = ".intoto.json"


def statement_path(wheel_dir: Path, filename: str) -> Path:
    return wheel_dir / DIRECTORY / f"{filename}{SUFFIX}"


def source_descriptors(src: Source, path: str) -> list[dict[str, Any]]:
    """Resource descriptors of one source (and its submodules) placed at ``path`` in the build tree."""
    from tasks.lock import kinds

    return kinds.of(src.kind).provenance(src, path)


def toolchain_descriptor(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "name": "toolchain",
        "digest": {"sha256": hashlib.sha256(canonical_json(dict(fingerprint))).hexdigest()},
        "annotations": dict(fingerprint),
    }


def statement(
    *,
    filename: str,
    sha256: str,
    pkg: Package,
    key: str,
    key_document: Mapping[str, Any],
    sources: Mapping[str, Source],
    patches: Sequence[tuple[str, str]],
    command: Sequence[str],
    workdir: str,
    lock: str,
    lock_sha256: str,
    profile: str,
    builder_version: str,
) -> dict[str, Any]:
    """The in-toto Statement for the wheel ``filename``.

    ``patches`` holds (path relative to the lock, sha256) in order;
    ``key_document`` is the wheel's action key document (tasks/lock/keys.py).
    """
    deps: list[dict[str, Any]] = []
    for path, name in ((".", pkg.source), *pkg.overlays):
        deps.extend(source_descriptors(sources[name], path))
    deps.extend({"name": path, "digest": {"sha256": digest}} for path, digest in patches)
    deps.append(toolchain_descriptor(key_document["toolchain"]))
    hermetic = key_document.get("hermetic_toolchain")
    if hermetic:  # the pinned wheel set of [toolchain.hermetic] (tasks/env/hermetic.py), each line with its hashes
        deps.append(
            {
                "name": "hermetic-toolchain",
                "digest": {"sha256": hermetic["sha256"]},
                "annotations": {"requirements": list(hermetic["requirements"])},
            }
        )
    return _statement(
        filename,
        sha256,
        {
            "buildType": BUILD_TYPE,
            "externalParameters": {"lock": lock, "lock_sha256": lock_sha256, "profile": profile, "package": pkg.name},
            "internalParameters": {
                "action_key": key,
                "recipe": key_document["recipe"],
                "archs": key_document["archs"],
                "reproducible": key_document.get("reproducible", {}),
                "command": list(command),
                "workdir": workdir,
            },
            "resolvedDependencies": deps,
        },
        builder_version,
    )


def _statement(filename: str, sha256: str, definition: dict[str, Any], builder_version: str) -> dict[str, Any]:
    """The in-toto statement with SLSA provenance of ``filename``, built (or fetched) as ``definition`` says."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": filename, "digest": {"sha256": sha256}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": definition,
            "runDetails": {"builder": {"id": BUILDER_ID, "version": {"reprostack": builder_version}}},
        },
    }


#: Wheels taken as they are (a prebuilt wheel source, the runtime closure): fetched and hash-checked, not built.
FETCH_TYPE = "https://reprostack.invalid/build-types/fetched-wheel/v1"


def fetched_statement(
    *, filename: str, sha256: str, url: str, name: str, lock: str, lock_sha256: str, profile: str, builder_version: str
) -> dict[str, Any]:
    """The statement of a wheel placed as it is: where it came from and the lock pin it was checked against."""
    return _statement(
        filename,
        sha256,
        {
            "buildType": FETCH_TYPE,
            "externalParameters": {"lock": lock, "lock_sha256": lock_sha256, "profile": profile, "package": name},
            "internalParameters": {"checked": "sha256 pinned by the lock"},
            "resolvedDependencies": [{"name": f"wheel:{filename}", "uri": url, "digest": {"sha256": sha256}}],
        },
        builder_version,
    )


def render(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def check_statement(path: Path, wheel: Path) -> str | None:
    """Why the statement at ``path`` does not attest ``wheel`` as it is now; None when it does."""
    if not path.is_file():
        return f"{wheel.name}: no provenance statement ({path.name} missing)"
    try:
        doc = json.loads(path.read_text())
        subjects = doc["subject"]
        types = (doc["_type"], doc["predicateType"])
    except (ValueError, KeyError, TypeError) as exc:
        return f"{wheel.name}: unreadable provenance statement {path.name} ({exc.__class__.__name__}: {exc})"
    if types != (STATEMENT_TYPE, PREDICATE_TYPE):
        return f"{wheel.name}: {path.name} is {types[0]} / {types[1]}, not an in-toto v1 SLSA provenance v1 statement"
    digests = [
        s.get("digest", {}).get("sha256") for s in subjects if isinstance(s, dict) and s.get("name") == wheel.name
    ]
    if not digests:
        return f"{wheel.name}: {path.name} has no subject named {wheel.name}"
    actual = file_sha256(wheel)
    if actual not in digests:
        return f"{wheel.name}: sha256 {actual[:16]}… but its provenance names sha256 {str(digests[0])[:16]}…"
    return None


def check_statements(wheel_dir: Path, filenames: Sequence[str]) -> list[str]:
    """Problems with the provenance of each wheel in ``wheel_dir`` (empty when every statement matches)."""
    problems = []
    for filename in filenames:
        wheel = wheel_dir / filename
        if not wheel.is_file():
            problems.append(f"{filename}: missing")
            continue
        problem = check_statement(statement_path(wheel_dir, filename), wheel)
        if problem:
            problems.append(problem)
    return problems
