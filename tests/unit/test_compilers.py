"""Which compilers a build reaches, and the watch for compilers run outside the gate (real processes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tasks.core.errors import BuildError
from tasks.engine.timeline import Outcome, report
from tasks.env import compilers


def test_names_cover_this_python_the_environment_and_target_prefixed_gcc() -> None:
    names = compilers.names({"CC": "ccache clang-18 -m64", "CXX": "/opt/gcc/bin/g++", "CUDAHOSTCXX": "g++-13"})
    assert names[:7] == list(compilers.BY_NAME)
    sysconfig_cc = compilers.first_word(sysconfig.get_config_var("CC") or "")
    if sysconfig_cc and "/" not in sysconfig_cc:  # x86_64-linux-gnu-gcc on Debian's python3, gcc on pyenv's
        assert sysconfig_cc in names
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        assert f"{multiarch}-gcc" in names and f"{multiarch}-g++" in names
    assert "g++-13" in names and "ccache" not in names and "/opt/gcc/bin/g++" not in names
    assert len(names) == len(set(names))
    assert compilers.by_path({"CXX": "/opt/gcc/bin/g++ -m64", "CC": "gcc", "NVCC": "/usr/local/cuda/bin/nvcc"}) == {
        "CXX": "/opt/gcc/bin/g++ -m64",
        "NVCC": "/usr/local/cuda/bin/nvcc",
    }


def test_a_directory_with_spaces_is_replaced_by_one_without(tmp_path: Path) -> None:
    plain = compilers.spaceless_dir(tmp_path / "plain", "t-")
    assert plain == tmp_path / "plain" and plain.is_dir()
    other = compilers.spaceless_dir(tmp_path / "My Builds" / "bin", "t-")
    assert other.is_dir() and not compilers.has_space(other) and "My Builds" not in str(other)


def test_a_temporary_directory_with_spaces_is_refused_in_one_line(tmp_path: Path) -> None:
    spaced = tmp_path / "tmp dir"
    spaced.mkdir()
    script = (
        "from pathlib import Path; from tasks.env import compilers\n"
        f"compilers.spaceless_dir(Path({str(tmp_path / 'My Builds')!r}), 't-')\n"
    )
    env = {**os.environ, "TMPDIR": str(spaced)}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    assert res.returncode != 0 and BuildError.__name__ in res.stderr
    assert f"temporary directory {spaced} has one too" in res.stderr


def _compile_waiting_on_stdin(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A real C compile in its own session that runs until its stdin closes."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    return subprocess.Popen(
        [cc, "-x", "c", "-c", "-", "-o", os.devnull],
        stdin=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )


@pytest.mark.parametrize("gated", [False, True])
def test_the_watch_counts_compilers_outside_the_gate_by_name(gated: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != compilers.GATED_MARK}
    if gated:  # as the gate leaves it for the compiler it runs
        env[compilers.GATED_MARK] = "1"
    proc = _compile_waiting_on_stdin(env)
    watch = compilers.Watch()
    watch.started(proc.pid)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not watch.escaped():
            watch.scan()
            time.sleep(0.05)
    finally:
        assert proc.stdin is not None
        proc.stdin.write(b"int x;\n")
        proc.stdin.close()
        proc.wait()
    if gated:
        assert watch.escaped() == {}
    else:
        assert dict(watch.escaped()) == {proc.args[0]: 1}  # type: ignore[index]


def test_the_run_summary_names_compilers_outside_the_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    built = Outcome(package="te", status="built", wall_s=1.0, escaped={"/usr/bin/gcc-12": 3})
    report({"te": built}, ["te"], tmp_path / "trace.json")
    out = capsys.readouterr().out
    assert "warning: te: 3 compile(s) seen running outside the gate and the object cache (3 by /usr/bin/gcc-12)" in out
