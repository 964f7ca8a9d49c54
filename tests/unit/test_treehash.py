"""The normalised tree hash and the file filter."""

from __future__ import annotations

import os
from pathlib import Path

from tasks.core.treehash import FileFilter, tree_sha256


def make_tree(root: Path) -> None:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("print(1)\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(root / "run.sh", 0o755)
    os.symlink("pkg/a.py", root / "link")


def test_same_content_same_hash_regardless_of_mtime_and_group_bits(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    make_tree(a)
    make_tree(b)
    os.utime(b / "pkg" / "a.py", (1, 1))
    os.chmod(b / "pkg" / "a.py", 0o600)
    (b / "empty").mkdir()
    assert tree_sha256(a) == tree_sha256(b)


def test_content_mode_symlink_and_path_changes_change_the_hash(tmp_path: Path) -> None:
    base = tmp_path / "base"
    make_tree(base)
    h = tree_sha256(base)
    for i, change in enumerate(("content", "mode", "link", "path")):
        t = tmp_path / f"t{i}"
        make_tree(t)
        if change == "content":
            (t / "pkg" / "a.py").write_text("print(2)\n")
        elif change == "mode":
            os.chmod(t / "run.sh", 0o644)
        elif change == "link":
            (t / "link").unlink()
            os.symlink("run.sh", t / "link")
        else:
            (t / "pkg" / "a.py").rename(t / "pkg" / "b.py")
        assert tree_sha256(t) != h, change


def test_filter_keeps_includes_minus_excludes(tmp_path: Path) -> None:
    f = FileFilter(include=("hopper/", "csrc/cutlass/include/"), exclude=("*.md", "hopper/test_*"))
    assert f.keeps("hopper/setup.py")
    assert f.keeps("csrc/cutlass/include/cute/a.hpp")
    assert not f.keeps("hopper/README.md")
    assert not f.keeps("hopper/test_flash.py")
    assert not f.keeps("csrc/flash_attn/x.cu")
    make_tree(tmp_path / "t")
    FileFilter(exclude=("pkg/",)).apply(tmp_path / "t")
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["link", "run.sh"]
