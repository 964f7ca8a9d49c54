"""Member checks of archives, git trees and bundles (tasks/members.py) and the extraction built on them."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from tasks import archive, members
from tasks.errors import VerificationError
from tasks.members import DIRECTORY, FILE, SYMLINK, Member, UnsafeMember


@pytest.mark.parametrize(
    ("member", "why"),
    [
        (Member(name="/etc/passwd", kind=FILE), "absolute"),
        (Member(name="a/../../x", kind=FILE), "'..'"),
        (Member(name="a/link", kind=SYMLINK, target="/etc/shadow"), "outside the tree"),
        (Member(name="a/link", kind=SYMLINK, target="../../etc"), "outside the tree"),
        (Member(name="a/hard", kind="hard link"), "only files, directories"),
        (Member(name="dev", kind="device"), "only files, directories"),
        (Member(name="bin/tool", kind=FILE, mode=0o4755), "setuid"),
    ],
)
def test_unsafe_members_are_refused(member: Member, why: str) -> None:
    with pytest.raises(UnsafeMember, match=why):
        members.check([member])


def test_nothing_is_written_through_a_link_and_names_are_cleaned() -> None:
    with pytest.raises(UnsafeMember, match="lies under the symbolic link 'a/l'"):
        members.check([Member(name="a/l", kind=SYMLINK, target="../b"), Member(name="a/l/x", kind=FILE)])
    with pytest.raises(UnsafeMember, match="appears twice"):
        members.check([Member(name="x", kind=FILE), Member(name="./x", kind=FILE)])
    with pytest.raises(UnsafeMember, match="only files and directories"):
        members.check([Member(name="l", kind=SYMLINK, target="x")], links=False)
    ok = members.check(
        [
            Member(name="./pkg/", kind=DIRECTORY),
            Member(name="pkg//a.py", kind=FILE),
            Member(name="pkg/link", kind=SYMLINK, target="a.py"),
            Member(name="pkg/up", kind=SYMLINK, target="../pkg/a.py"),
        ]
    )
    assert [m.name for m in ok] == ["pkg", "pkg/a.py", "pkg/link", "pkg/up"]


def _tar(path: Path, entries: list[tarfile.TarInfo], data: dict[str, bytes] | None = None) -> Path:
    with tarfile.open(path, "w") as tar:
        for info in entries:
            body = (data or {}).get(info.name)
            if body is not None:
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
            else:
                tar.addfile(info)
    return path


def _entry(name: str, kind: bytes = tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return info


@pytest.fixture(params=["with-filter", "without-filter"])
def stdlib_filter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each case as on Python 3.11.4+ (the stdlib filter as a second line) and as on 3.11.0-3.11.3 (none)."""
    if request.param == "without-filter":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    return str(request.param)


def test_symlink_chain_out_of_the_tree_writes_nothing_outside(tmp_path: Path, stdlib_filter: str) -> None:
    """The CVE-2025-4517 shape: a link to a directory outside, then a file written through it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    depth = "../" * 8
    bad = _tar(
        tmp_path / "bad.tar",
        [
            _entry("top/", tarfile.DIRTYPE),
            _entry("top/esc", tarfile.SYMTYPE, f"{depth}{outside}"),
            _entry("top/esc/pwned"),
        ],
        {"top/esc/pwned": b"owned"},
    )
    with pytest.raises(VerificationError, match="refused, nothing of it was used"):
        archive.unpack(bad, tmp_path / "dest")
    assert not list(outside.iterdir())
    assert not (tmp_path / "dest" / "raw" / "top").exists()


def test_hard_links_devices_and_setuid_are_refused(tmp_path: Path, stdlib_filter: str) -> None:
    cases = {
        "hard": [_entry("x", tarfile.REGTYPE), _entry("y", tarfile.LNKTYPE, "x")],
        "fifo": [_entry("f", tarfile.FIFOTYPE)],
    }
    setuid = _entry("tool")
    setuid.mode = 0o4755
    cases["setuid"] = [setuid]
    for name, entries in cases.items():
        path = _tar(tmp_path / f"{name}.tar", entries, {"x": b"x", "tool": b"#!/bin/sh\n"})
        with pytest.raises(VerificationError, match="refused"):
            archive.unpack(path, tmp_path / f"dest-{name}")


def test_a_good_archive_unpacks_with_its_inner_links(tmp_path: Path, stdlib_filter: str) -> None:
    good = _tar(
        tmp_path / "good.tar",
        [_entry("p-1/", tarfile.DIRTYPE), _entry("p-1/a.py"), _entry("p-1/b.py", tarfile.SYMTYPE, "a.py")],
        {"p-1/a.py": b"print(1)\n"},
    )
    root = archive.unpack(good, tmp_path / "dest")
    assert root.name == "p-1" and (root / "a.py").read_bytes() == b"print(1)\n"
    assert os.readlink(root / "b.py") == "a.py"


def test_zip_link_to_a_host_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("p-1/setup.py", "x")
        link = zipfile.ZipInfo("p-1/secret")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(link, "/etc/shadow")
    with pytest.raises(VerificationError, match="'p-1/secret': symbolic link to '/etc/shadow', outside the tree"):
        archive.unpack(path, tmp_path / "dest")
    assert not (tmp_path / "dest" / "raw" / "p-1").exists()
