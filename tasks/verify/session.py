"""One verification run's state: its paths, the environment of every child, its logs and tools, and the
runner process (tasks/outside/verify_runner.py) that inspects an interpreter's distributions."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from tasks.core import proc
from tasks.core.fsutil import write_atomic
from tasks.core.proc import Completed
from tasks.verify import elfcheck

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().parents[1] / "outside" / "verify_runner.py"
SMOKE_DIR = Path(__file__).resolve().parents[1] / "outside" / "smoke"

GpuMode = Literal["auto", "off", "on"]
GPU_MODES: tuple[str, ...] = get_args(GpuMode)

SMOKE_TIMEOUT_S = 600.0
RUNNER_TIMEOUT_S = 600.0
TOOL_TIMEOUT_S = 300.0
MAX_RUNNER_RESTARTS = 8

# Variables that would make the venv's interpreter see or do something else
# than the venv; they are dropped from every child's environment.
_DROPPED_ENV = (
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONUSERBASE",
    "PYTHONSAFEPATH",
    "PYTHONWARNINGS",
    "PYTHONINSPECT",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "PIP_REQUIRE_VIRTUALENV",
    "PIP_TARGET",
    "PIP_PREFIX",
    "PIP_USER",
    "__PYVENV_LAUNCHER__",
    "REPRO_VERIFY_GPU",
)


def child_env(venv: Path | None = None, gpu: GpuMode = "auto") -> dict[str, str]:
    """The environment of every child: ours, less what would redirect Python."""
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED_ENV}
    env.update(
        PYTHONNOUSERSITE="1",
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONFAULTHANDLER="1",
        PYTHONUNBUFFERED="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        PIP_NO_COLOR="1",
    )
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", os.defpath)])
    if gpu == "off":
        env["REPRO_VERIFY_GPU"] = "0"
    elif gpu == "on":
        env["REPRO_VERIFY_GPU"] = "1"
    return env


class Demangler:
    """c++filt, when it is installed; names pass through unchanged otherwise."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._tool = shutil.which("c++filt", path=env.get("PATH"))
        self._env = env
        self._cache: dict[str, str] = {}

    def __call__(self, names: Sequence[str]) -> list[str]:
        todo = sorted({n for n in names if n not in self._cache and n.startswith("_Z")})
        if todo and self._tool:
            done = proc.query([self._tool, *todo], env=self._env, timeout=120, text=True, tolerant=True)
            lines = done.stdout.splitlines() if done.returncode == 0 else []
            if len(lines) == len(todo):
                self._cache.update(zip(todo, lines, strict=True))
        return [self._cache.get(n, n) for n in names]


@dataclass(frozen=True, kw_only=True)
class _ItemResult:
    kind: str
    target: str
    ok: bool
    error: str = ""


class VerifySession:
    """State of one verification run: paths, environment, logs, tools."""

    def __init__(
        self,
        *,
        wheel_dir: Path,
        work_dir: Path,
        python: str,
        gpu: GpuMode,
        log_dir: Path,
        installed: bool = False,
        isolated: bool = False,
    ) -> None:
        self.wheel_dir = wheel_dir
        self.work_dir = work_dir
        self.python = python
        self.gpu = gpu
        self.log_dir = log_dir
        self.venv = work_dir / "venv"
        self.venv_python = self.venv / "bin" / "python"
        self.pip = [str(self.venv_python), "-m", "pip"]
        self.scratch = work_dir / "scratch"
        self.env = child_env(self.venv, gpu)
        self._logs: set[Path] = set()
        self.demangle = Demangler(self.env)
        self._torch_indexes: dict[Path, elfcheck.SymbolIndex] = {}
        self.installed = installed  # check python's own environment: no scratch venv, no install
        self.isolated = isolated  # a venv that sees the base interpreter and the provided set only
        self.provided: tuple[str, ...] = ()
        #: Site directories the scratch venv sees that the wheelhouse's own install command would not (this
        #: tool's venv, made visible for the base's torch): what is only there does not meet a requirement.
        self.foreign: list[str] = []
        #: Distributions installed in this tool's own venv (not its base interpreter's, not provided): a
        #: requirement of theirs that the wheelhouse breaks is the tool's, not the target's.
        self.tool_own: set[str] = set()
        #: The site directories of this tool's own venv, where the base interpreter sees them and they are not
        #: the base (tasks/verify/venv.py ``apart``): no distribution there stands in for one of the base.
        self.apart: list[str] = []

    def log(self, name: str) -> Path:
        """``<log_dir>/<name>.log``, emptied the first time this run asks."""
        path = self.log_dir / f"{_safe(name)}.log"
        if path not in self._logs:
            self._logs.add(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")
        return path

    def torch_index(self, torch_lib: Path) -> elfcheck.SymbolIndex:
        """Who defines what among torch's libraries; built once per run."""
        if torch_lib not in self._torch_indexes:
            libs = [p for p in torch_lib.glob("*.so*") if p.is_file() and elfcheck.is_elf(p)]
            self._torch_indexes[torch_lib] = elfcheck.SymbolIndex(libs)
        return self._torch_indexes[torch_lib]

    def run(self, argv: Sequence[str], *, log: str, timeout: float | None = None, cwd: Path | None = None) -> Completed:
        return proc.run(argv, log=self.log(log), env=self.env, timeout=timeout, cwd=cwd or self.scratch, check=False)

    def runner_info(
        self,
        python: str | Path,
        dists: Sequence[str],
        *,
        log: str,
        versions: Mapping[str, str] | None = None,
        foreign: Sequence[str] = (),
        allowed: Sequence[str] = (),
        hide: Sequence[str] = (),
    ) -> dict[str, Any] | Completed:
        """What ``python`` has of ``dists``; where ``versions`` names one, the copy of that version on its path;
        never a copy in one of the ``hide`` directories (this tool's own venv, where it is not the base).

        A requirement of theirs met only from one of the ``foreign`` directories (this tool's own venv), and
        not ``allowed`` (provided), counts as unmet (see tasks/outside/verify_runner.py)."""
        request = self.scratch / f"{log}.request.json"
        out = self.scratch / f"{log}.json"
        doc = {"dists": list(dists), "versions": dict(versions or {}), "foreign": list(foreign),
               "allowed": list(allowed), "hide": list(hide)}  # fmt: skip
        write_atomic(request, json.dumps(doc))
        out.unlink(missing_ok=True)
        done = self.run([str(python), str(RUNNER), "info", str(request), str(out)], log=log, timeout=TOOL_TIMEOUT_S)
        if not done.ok or not out.is_file():
            return done
        result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
        return result


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", name)
