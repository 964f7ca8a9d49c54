"""Member checks of archives, git trees and bundles (tasks/core/members.py) and the extraction built on them."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tasks.core import archive, members
from tasks.core.errors import VerificationError
from tasks.core.members import DIRECTORY, FILE, SYMLINK, Member, UnsafeMember
from tasks.core.treehash import tree_sha256
from tasks.lock import fetch
from tasks.lock.lockfile import Package
from tasks.stages.patch import stage_package


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


# A link that normalises inside the tree but, followed through the tree's own link `deep/l -> ..`,
# climbs out: each `deep/l` returns to the top, so the 30 `..` leave it (the kernel stops at `/`).
CHAIN = "deep/l/" * 15 + "../" * 30 + "etc/hostname"


def test_a_chain_of_the_trees_own_links_that_climbs_out_is_refused() -> None:
    assert members.target_inside("secret.txt", CHAIN)  # lexically it stays inside
    chain = [Member(name="deep/l", kind=SYMLINK, target=".."), Member(name="secret.txt", kind=SYMLINK, target=CHAIN)]
    for listed in (chain, chain[::-1]):  # wherever the link it passes through is listed
        with pytest.raises(UnsafeMember, match=r"'secret.txt': symbolic link to .* outside the tree once"):
            members.check(listed)
    loop = [Member(name="a", kind=SYMLINK, target="b"), Member(name="b", kind=SYMLINK, target="a")]
    with pytest.raises(UnsafeMember, match="outside the tree once"):
        members.check(loop)
    # Chains that stay inside are kept: links through links, and `..` from where a link really leads.
    ok = [
        Member(name="pkg/a.py", kind=FILE),
        Member(name="pkg/sub/d", kind=SYMLINK, target="../../lib"),
        Member(name="lib/inc/x.h", kind=FILE),
        Member(name="pkg/x.h", kind=SYMLINK, target="sub/d/inc/../inc/x.h"),
        Member(name="top", kind=SYMLINK, target="pkg/sub/d/.."),
    ]
    assert len(members.check(ok)) == 5
    assert members.resolve("pkg/x.h", {m.name: m.target for m in ok if m.kind == SYMLINK}) == "lib/inc/x.h"


def test_tar_with_a_link_chain_out_of_the_tree_is_refused(tmp_path: Path, stdlib_filter: str) -> None:
    bad = _tar(
        tmp_path / "bad.tar",
        [
            _entry("p-1/", tarfile.DIRTYPE),
            _entry("p-1/deep/", tarfile.DIRTYPE),
            _entry("p-1/deep/l", tarfile.SYMTYPE, ".."),
            _entry("p-1/secret.txt", tarfile.SYMTYPE, CHAIN),
            _entry("p-1/setup.py"),
        ],
        {"p-1/setup.py": b"x"},
    )
    with pytest.raises(VerificationError, match=r"'p-1/secret.txt': symbolic link to .* outside the tree once"):
        archive.unpack(bad, tmp_path / "dest")
    assert not (tmp_path / "dest" / "raw" / "p-1").exists()


def test_zip_with_a_link_chain_out_of_the_tree_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("p-1/setup.py", "x")
        for name, target in (("p-1/deep/l", ".."), ("p-1/secret.txt", CHAIN)):
            link = zipfile.ZipInfo(name)
            link.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(link, target)
    with pytest.raises(VerificationError, match=r"'p-1/secret.txt': symbolic link to .* outside the tree once"):
        archive.unpack(path, tmp_path / "dest")
    assert not (tmp_path / "dest" / "raw" / "p-1").exists()


def test_a_link_to_the_stripped_directory_is_refused(tmp_path: Path) -> None:
    """`p-1/up -> ..` stays inside the archive, but not inside the tree once `p-1/` is stripped."""
    bad = _tar(tmp_path / "bad.tar", [_entry("p-1/", tarfile.DIRTYPE), _entry("p-1/up", tarfile.SYMTYPE, "..")])
    with pytest.raises(VerificationError, match=r"'up': symbolic link to '..', outside the tree once 1 leading"):
        archive.unpack(bad, tmp_path / "dest")
    assert archive.unpack(bad, tmp_path / "kept", strip=0).name == "raw"  # unstripped, it is inside


def test_cached_tree_and_staging_follow_links_through_each_other(tmp_path: Path) -> None:
    """What the build reads: each link of the tree on disk followed through the others (overlays too)."""
    host = tmp_path / "host-secret"
    host.write_text("the host's")
    chain = "deep/l/" * 15 + "../" * 30 + str(host).lstrip("/")
    tree = tmp_path / "tree"
    (tree / "deep").mkdir(parents=True)
    (tree / "setup.py").write_text("x")
    (tree / "deep" / "l").symlink_to("..")
    (tree / "secret.txt").symlink_to(chain)
    assert (tree / "secret.txt").read_text() == "the host's"  # what a build would read
    problem = fetch.tree_problem(tree, tree_sha256(tree))
    assert problem is not None and f"link out of the tree: secret.txt -> {chain}" in problem
    # Each tree alone is safe; together, `main/leak` climbs out through the overlay's `x -> .`
    # (each `ov/x/..` goes nowhere, so the 30 `..` leave the staged tree).
    main, overlay = tmp_path / "main", tmp_path / "overlay"
    main.mkdir()
    overlay.mkdir()
    (main / "setup.py").write_text("x")
    leak = "ov/x/../" * 30 + "../" * 30 + "etc/hostname"
    (main / "leak").symlink_to(leak)
    (overlay / "x").symlink_to(".")
    for alone in (main, overlay):
        assert fetch.tree_problem(alone, tree_sha256(alone)) is None
    pkg = Package(name="pkg", source="main", overlays=(("ov", "overlay"),))
    dest = tmp_path / "stage"
    with pytest.raises(VerificationError, match=f"symbolic link out of the tree: leak -> {leak}; refusing"):
        stage_package(pkg, trees={"main": main, "overlay": overlay}, patches=[], dest=dest, log=tmp_path / "log")
    assert not dest.exists()


def cve_2025_4517_tar(path: Path, dest: Path, outside: Path) -> Path:
    """The CVE-2025-4517 shape, for extraction into ``dest``: a file written through a link out of the tree.

    Sixteen links ``a`` .. ``p``, each to a directory of a long name, nest ever deeper; then a link ``l``
    (``../`` sixteen times) at the deepest point, whose path, spelt out, exceeds PATH_MAX.
    os.path.realpath stops following links there and goes on lexically, so the link ``escape`` through
    ``l`` looks inside ``dest`` to tarfile's ``data`` filter (Python before 3.11.13 / 3.12.11), while
    the kernel follows ``l`` back up and on to ``outside``. Then ``escape/planted`` is written there.
    """
    steps = "abcdefghijklmnop"
    long = "d" * ((4096 - len(str(dest)) - 64) // len(steps) - 1)  # the directories fit, their spelt-out path not
    entries, inner = [], ""
    for step in steps:
        entries += [_entry(f"{inner}{long}", tarfile.DIRTYPE), _entry(f"{inner}{step}", tarfile.SYMTYPE, long)]
        inner += f"{long}/"
    through = "/".join(steps) + "/" + "l" * 254
    entries.append(_entry(through, tarfile.SYMTYPE, "../" * len(steps)))
    # realpath pops `l` and the 16 directories and is back in ``dest``; the kernel, in ``dest`` after `l`,
    # climbs 17 levels: to `/` (``dest`` is less deep), and on to ``outside``.
    assert len(dest.parts) <= len(steps) + 1
    climb = "../" * (len(steps) + 1)
    entries.append(_entry("escape", tarfile.SYMTYPE, f"{through}/{climb}{str(outside).lstrip('/')}"))
    entries.append(_entry("escape/planted"))
    return _tar(path, entries, {"escape/planted": b"planted"})


def test_cve_2025_4517_writes_nothing_outside(tmp_path: Path, stdlib_filter: str) -> None:
    """Refused before anything is written, with or without the stdlib's filter (which alone it bypasses)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "x"
    bad = cve_2025_4517_tar(tmp_path / "poc.tar", dest / "raw", outside)
    with pytest.raises(VerificationError, match="refused, nothing of it was used: member 'a/b/c/"):
        archive.unpack(bad, dest)  # its first offence: `l` is written through the link `a`
    assert not list(outside.iterdir())
    assert not list((dest / "raw").iterdir())


