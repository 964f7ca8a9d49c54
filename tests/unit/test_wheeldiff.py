"""The built-in comparison `doit repro` reports when a rebuilt wheel differs."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tasks.verify.wheeldiff import compare_wheels, elf_details

CC = shutil.which("cc") or shutil.which("gcc")


def shared_object(tmp_path: Path, name: str, tmpname: str) -> bytes:
    """A real shared object whose string table names a temporary file, as nvcc's objects do."""
    src = tmp_path / f"{name}.c"
    src.write_text(f"static int {tmpname}(void) {{ return 1; }}\nint f(void) {{ return {tmpname}(); }}\n")
    out = tmp_path / f"{name}.so"
    assert CC is not None
    subprocess.run([CC, "-shared", "-fPIC", "-O0", str(src), "-o", str(out)], check=True)
    return out.read_bytes()


def wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


@pytest.mark.skipif(CC is None, reason="no C compiler (cc or gcc) on PATH")
def test_differences_are_named_member_by_member(tmp_path: Path) -> None:
    so_a = shared_object(tmp_path, "a", "tmpxft_0000379e_vadd")
    so_b = shared_object(tmp_path, "b", "tmpxft_00003a01_vadd")
    common = {"demo/__init__.py": b"X = 1\n", "demo-0.1.dist-info/WHEEL": b"Wheel-Version: 1.0\n"}
    a = wheel(
        tmp_path / "a.whl",
        {**common, "demo/_ext.so": so_a, "demo/_stamp.py": b"T = 1\n", "demo/old.txt": b"x"},
    )
    b = wheel(
        tmp_path / "b.whl",
        {**common, "demo/_ext.so": so_b, "demo/_stamp.py": b"T = 2\n", "demo/new.txt": b"y"},
    )
    diff = compare_wheels(a, b)
    names = {m.name: m for m in diff.members}
    assert set(names) == {"demo/_ext.so", "demo/_stamp.py", "demo/old.txt", "demo/new.txt"}
    assert names["demo/old.txt"].status == "only in built" and names["demo/new.txt"].status == "only in rebuilt"
    assert names["demo/_stamp.py"].details == ("-T = 1", "+T = 2")
    so = "\n".join(names["demo/_ext.so"].details)
    assert "sections that differ: " in so and ".strtab" in so
    assert "strings only in built:\n  'tmpxft_0000379e_vadd'" in so
    assert "strings only in rebuilt:\n  'tmpxft_00003a01_vadd'" in so
    text = diff.render()
    assert text.splitlines()[0].startswith("demo/_ext.so: size ")
    # The same wheel: nothing to report.
    assert compare_wheels(a, a).members == ()
    assert elf_details(b"not elf", b"not elf either") is None


def test_same_members_in_another_order_are_named_as_such(tmp_path: Path) -> None:
    members = {"demo/a.py": b"a\n", "demo/b.py": b"b\n"}
    a = wheel(tmp_path / "a.whl", members)
    b = wheel(tmp_path / "b.whl", dict(reversed(list(members.items()))))
    diff = compare_wheels(a, b)
    assert diff.members == ()
    assert diff.render() == "every member is identical: the member order differs"
