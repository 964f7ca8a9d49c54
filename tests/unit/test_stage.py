"""Staging: patched files get the fixed epoch as their mtime (nvcc records source mtimes in line tables)."""

from __future__ import annotations

import os
from pathlib import Path

from tasks.lock.lockfile import Package
from tasks.stages.patch import Patch, stage_package
from tasks.store.wheelnorm import DEFAULT_EPOCH

PATCH = """Change one file, add another.

--- a/pkg/kernel.h
+++ b/pkg/kernel.h
@@ -1 +1 @@
-#define STAGES 2
+#define STAGES 3
--- /dev/null
+++ b/pkg/added.h
@@ -0,0 +1 @@
+#define ADDED 1
"""


def test_patched_files_get_the_fixed_epoch_others_keep_theirs(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "kernel.h").write_text("#define STAGES 2\n")
    (tree / "pkg" / "other.h").write_text("#define OTHER 1\n")
    for f in (tree / "pkg").iterdir():
        os.utime(f, (0, 0))  # cached git trees carry mtime 0
    patch = tmp_path / "0001.patch"
    patch.write_text(PATCH)
    dest = tmp_path / "stage"
    pkg = Package(name="pkg", source="src")
    stage_package(pkg, trees={"src": tree}, patches=[Patch("0001.patch", patch)], dest=dest, log=tmp_path / "log")
    assert (dest / "pkg" / "kernel.h").read_text() == "#define STAGES 3\n"
    assert (dest / "pkg" / "kernel.h").stat().st_mtime == DEFAULT_EPOCH
    assert (dest / "pkg" / "added.h").stat().st_mtime == DEFAULT_EPOCH
    assert (dest / "pkg" / "other.h").stat().st_mtime == 0


def test_a_patch_whose_last_line_lacks_its_newline_applies(tmp_path: Path) -> None:
    """git apply calls such a diff corrupt (InfiR2's sglang.patch at d3a5456 is one); staging adds the newline."""
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "kernel.h").write_text("#define STAGES 2\n\n#define END 1\n")
    diff = "--- a/pkg/kernel.h\n+++ b/pkg/kernel.h\n@@ -1,3 +1,3 @@\n"
    diff += "-#define STAGES 2\n+#define STAGES 3\n \n #define END 1"
    assert not diff.endswith("\n")
    patch = tmp_path / "0001.patch"
    patch.write_text(diff)  # no final newline
    dest = tmp_path / "stage"
    stage_package(
        Package(name="pkg", source="src"),
        trees={"src": tree},
        patches=[Patch("0001.patch", patch)],
        dest=dest,
        log=tmp_path / "log",
    )
    assert (dest / "pkg" / "kernel.h").read_text() == "#define STAGES 3\n\n#define END 1\n"
    assert patch.read_text() == diff  # the file itself is left as it is
    assert "no newline; applied with one added" in (tmp_path / "log").read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the fixed copy is gone