@pytest.fixture
def python_3_11_3(monkeypatch: pytest.MonkeyPatch) -> None:
    """tarfile as on Python 3.11.0 to 3.11.3 (Debian bookworm's 3.11.2): no extraction filters at all."""
    for name in ("data_filter", "tar_filter", "fully_trusted_filter"):
        monkeypatch.delattr(tarfile, name, raising=False)
    monkeypatch.delattr(tarfile.TarFile, "extraction_filter", raising=False)
    extractall, extract = tarfile.TarFile.extractall, tarfile.TarFile.extract

    def no_filter(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: tarfile.TarFile, *args: Any, numeric_owner: bool = False, **kwargs: Any) -> Any:
            if kwargs:
                raise TypeError(f"{method.__name__}() got an unexpected keyword argument {next(iter(kwargs))!r}")
            return method(self, *args, numeric_owner=numeric_owner, filter="fully_trusted")  # as 3.11.3 did

        return call

    monkeypatch.setattr(tarfile.TarFile, "extractall", no_filter(extractall))
    monkeypatch.setattr(tarfile.TarFile, "extract", no_filter(extract))


def test_extraction_stands_alone_where_tarfile_has_no_filter(tmp_path: Path, python_3_11_3: None) -> None:
    """On 3.11.0-3.11.3 `extractall(filter=...)` is a TypeError: ours works and refuses bad members without it."""
    with tarfile.open(_tar(tmp_path / "t.tar", [_entry("x")], {"x": b"x"})) as tf, pytest.raises(TypeError):
        tf.extractall(tmp_path / "probe", filter="data")
    good = _tar(
        tmp_path / "good.tar",
        [_entry("p-1/", tarfile.DIRTYPE), _entry("p-1/a.py"), _entry("p-1/b.py", tarfile.SYMTYPE, "a.py")],
        {"p-1/a.py": b"print(1)\n"},
    )
    root = archive.unpack(good, tmp_path / "good")
    assert (root / "a.py").read_bytes() == b"print(1)\n" and os.readlink(root / "b.py") == "a.py"
    outside = tmp_path / "outside"
    outside.mkdir()
    bad = [
        [_entry("p-1/", tarfile.DIRTYPE), _entry("p-1/esc", tarfile.SYMTYPE, "../" * 12 + str(outside).lstrip("/"))],
        [
            _entry("p-1/", tarfile.DIRTYPE),
            _entry("p-1/deep/l", tarfile.SYMTYPE, ".."),
            _entry("p-1/s", tarfile.SYMTYPE, CHAIN),
        ],
        [_entry("../escaped")],
        [_entry("x"), _entry("y", tarfile.LNKTYPE, "x")],
    ]
    for i, entries in enumerate(bad):
        with pytest.raises(VerificationError, match="refused, nothing of it was used"):
            archive.unpack(_tar(tmp_path / f"bad{i}.tar", entries, {"x": b"x", "../escaped": b"x"}), tmp_path / f"d{i}")
        assert not list((tmp_path / f"d{i}" / "raw").iterdir())
    poc = cve_2025_4517_tar(tmp_path / "poc.tar", tmp_path / "poc" / "raw", outside)
    with pytest.raises(VerificationError, match="refused, nothing of it was used"):
        archive.unpack(poc, tmp_path / "poc")
    assert not list(outside.iterdir())
