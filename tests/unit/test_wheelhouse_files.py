"""Wheel normalisation, action keys, and the wheelhouse's metadata files."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile
from pathlib import Path

from tasks.core.digest import action_key
from tasks.lock.keys import key_document
from tasks.lock.lockfile import Package, Source
from tasks.stages.patch import failing_hunk
from tasks.store.manifest import WheelRecord
from tasks.store.manifest import render as manifest
from tasks.store.simple_index import requirements, simple_index, wheel_problem
from tasks.store.wheelnorm import normalize_wheel


def write_wheel(path: Path, order: list[str], date: tuple[int, ...]) -> None:
    files = {
        "demo/__init__.py": b"X = 1\n",
        "demo/_ext.so": b"\x7fELF...",
        "demo-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 0.1\n",
        "demo-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\n",
        "demo-0.1.dist-info/RECORD": b"stale\n",
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name in order:
            info = zipfile.ZipInfo(name, date_time=date)  # type: ignore[arg-type]
            info.external_attr = (0o100775 if name.endswith(".so") else 0o100664) << 16
            zf.writestr(info, files[name])


def test_normalised_wheels_are_identical_and_record_is_regenerated(tmp_path: Path) -> None:
    names = [
        "demo-0.1.dist-info/RECORD",
        "demo/_ext.so",
        "demo-0.1.dist-info/METADATA",
        "demo/__init__.py",
        "demo-0.1.dist-info/WHEEL",
    ]
    write_wheel(tmp_path / "a.whl", names, (2024, 5, 1, 10, 0, 0))
    write_wheel(tmp_path / "b.whl", list(reversed(names)), (2025, 1, 2, 3, 4, 6))
    assert (tmp_path / "a.whl").read_bytes() != (tmp_path / "b.whl").read_bytes()
    normalize_wheel(tmp_path / "a.whl", tmp_path / "na.whl", epoch=315532800)
    normalize_wheel(tmp_path / "b.whl", tmp_path / "nb.whl", epoch=315532800)
    assert (tmp_path / "na.whl").read_bytes() == (tmp_path / "nb.whl").read_bytes()
    with zipfile.ZipFile(tmp_path / "na.whl") as zf:
        infos = zf.infolist()
        assert [i.filename for i in infos][-1] == "demo-0.1.dist-info/RECORD"
        assert [i.filename for i in infos][:2] == ["demo/__init__.py", "demo/_ext.so"]
        assert {i.date_time for i in infos} == {(1980, 1, 1, 0, 0, 0)}
        assert infos[1].external_attr >> 16 == 0o100755
        assert infos[0].external_attr >> 16 == 0o100644
        rows = list(csv.reader(io.StringIO(zf.read("demo-0.1.dist-info/RECORD").decode())))
        for name, digest, size in rows[:-1]:
            data = zf.read(name)
            expect = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expect}" and int(size) == len(data)
        assert rows[-1] == ["demo-0.1.dist-info/RECORD", "", ""]


def key_for(**changes: object) -> str:
    src = Source(name="s", kind="git", url="u", commit="a" * 40, tree_sha256="t" * 64)
    args: dict[str, object] = {
        "sources": {"s": src},
        "patches": [("0001.patch", "p" * 64)],
        "toolchain": {"torch": "2.11.0", "nvcc": "13.0"},
        "archs": ["sm_90a"],
        "build_requires": {"setuptools": "80.9.0"},
    }
    pkg = Package(name="p", source="s", env=(("MAX_JOBS", "4"), ("X", "1")))
    if "env" in changes:
        pkg = Package(name="p", source="s", env=changes.pop("env"))  # type: ignore[arg-type]
    args.update(changes)
    return action_key(key_document(pkg, **args))  # type: ignore[arg-type]


def test_action_key_covers_inputs_but_not_job_counts() -> None:
    base = key_for()
    assert key_for(env=(("MAX_JOBS", "64"), ("X", "1"))) == base
    assert key_for(env=(("MAX_JOBS", "4"), ("X", "2"))) != base
    assert key_for(patches=[("0001.patch", "q" * 64)]) != base
    assert key_for(toolchain={"torch": "2.11.0", "nvcc": "13.1"}) != base
    assert key_for(archs=["sm_90a", "sm_100a"]) != base
    assert key_for(build_requires={"setuptools": "81.0.0"}) != base


def test_index_files() -> None:
    rec = WheelRecord(
        package="repro_pure",
        filename="repro_pure-0.1.0-py3-none-any.whl",
        sha256="c" * 64,
        size=10,
        action_key="k" * 64,
        sources=(),
    )
    files = simple_index([rec])
    assert '<a href="repro-pure/">repro-pure</a>' in files["index.html"]
    assert f'href="../../repro_pure-0.1.0-py3-none-any.whl#sha256={"c" * 64}"' in files["repro-pure/index.html"]
    assert f"repro-pure==0.1.0 --hash=sha256:{'c' * 64}" in requirements([rec])
    assert '"action_key": "' + "k" * 64 in manifest(
        [rec], lock="l", lock_sha256="x", profile="default", archs=["sm_90a"]
    )


def test_failing_hunk_is_found_by_start_line() -> None:
    patch = "--- a/setup.py\n+++ b/setup.py\n@@ -1,2 +1,2 @@\n-a\n+b\n@@ -40,3 +40,3 @@ def main():\n-x\n+y\n"
    assert failing_hunk(patch, "setup.py", 40) == "@@ -40,3 +40,3 @@ def main():"
    assert failing_hunk(patch, "other.py", 40) == ""


def test_wheel_problem_reads_the_project_and_version_of_the_wheels_own_metadata(tmp_path: Path) -> None:
    """The one check of what a wheel is (issue 26): its file name, then its METADATA's Name and Version."""

    def wheel(filename: str, metadata: str | None) -> Path:
        path = tmp_path / filename
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("demo/__init__.py", "")
            if metadata is not None:
                zf.writestr("demo-0.1.dist-info/METADATA", metadata)
        return path

    good = wheel("demo-0.1-py3-none-any.whl", "Metadata-Version: 2.1\nName: Demo\nVersion: 0.1.0\n")
    assert wheel_problem(good, "demo") is None and wheel_problem(good, "DEMO", "0.1") is None
    assert wheel_problem(good, "other") == "its file name demo-0.1-py3-none-any.whl is of 'demo', not 'other'"
    assert wheel_problem(good, "demo", "0.2") == "its file name demo-0.1-py3-none-any.whl is of version 0.1, not 0.2"
    other = wheel("demo-0.2-py3-none-any.whl", "Metadata-Version: 2.1\nName: other\nVersion: 0.2\n")
    assert wheel_problem(other, "demo") == "its demo-0.1.dist-info/METADATA names the project 'other', not 'demo'"
    older = wheel("demo-0.3-py3-none-any.whl", "Metadata-Version: 2.1\nName: demo\nVersion: 0.1\n")
    assert wheel_problem(older, "demo", "0.3") == (
        "its demo-0.1.dist-info/METADATA says version 0.1, but its file name demo-0.3-py3-none-any.whl says 0.3"
    )
    assert wheel_problem(wheel("demo-0.4-py3-none-any.whl", None), "demo") == (
        "the wheel holds 0 top-level .dist-info/METADATA files, not one"
    )
    assert wheel_problem(wheel("demo-0.5-py3-none-any.whl", "Name: demo\n"), "demo") == (
        "its demo-0.1.dist-info/METADATA has no Version"
    )
    (tmp_path / "demo.whl").write_bytes(b"")
    assert wheel_problem(tmp_path / "demo.whl", "demo") == "'demo.whl' is not a wheel file name (NAME-VERSION-TAGS.whl)"
