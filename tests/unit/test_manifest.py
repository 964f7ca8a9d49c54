"""wheels/manifest.json: written by tasks/store/manifest.py's writer, read back by its readers
(tasks/store/manifest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.core.errors import ReproError
from tasks.core.fsutil import write_atomic
from tasks.store import manifest
from tasks.store.manifest import MANIFEST_FILE, MANIFEST_FORMAT, WheelRecord

RECORDS = (
    WheelRecord(
        package="repro_ext",
        filename="repro_ext-1.0-cp311-cp311-linux_x86_64.whl",
        sha256="a" * 64,
        size=123,
        action_key="k" * 64,
        sources=({"kind": "git", "url": "https://example.invalid/x.git", "commit": "c" * 40},),
        cuda=True,
        verify={"imports": ["repro_ext"], "smoke": "repro_ext"},
    ),
    WheelRecord(
        package="repro_pure",
        filename="repro_pure-0.1-py3-none-any.whl",
        sha256="b" * 64,
        size=45,
        action_key="",
        sources=(),
        origin="prebuilt",
        url="https://example.invalid/repro_pure-0.1-py3-none-any.whl",
        deps=False,
    ),
    WheelRecord(
        package="six",
        filename="six-1.16.0-py2.py3-none-any.whl",
        sha256="d" * 64,
        size=6,
        action_key="",
        sources=(),
        origin="fetched",
        url="https://example.invalid/six.whl",
    ),
)


def _write(wheels: Path, records: tuple[WheelRecord, ...] = RECORDS) -> None:
    """As tasks/stages/wheelhouse.py's ``assemble`` writes it."""
    text = manifest.render(
        records,
        lock="sources.lock",
        lock_sha256="e" * 64,
        profile="default",
        archs=("sm_90a",),
        runtime={"provided": ["torch==2.8.0"], "verify": {"imports": ["json"], "smoke": None}},
    )
    write_atomic(wheels / MANIFEST_FILE, text)


def test_round_trip(tmp_path: Path) -> None:
    _write(tmp_path)
    doc = manifest.read_document(tmp_path)
    assert doc is not None and doc["format"] == MANIFEST_FORMAT
    assert tuple(WheelRecord.from_json(w) for w in doc["wheels"]) == RECORDS
    assert [WheelRecord.from_json(r.to_json()) for r in RECORDS] == list(RECORDS)

    read = manifest.read_manifest(tmp_path)
    assert read is not None and read == manifest.load_manifest(tmp_path)
    assert read.archs == ("sm_90a",)
    assert read.provided == ("torch==2.8.0",)
    assert read.environment is not None and read.environment.imports == ("json",)
    assert [(w.package, w.name, w.version, w.filename, w.sha256, w.cuda, w.origin, w.deps) for w in read.wheels] == [
        (r.package, r.name, r.version, r.filename, r.sha256, r.cuda, r.origin, r.deps) for r in RECORDS
    ]
    (ext, pure, six) = read.wheels
    assert ext.imports == ("repro_ext",) and ext.smoke == "repro_ext"
    assert pure.imports is None and pure.smoke is None
    assert read.ours == (ext, pure) and read.closure == (six,)


def test_a_missing_manifest(tmp_path: Path) -> None:
    assert manifest.read_document(tmp_path) is None
    assert manifest.read_manifest(tmp_path) is None
    with pytest.raises(FileNotFoundError):
        manifest.load_document(tmp_path)
    with pytest.raises(ReproError, match=r"does not exist: build the wheelhouse first \(`doit wheels`\)"):
        manifest.load_manifest(tmp_path)


def test_a_malformed_manifest(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    assert manifest.read_document(tmp_path) is None
    assert manifest.read_manifest(tmp_path) is None
    with pytest.raises(ValueError):
        manifest.load_document(tmp_path)
    with pytest.raises(ReproError, match=r"cannot be read: .*; rebuild it with `doit wheels`"):
        manifest.load_manifest(tmp_path)

    (tmp_path / MANIFEST_FILE).write_text("[]")
    assert manifest.read_document(tmp_path) is None
    assert manifest.load_document(tmp_path) == []
    with pytest.raises(ReproError, match="expected a JSON object; rebuild it with `doit wheels`"):
        manifest.load_manifest(tmp_path)

    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"archs": ["hopper"], "wheels": [{"package": "x"}, 3]}))
    assert manifest.read_manifest(tmp_path) is None
    with pytest.raises(ReproError) as caught:
        manifest.load_manifest(tmp_path)
    message = str(caught.value)
    assert "is invalid:" in message and message.endswith("Rebuild it with `doit wheels`.")
    assert "archs: not a CUDA architecture: 'hopper'" in message  # every problem at once
    assert "wheels[0] (x): missing name, version, filename, sha256" in message
    assert "wheels[1]: must be an object" in message


@pytest.mark.parametrize("given", [None, 0, MANIFEST_FORMAT + 1, "2"])
def test_the_format_is_not_checked(tmp_path: Path, given: object) -> None:
    """Verify reads a manifest of any format (or none) that has the fields, as it always has."""
    _write(tmp_path)
    doc = json.loads((tmp_path / MANIFEST_FILE).read_text())
    want = manifest.parse_manifest(doc)
    if given is None:
        del doc["format"]
    else:
        doc["format"] = given
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(doc))
    assert manifest.read_manifest(tmp_path) == want
    assert manifest.read_document(tmp_path) == doc
