"""Settings that pass a check and then crash (issue 42): each is one line and exit status 10, from the command
line, a ``REPRO_*`` variable and ``reprostack.toml`` alike, never a traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.core.errors import ReproError
from tasks.core.settings import MAX_JOBS, VARIABLES, load_settings, parse_shard, whole_number

REPO = Path(__file__).resolve().parents[2]

#: (variable, value, what the one line says): ``str.isdigit`` is true of superscripts, which ``int`` refuses;
#: ``float("inf")`` is positive, and ``inf // 24`` is NaN for ``int()`` (``memory=job`` divides by it).
HOSTILE = [
    ("jobs", "²", "jobs='²': give a positive whole number"),
    ("shard", "1/²", "shard='1/²': give i/N"),
    ("mem", "inf", "mem='inf': give the memory budget in GB as a positive number"),
]


@pytest.mark.parametrize(("name", "value", "said"), [
    *HOSTILE,
    ("jobs", "٣", "jobs='٣': give a positive whole number"),  # another script's digit, which int() takes
    ("jobs", "9" * 5000, "give a positive whole number"),  # more digits than int() converts
    ("jobs", str(MAX_JOBS + 1), f"at most {MAX_JOBS} compiler jobs"),
    ("mem", "1e999", "mem='1e999'"),
    ("mem", "nan", "mem='nan'"),
    ("remote_timeout", "inf", "remote_timeout='inf'"),
    ("shard", "1/" + "9" * 5000, "give i/N"),
], ids=lambda value: value[:24])  # fmt: skip
def test_a_hostile_value_is_one_error_from_each_place(
    name: str, value: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for other in VARIABLES.values():
        monkeypatch.delenv(other[0], raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ReproError, match=re.escape(said[:40])):
        load_settings({name: value, "memory": "job"})
    monkeypatch.setenv(VARIABLES[name][0], value)
    with pytest.raises(ReproError, match=r"give|at most"):
        load_settings({"memory": "job"})
    monkeypatch.delenv(VARIABLES[name][0])
    (tmp_path / "reprostack.toml").write_text(f'{name} = "{value}"\nmemory = "job"\n')
    with pytest.raises(ReproError, match=r"give|at most"):
        load_settings({})


def test_the_values_that_pass_still_pass(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for other in VARIABLES.values():
        monkeypatch.delenv(other[0], raising=False)
    monkeypatch.chdir(tmp_path)
    found = load_settings({"jobs": str(MAX_JOBS), "shard": "2/4", "mem": "96.5", "memory": "job"})
    assert (found.jobs, found.shard, found.mem_gb) == (MAX_JOBS, (2, 4), 96.5)
    assert parse_shard("10/12") == (10, 12)
    assert whole_number("0012") == 12 and whole_number("²") is None and whole_number(" 4") is None


def _reprostack(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The installed command (tasks.cli.main:reprostack) in ``cwd``, without this shell's REPRO_* settings."""
    code = "import sys; from tasks.cli.main import reprostack; sys.argv[0] = 'reprostack'; reprostack()"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("REPRO_")}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(("name", "value", "said"), HOSTILE)
@pytest.mark.parametrize("where", ["command line", "reprostack.toml"])
def test_a_hostile_value_ends_the_command_with_one_line_and_status_10(
    name: str, value: str, said: str, where: str, tmp_path: Path
) -> None:
    """The real command: before the fix, ``jobs = "²"`` and ``shard = "1/²"`` were doit's traceback and exit 3,
    ``mem = "inf"`` passed (and ``memory = "job"`` then divided infinity by the heaviest package)."""
    (tmp_path / "sources.lock").write_text('format = 1\n[toolchain]\narchs = ["sm_90a"]\n[sources]\n[packages]\n')
    if where == "command line":
        res = _reprostack(tmp_path, "list", f"{name}={value}", "memory=job")
    else:
        (tmp_path / "reprostack.toml").write_text(f'{name} = "{value}"\nmemory = "job"\n')
        res = _reprostack(tmp_path, "list")
    assert res.returncode == 10, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and said in errors[0], res.stderr
