"""A failed command's error names the cause, not only the wrapper's last words."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks import proc
from tasks.errors import ReproError


def _fail(tmp_path: Path, script: str) -> str:
    log = tmp_path / "build.log"
    with pytest.raises(ReproError) as info:
        proc.run(["bash", "-c", script], env=dict(os.environ), log=log, cwd=tmp_path, what="build of demo")
    return str(info.value)


def test_compiler_error_far_above_the_tail_is_shown(tmp_path: Path) -> None:
    # A real gcc error, then more output than the tail holds (as pip's cleanup prints after a failed build).
    (tmp_path / "broken.c").write_text("int f(void) { return undefined_name; }\n")
    message = _fail(
        tmp_path, f"gcc -c broken.c -o broken.o; for i in $(seq {proc.TAIL_LINES * 2}); do echo noise $i; done; exit 1"
    )
    assert "--- first error lines of" in message
    assert "broken.c:1:" in message and "undefined_name" in message
    assert message.index("first error lines") < message.index("--- last lines of")
    assert f"noise {proc.TAIL_LINES * 2}" in message  # the tail is still there


def test_error_already_in_the_tail_is_not_repeated(tmp_path: Path) -> None:
    (tmp_path / "broken.c").write_text("int f(void) { return undefined_name; }\n")
    message = _fail(tmp_path, "gcc -c broken.c -o broken.o")
    assert "first error lines" not in message
    assert message.count("undeclared (first use") == 1


def test_no_error_lines_means_tail_only(tmp_path: Path) -> None:
    message = _fail(tmp_path, "echo all fine until now; exit 3")
    assert "exit status 3" in message
    assert "first error lines" not in message
    assert "all fine until now" in message


def test_error_lines_are_capped_and_clipped(tmp_path: Path) -> None:
    log = tmp_path / "many.log"
    long_line = "x.cu(1): error: " + "y" * 1000
    log.write_text("\n".join([f"FAILED: unit{i}.o" for i in range(30)] + [long_line]) + "\n")
    lines = proc.error_lines(log)
    assert len(lines) == proc.ERROR_LINES
    assert lines[0] == "FAILED: unit0.o"
    clipped = proc.error_lines(tmp_path / "many.log", limit=100)[-1]
    assert clipped.endswith(" …") and len(clipped) <= proc.ERROR_LINE_CHARS + 2
    assert proc.error_lines(tmp_path / "absent.log") == []
