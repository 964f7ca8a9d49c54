"""tasks/stages/build.py without a build: the command it runs, and what it says when a build fails, through
the ``runner`` seam (the real runner is tasks/core/proc.py ``run``; here a runner writes the log a failing
build would and fails as ``run`` does)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tasks.core import proc
from tasks.core.errors import BuildError
from tasks.lock.lockfile import Package
from tasks.stages.build import run_build, wheel_command

PKG = Package(name="flash_attn_3", source="fa", mem_per_job_gb=12.0, pip_args=("--config-settings", "x=y"))


def failing(log_text: str) -> Callable[..., proc.Usage]:
    """A runner whose build writes ``log_text`` to its log and fails, as proc.run reports a failure."""

    def runner(cmd: list[str], *, env: dict[str, str], cwd: Path, log: Path, error: Any, what: str, **_: Any) -> Any:
        log.write_text(f"$ {' '.join(cmd)}\n{log_text}")
        raise error(f"{what} failed (exit status 1).\n{log_text.splitlines()[-1]}")

    return runner


def test_the_wheel_command_builds_offline_without_isolation_into_out() -> None:
    cmd = wheel_command(PKG, "/out", "/src/hopper", python="/py")
    assert cmd[:4] == ["/py", "-m", "pip", "wheel"]
    for flag in ("--no-build-isolation", "--no-deps", "--no-index", "--no-cache-dir"):
        assert flag in cmd
    assert cmd[cmd.index("-w") + 1] == "/out" and cmd[-3:] == ["--config-settings", "x=y", "/src/hopper"]


def test_a_compiler_killed_for_memory_is_said_with_the_lock_key_to_raise(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    text = "[3/9] nvcc -c flash_fwd_hdim256.cu\nFAILED: flash_fwd_hdim256.o\nKilled\nninja: build stopped\n"
    with pytest.raises(BuildError) as caught:
        run_build(["pip", "wheel"], env={}, cwd=tmp_path, log=log, pkg=PKG, runner=failing(text))
    message = caught.value.message
    assert "ran out of memory" in message and "FAILED: flash_fwd_hdim256.o: Killed" in message
    assert "mem_per_job_gb = 12 GB" in message and "jobs= / mem=" in message


def test_a_full_disk_is_said_as_that_with_where_to_free_space(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    text = "writing build/temp/x.o\nerror: No space left on device\n"
    with pytest.raises(BuildError) as caught:
        run_build(["pip", "wheel"], env={}, cwd=tmp_path, log=log, pkg=PKG, runner=failing(text))
    assert "ran out of disk space" in caught.value.message and "nothing partial was kept" in caught.value.message


def test_a_compile_error_stays_the_runners_own_failure(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    text = 'csrc/a.cu(12): error: identifier "x" is undefined\n'
    with pytest.raises(BuildError) as caught:
        run_build(["pip", "wheel"], env={}, cwd=tmp_path, log=log, pkg=PKG, runner=failing(text))
    assert (
        caught.value.message.startswith("build of flash_attn_3 failed") and "out of memory" not in caught.value.message
    )


def test_a_build_that_passes_returns_the_runners_usage(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def runner(cmd: list[str], **kwargs: Any) -> proc.Usage:
        seen.update(kwargs, cmd=cmd)
        kwargs["on_start"](4242)
        return proc.Usage(cpu_seconds=3.0, max_rss_mb=10.0)

    usage = run_build(["pip", "wheel"], env={"A": "1"}, cwd=tmp_path, log=tmp_path / "l", pkg=PKG, runner=runner)
    assert usage.cpu_seconds == 3.0 and seen["error"] is BuildError and seen["what"] == "build of flash_attn_3"
    assert seen["env"] == {"A": "1"} and seen["cwd"] == tmp_path
