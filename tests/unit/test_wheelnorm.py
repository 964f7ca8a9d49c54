"""Wheel normalisation: the Requires-Dist lines the build stage adds, with RECORD kept right and bytes stable."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))

from fake_wheels import make_wheel

from tasks.store.wheelnorm import add_requirements, normalize_wheel


def _record_ok(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        record = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(zf.read(record).decode())))
        assert sorted(r[0] for r in rows) == sorted(zf.namelist())
        for path, digest, size in rows:
            if path == record:
                continue
            data = zf.read(path)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert int(size) == len(data)


def test_the_build_torch_goes_into_metadata_with_record_hashes_right_and_bytes_stable(tmp_path: Path) -> None:
    src = make_wheel(tmp_path / "raw", "ext", "0.1.0", "cp312-cp312-linux_x86_64", {"ext/__init__.py": b"x = 1\n"})
    first, second, plain = tmp_path / "a" / src.name, tmp_path / "b" / src.name, tmp_path / "c" / src.name
    for out in (first, second, plain):
        out.parent.mkdir()
    normalize_wheel(src, first, requires=["torch==2.11.0+cu130"])
    normalize_wheel(src, second, requires=["torch==2.11.0+cu130"])
    normalize_wheel(src, plain)
    assert first.read_bytes() == second.read_bytes()  # bit-reproducible
    assert first.read_bytes() != plain.read_bytes()
    _record_ok(first)
    with zipfile.ZipFile(first) as zf:
        meta = zf.read("ext-0.1.0.dist-info/METADATA").decode()
    assert meta.splitlines()[-1] == "Requires-Dist: torch==2.11.0+cu130"
    again = tmp_path / "d" / src.name
    again.parent.mkdir()
    normalize_wheel(first, again, requires=["torch==2.11.0+cu130"])  # normalising twice changes nothing
    assert again.read_bytes() == first.read_bytes()


def test_requirements_go_at_the_end_of_the_header_not_into_the_description() -> None:
    meta = b"Metadata-Version: 2.1\nName: x\nVersion: 1\nRequires-Dist: numpy\n\nA description\n\nwith lines\n"
    out = add_requirements(meta, ["torch==2.11.0+cu130", "numpy"]).decode()
    head, _, body = out.partition("\n\n")
    assert head.splitlines()[-2:] == ["Requires-Dist: numpy", "Requires-Dist: torch==2.11.0+cu130"]
    assert body == "A description\n\nwith lines\n"
