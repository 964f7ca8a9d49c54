"""Verify stage: prove that the wheelhouse installs and works.

``verify_wheelhouse`` installs ``wheels/`` into a fresh scratch venv (offline,
hash-pinned, torch from the base environment) and checks, per wheel:

- ``deps``: the wheel's requirements are met in the venv;
- ``import``: the modules the manifest names and every extension module the
  wheel installs import in the venv's interpreter;
- ``libs``: every shared object opens through the real loader (RTLD_NOW), so
  each NEEDED library resolves;
- ``symbols``: no undefined symbol, and no c10/at/torch symbol that the
  installed torch does not define (the classic ABI mismatch);
- ``arch``: every object with device code carries SASS for each target arch
  of the manifest (checked with ``cuobjdump``), none left to PTX JIT;
- ``smoke:*``: the package's smoke script from ``tasks/outside/smoke/``, GPU parts
  skipped (never passed) where no GPU is present or ``gpu="off"``;

and, for the environment as a whole, ``pip-check``: ``pip check`` over the
base and the wheelhouse, failing on a broken requirement that involves a
wheel of the wheelhouse. A requirement met only from this tool's own venv
(which the scratch venv sees for the base's torch) and not provided is unmet:
the wheelhouse's install command would not find it.

Before installing, ``sha256`` checks each wheel against ``manifest.json`` and
``provenance`` against the subject digest of its in-toto statement
(``wheels/provenance/``).

The result is a :class:`Report`, also written to ``report.json`` and
``report.txt`` in the work directory. ``run_verify`` raises
:class:`~tasks.core.errors.VerifyFailed` when any check fails.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast, get_args

from tasks.core import proc
from tasks.core.errors import ReproError, VerifyFailed
from tasks.core.fsutil import write_atomic
from tasks.core.proc import Completed, run_logged
from tasks.core.proc import signal_text as signal_text  # verify.signal_text, as it was
from tasks.core.treehash import file_sha256
from tasks.stages import provenance
from tasks.store.manifest import ARCH_PATTERN, MODULE_PATTERN, Manifest, WheelSpec, load_manifest
from tasks.verify import elfcheck
from tasks.verify.report import Report, Row, Status, one_line

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().parents[1] / "outside" / "verify_runner.py"
SMOKE_DIR = Path(__file__).resolve().parents[1] / "outside" / "smoke"

GpuMode = Literal["auto", "off", "on"]
GPU_MODES: tuple[str, ...] = get_args(GpuMode)

SMOKE_TIMEOUT_S = 600.0
RUNNER_TIMEOUT_S = 600.0
TOOL_TIMEOUT_S = 300.0
MAX_RUNNER_RESTARTS = 8
CUOBJDUMP_HINT = (
    "install it with `pip install nvidia-cuda-cuobjdump` (or put the CUDA toolkit's bin/ on PATH, or set CUDA_HOME)"
)

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


# --------------------------------------------------------------------------
# Pure helpers (unit-tested)


def module_name(relpath: str, ext_suffixes: Sequence[str]) -> str | None:
    """Dotted module name of an extension file, relative to site-packages.

    ``pkg/_core.cpython-311-x86_64-linux-gnu.so`` becomes ``pkg._core``. Only
    the interpreter's own extension suffixes count (a plain ``.so`` is a
    library, not a module); files outside importable directories give None.
    """
    parts = relpath.replace(os.sep, "/").split("/")
    for suffix in sorted((s for s in ext_suffixes if s != ".so"), key=len, reverse=True):
        if parts[-1].endswith(suffix):
            parts[-1] = parts[-1][: -len(suffix)]
            dotted = ".".join(parts)
            return dotted if MODULE_PATTERN.match(dotted) else None
    return None


_SHARED_OBJECT = re.compile(r"\.so(\.\d+)*$")


def is_shared_object_name(path: str) -> bool:
    return _SHARED_OBJECT.search(path) is not None


_CUOBJDUMP_LINE = re.compile(r"^\s*(?P<kind>ELF|PTX) file\s+\d+:\s+(?P<name>\S+)\s*$")
_EMBEDDED_ARCH = re.compile(r"\.(?:sm|compute)_(?P<arch>\d{2,3}[af]?)\.(?:cubin|ptx)$")


@dataclass(frozen=True, kw_only=True)
class DeviceCode:
    """What ``cuobjdump --list-elf`` and ``--list-ptx`` found in one object."""

    sass: frozenset[str] = field(default_factory=frozenset)
    ptx: frozenset[str] = field(default_factory=frozenset)
    unknown: tuple[str, ...] = ()


def parse_cuobjdump(list_elf: str, list_ptx: str = "") -> DeviceCode:
    """Parse the listings: ``ELF file 1: x.1.sm_90a.cubin`` gives SASS sm_90a."""
    sass: set[str] = set()
    ptx: set[str] = set()
    unknown: list[str] = []
    for line in (list_elf + "\n" + list_ptx).splitlines():
        match = _CUOBJDUMP_LINE.match(line)
        if match is None:
            continue
        arch = _EMBEDDED_ARCH.search(match["name"])
        if arch is None:
            unknown.append(match["name"])
            continue
        (sass if match["kind"] == "ELF" else ptx).add(f"sm_{arch['arch']}")
    return DeviceCode(sass=frozenset(sass), ptx=frozenset(ptx), unknown=tuple(unknown))


def arch_problems(code: DeviceCode, targets: Sequence[str]) -> list[str]:
    """Why an object's device code does not meet the targets (empty: it does)."""
    problems = []
    # SASS for sm_XY runs on an sm_XYa device too (the 'a' variant only adds
    # instructions), so plain sm_90 code meets an sm_90a target without JIT.
    missing = [arch for arch in targets if arch not in code.sass and arch.rstrip("af") not in code.sass]
    if missing:
        problems.append("no SASS for " + ", ".join(missing))
    # Likewise PTX beside SASS of the same family (compute_90 PTX with sm_90a
    # SASS) is never JIT-compiled on that GPU: only PTX with no SASS is.
    families = {arch.rstrip("af") for arch in code.sass}
    jit = sorted(arch for arch in code.ptx if arch.rstrip("af") not in families)
    if jit:
        problems.append("PTX without SASS for " + ", ".join(jit) + " (left to PTX JIT)")
    return problems


def _arch_key(arch: str) -> tuple[int, str]:
    match = ARCH_PATTERN.match(arch)
    return (int(match["num"]), match["suffix"]) if match else (0, arch)


def describe_device_code(code: DeviceCode) -> str:
    sass = ", ".join(sorted(code.sass, key=_arch_key)) or "none"
    ptx = ", ".join(sorted(code.ptx, key=_arch_key)) or "none"
    return f"SASS {sass}; PTX {ptx}"


# --------------------------------------------------------------------------
# Processes


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


# --------------------------------------------------------------------------
# Tools


def find_cuobjdump(site_dirs: Iterable[str | Path] = ()) -> Path | None:
    """cuobjdump from PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, or the
    ``nvidia-cuda-cuobjdump`` wheel (site-packages/nvidia/**/bin)."""
    found = shutil.which("cuobjdump")
    if found:
        return Path(found)
    candidates = [
        Path(os.environ[var]) / "bin" / "cuobjdump" for var in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(var)
    ]
    candidates.append(Path("/usr/local/cuda/bin/cuobjdump"))
    # The given site dirs, then every directory this interpreter imports from: a
    # --system-site-packages venv (scripts/bootstrap.sh makes one) also sees the
    # base interpreter's site-packages, where pip may have left the wheel.
    for site_dir in [*map(Path, site_dirs), *(Path(p) for p in sys.path if p)]:
        nvidia = site_dir / "nvidia"
        if nvidia.is_dir():
            candidates.extend(sorted(nvidia.glob("**/bin/cuobjdump")))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


class Demangler:
    """c++filt, when it is installed; names pass through unchanged otherwise."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._tool = shutil.which("c++filt", path=env.get("PATH"))
        self._env = env
        self._cache: dict[str, str] = {}

    def __call__(self, names: Sequence[str]) -> list[str]:
        todo = sorted({n for n in names if n not in self._cache and n.startswith("_Z")})
        if todo and self._tool:
            lines = proc.capture([self._tool, *todo], env=self._env).splitlines()
            if len(lines) == len(todo):
                self._cache.update(zip(todo, lines, strict=True))
        return [self._cache.get(n, n) for n in names]


# --------------------------------------------------------------------------
# The run


@dataclass(frozen=True, kw_only=True)
class _ItemResult:
    kind: str
    target: str
    ok: bool
    error: str = ""


class _Session:
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
        return run_logged(argv, log=self.log(log), env=self.env, timeout=timeout, cwd=cwd or self.scratch)

    def runner_info(
        self,
        python: str | Path,
        dists: Sequence[str],
        *,
        log: str,
        versions: Mapping[str, str] | None = None,
        foreign: Sequence[str] = (),
        allowed: Sequence[str] = (),
    ) -> dict[str, Any] | Completed:
        """What ``python`` has of ``dists``; where ``versions`` names one, the copy of that version on its path.

        A requirement of theirs met only from one of the ``foreign`` directories (this tool's own venv), and
        not ``allowed`` (provided), counts as unmet (see tasks/outside/verify_runner.py)."""
        request = self.scratch / f"{log}.request.json"
        out = self.scratch / f"{log}.json"
        doc = {"dists": list(dists), "versions": dict(versions or {}), "foreign": list(foreign),
               "allowed": list(allowed)}  # fmt: skip
        write_atomic(request, json.dumps(doc))
        out.unlink(missing_ok=True)
        done = self.run([str(python), str(RUNNER), "info", str(request), str(out)], log=log, timeout=TOOL_TIMEOUT_S)
        if not done.ok or not out.is_file():
            return done
        result: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
        return result


_SYSTEM_LIB = re.compile(r"^(ld-linux.*|lib(c|m|dl|rt|pthread|util|gcc_s|stdc\+\+)\.so(\.\d+)*)$")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", name)


def verify_wheelhouse(
    wheel_dir: Path,
    work_dir: Path,
    *,
    python: str = sys.executable,
    gpu: str = "auto",
    log_dir: Path | None = None,
    smoke_timeout: float = SMOKE_TIMEOUT_S,
    installed: bool = False,
    isolated: bool = False,
) -> Report:
    """Install ``wheel_dir`` into a fresh venv under ``work_dir`` and check it.

    With ``isolated=True`` the venv does not see the base interpreter's site-packages, only the
    distributions manifest.json's runtime section says the target provides (linked in from the base
    interpreter): so every requirement the wheelhouse does not carry shows up as unmet.

    With ``installed=True`` nothing is installed: the checks run on the
    environment of ``python`` itself, where the wheelhouse must already be
    installed (the runtime image's venv, see tasks/verify/image.py).

    Returns the report (also written to ``work_dir/report.{json,txt}``); it
    does not raise for failed checks: see :func:`run_verify`.
    """
    if gpu not in GPU_MODES:
        raise ReproError(f"gpu must be one of {', '.join(GPU_MODES)}, not {gpu!r}")
    resolved = shutil.which(python)
    if resolved is None:
        raise ReproError(f"python={python!r}: no such interpreter; pass the path of the Python that has torch")
    wheel_dir = Path(wheel_dir).resolve()
    work_dir = Path(work_dir).resolve()
    manifest = load_manifest(wheel_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    session = _Session(
        wheel_dir=wheel_dir,
        work_dir=work_dir,
        python=str(Path(resolved).absolute()),
        gpu=cast(GpuMode, gpu),  # checked against GPU_MODES above
        log_dir=Path(log_dir).resolve() if log_dir is not None else work_dir / "logs",
        installed=installed,
        isolated=isolated,
    )
    session.provided = manifest.provided
    rows = list(_verify(session, manifest, smoke_timeout=smoke_timeout))
    report = Report(rows=tuple(rows), wheel_dir=str(wheel_dir), archs=manifest.archs)
    write_atomic(work_dir / "report.json", report.to_json())
    write_atomic(work_dir / "report.txt", report.render())
    return report


def run_verify(wheel_dir: Path, work_dir: Path, **kwargs: Any) -> Report:
    """``verify_wheelhouse``, raising :class:`VerifyFailed` if any check failed."""
    report = verify_wheelhouse(wheel_dir, work_dir, **kwargs)
    print(report.render(), end="", flush=True)
    if not report.ok:
        work = Path(work_dir).resolve()
        logs = Path(kwargs.get("log_dir") or work / "logs").resolve()
        failed = "\n".join(f"  {row.package} {row.check}: {one_line(row.detail, 160)}" for row in report.failures())
        raise VerifyFailed(
            f"verify: {report.summary()}\n{failed}\n"
            f"Full report: {work / 'report.txt'} (and report.json); logs: {logs}/. " + advice(report.failures())
        )
    return report


def advice(failures: Sequence[Row]) -> str:
    """What to fix, by the cause the failed rows point to: the wheelhouse's files, the environment verify ran
    in, the lock's [runtime], or the wheel's recipe."""
    said = []
    details = " ".join(row.detail for row in failures)
    if any(row.check in ("sha256", "contents", "provenance") for row in failures):
        said.append("The wheelhouse's files were changed: rebuild it with `doit clean wheels && doit wheels`.")
    if any(row.check == "venv" for row in failures) or "not installed for" in details:
        said.append(
            "The environment: the base interpreter lacks what the lock's [runtime] provided names (or the venv "
            "could not be made); run verify where the base has it, or correct [runtime] provided."
        )
    runtime_checks = ("deps", "pip-check")
    missing_module = any(row.check == "import" and "No module named" in row.detail for row in failures)
    if any(row.check in runtime_checks or row.package == "closure" for row in failures) or missing_module:
        said.append(
            "The lock's [runtime]: add what is missing to requirements (or provided, or name the base: "
            "base_python, base_image or base_capture), run `doit lock` and `doit wheels`, then rerun `doit verify`."
        )
    recipe = ("install", "import", "libs", "symbols", "arch")
    if not said or any(
        (row.check in recipe or row.check.startswith("smoke")) and "No module named" not in row.detail
        for row in failures
        if row.package not in ("wheelhouse", "closure", "environment")
    ):
        said.append("The wheel's recipe or patches: fix them, rebuild with `doit wheels`, then rerun `doit verify`.")
    return " ".join(said)


def _verify(session: _Session, manifest: Manifest, *, smoke_timeout: float) -> Iterator[Row]:
    house = "wheelhouse"
    yield _check_hashes(session.wheel_dir, manifest)
    yield _check_contents(session.wheel_dir, manifest)
    yield _check_provenance(session.wheel_dir, manifest)

    base = session.runner_info(session.python, [], log="base-python")
    if isinstance(base, Completed):
        yield Row(
            package=house, check="venv", status="FAIL", detail=base.failure(f"{session.python} (base interpreter)")
        )
        return
    if session.installed:
        yield _use_installed(session, base)
    else:
        venv_row = _make_venv(session, base)
        yield venv_row
        if venv_row.status == "FAIL":
            return
        install_row = _install(session)
        yield install_row
        if install_row.status == "FAIL":
            return

    info = session.runner_info(
        session.venv_python,
        [w.name for w in manifest.wheels],
        log="venv-info",
        foreign=session.foreign,
        allowed=[line.split("==")[0] for line in manifest.provided],
    )
    if isinstance(info, Completed):
        yield Row(package=house, check="inspect", status="FAIL", detail=info.failure("inspecting the venv"))
        return
    cuobjdump = find_cuobjdump([*info.get("site_dirs", []), *base.get("site_dirs", [])])
    for spec in manifest.ours:
        yield from _verify_wheel(session, manifest, spec, info, cuobjdump, smoke_timeout=smoke_timeout)
    if manifest.closure:
        yield from _closure_rows(session, manifest, info)
    if not session.installed:
        yield _pip_check_row(session, manifest)
    if manifest.environment is not None:
        yield from _environment_rows(session, manifest.environment, smoke_timeout=smoke_timeout)


def _environment_rows(session: _Session, spec: WheelSpec, *, smoke_timeout: float) -> Iterator[Row]:
    """``[runtime] verify``: what the environment as a whole must import and run (the recipe's own checks)."""
    if spec.imports:
        yield _import_row(spec.package, list(spec.imports), _run_checks(session, spec, list(spec.imports), []))
    if spec.smoke:
        yield from _smoke_rows(session, spec, timeout=smoke_timeout)


def _closure_rows(session: _Session, manifest: Manifest, info: Mapping[str, Any]) -> Iterator[Row]:
    """The runtime closure as a whole: every wheel installed from the wheelhouse, every requirement met."""
    prefix = str(Path(info["prefix"]).resolve())
    wrong, unmet = [], []
    for spec in manifest.closure:
        dist = info["dists"].get(spec.name, {"found": False})
        if not dist.get("found"):
            wrong.append(f"{spec.name} not installed")
        elif dist["version"] != spec.version or not dist["location"].startswith(prefix):
            wrong.append(f"{spec.name}: the venv sees {dist['version']} from {dist['location']}")
        unmet += [f"{spec.name} needs {p}" for p in dist.get("requirement_problems", [])]
    n = len(manifest.closure)
    if wrong:
        yield Row(package="closure", check="install", status="FAIL", detail="; ".join(wrong))
    else:
        yield Row(package="closure", check="install", status="PASS", detail=f"{_n(n, 'wheel')} of the runtime closure")
    if unmet:
        yield Row(
            package="closure",
            check="deps",
            status="FAIL",
            detail="the closure lacks: " + "; ".join(unmet) + " (add it to [runtime] and run `doit lock`)",
        )
    else:
        yield Row(package="closure", check="deps", status="PASS", detail="every requirement of the closure is met")


_PIP_CHECK_LINE = re.compile(
    r"^(?P<name>\S+) (?P<version>\S+) (?:requires (?P<missing>\S+), which is not installed"
    r"|has requirement (?P<req>.+), but you have (?P<dep>\S+) (?P<have>\S+))\.?$"
)


def _pip_check_row(session: _Session, manifest: Manifest) -> Row:
    """``pip check`` over everything the venv sees, the base and the wheelhouse: a broken requirement of any
    installed distribution that involves a wheel of ours or of the closure fails (the base's own breakage,
    which the wheelhouse did not cause, is counted, not failed)."""
    done = session.run([*session.pip, "check"], log="pip-check", timeout=TOOL_TIMEOUT_S)
    ours = {_canonical(w.name) for w in manifest.wheels}
    broken, elsewhere, tools = [], 0, []
    for line in done.output.splitlines():
        m = _PIP_CHECK_LINE.match(line.strip())
        if m is None:
            continue
        involved = {_canonical(m.group("name")), _canonical(m.group("missing") or m.group("dep") or "")}
        if _canonical(m.group("name")) in session.tool_own:  # this tool's venv, not what the target holds
            tools.append(m.group("name"))
        elif involved & ours:
            broken.append(line.strip().rstrip("."))
        else:
            elsewhere += 1
    aside = f" ({_n(elsewhere, 'broken requirement')} of the base itself left aside)" if elsewhere else ""
    if tools:
        aside += f" (requirements of this tool's own venv left aside: {', '.join(sorted(set(tools)))})"
    if broken:
        return Row(package="wheelhouse", check="pip-check", status="FAIL",
                   detail="; ".join(broken) + f"{aside}: the wheelhouse breaks what the base holds (keep the base "
                   "whole: name the base in [runtime] (base_python, base_image or base_capture), then "
                   "`doit lock`)")  # fmt: skip
    return Row(package="wheelhouse", check="pip-check", status="PASS",
               detail=f"pip check: no requirement of base or wheelhouse broken by the wheelhouse{aside}")  # fmt: skip


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _is_base_site(path: Path, base: Mapping[str, Any]) -> bool:
    """Whether ``path`` belongs to the base interpreter itself (its base_prefix), not to the venv it runs in."""
    root = str(base.get("base_prefix") or "")
    return bool(root) and path.resolve().is_relative_to(Path(root).resolve())


def _check_hashes(wheel_dir: Path, manifest: Manifest) -> Row:
    problems = []
    for spec in manifest.wheels:
        path = wheel_dir / spec.filename
        if not path.is_file():
            problems.append(f"{spec.filename}: missing")
        elif file_sha256(path) != spec.sha256:
            problems.append(f"{spec.filename}: sha256 differs from the manifest")
    if problems:
        return Row(
            package="wheelhouse",
            check="sha256",
            status="FAIL",
            detail="; ".join(problems) + "; rebuild with `doit wheels`",
        )
    return Row(
        package="wheelhouse",
        check="sha256",
        status="PASS",
        detail=f"{_n(len(manifest.wheels), 'wheel')}: sha256 as in manifest.json",
    )


#: What `doit wheels` writes into wheels/ besides the wheels manifest.json lists.
WHEELHOUSE_FILES = frozenset(
    {"manifest.json", "requirements.txt", "simple", "sbom.cdx.json", provenance.DIRECTORY,
     "preflight.py", "preflight.json"}
)  # fmt: skip


def _check_contents(wheel_dir: Path, manifest: Manifest) -> Row:
    """Nothing in wheels/ that the manifest does not account for (a wheel dropped in by hand, say)."""
    expected = WHEELHOUSE_FILES | {spec.filename for spec in manifest.wheels}
    extra = sorted(p.name for p in wheel_dir.iterdir() if p.name not in expected)
    if extra:
        return Row(
            package="wheelhouse",
            check="contents",
            status="FAIL",
            detail=f"not listed in manifest.json: {', '.join(extra)}; remove them (doit clean wheels; doit wheels)",
        )
    return Row(package="wheelhouse", check="contents", status="PASS", detail="nothing beyond the manifest's wheels")


def _check_provenance(wheel_dir: Path, manifest: Manifest) -> Row:
    problems = provenance.check_statements(wheel_dir, [spec.filename for spec in manifest.wheels])
    if problems:
        return Row(
            package="wheelhouse",
            check="provenance",
            status="FAIL",
            detail="; ".join(problems)
            + "; do not install these wheels: restore them with `doit clean wheels && doit wheels`",
        )
    return Row(
        package="wheelhouse",
        check="provenance",
        status="PASS",
        detail=f"{_n(len(manifest.wheels), 'wheel')}: sha256 as the subject of its in-toto statement",
    )


def _make_venv(session: _Session, base: Mapping[str, Any]) -> Row:
    if session.venv.exists():
        shutil.rmtree(session.venv)
    session.scratch.mkdir(parents=True, exist_ok=True)
    site = [] if session.isolated else ["--system-site-packages"]
    done = session.run([session.python, "-m", "venv", *site, str(session.venv)], log="venv", timeout=TOOL_TIMEOUT_S)
    if not done.ok and "ensurepip" in done.output:
        # A Python without ensurepip (Debian without python3-venv): make the
        # venv without pip and drive the base interpreter's pip into it.
        shutil.rmtree(session.venv, ignore_errors=True)
        done = session.run(
            [session.python, "-m", "venv", *site, "--without-pip", str(session.venv)],
            log="venv",
            timeout=TOOL_TIMEOUT_S,
        )
        session.pip = [session.python, "-m", "pip", "--python", str(session.venv_python)]
    if not done.ok:
        return Row(package="wheelhouse", check="venv", status="FAIL", detail=done.failure("python -m venv"))
    note = ""
    if session.isolated:
        return _provide(session, base)
    if base.get("in_venv"):
        # --system-site-packages reaches the *base* interpreter's packages, not
        # those of a venv we were started from; a .pth file makes them visible,
        # after the scratch venv's own site-packages.
        # Its site directories, and what their own .pth files add (a venv that sees a host's torch through a
        # .pth line, as the GPU hosts' do): a .pth line is not read for .pth files of the directory it adds.
        runner_dir = str(RUNNER.parent)
        pth_dirs: list[str] = []
        # Only directories of installed distributions: an editable install's line names a checkout, which may
        # hold the scratch venv itself (a checkout's build/verify/venv), and would make it the tool's own.
        for d in [*base.get("site_dirs", []), *base.get("sys_path", [])]:
            if d in pth_dirs or d == runner_dir or not Path(d).is_dir():
                continue
            if session.venv.resolve().is_relative_to(Path(d).resolve()):
                continue
            if d in base.get("site_dirs", []) or (
                not _is_base_site(Path(d), base) and next(Path(d).glob("*.dist-info"), None) is not None
            ):
                pth_dirs.append(d)
        for site_dir in _venv_site_dirs(session.venv):
            write_atomic(site_dir / "_repro_verify_base.pth", "".join(f"{d}\n" for d in pth_dirs))
        session.foreign = [str(d) for d in pth_dirs if not _is_base_site(Path(d), base)]
        if Path(str(base.get("prefix", ""))).resolve() == Path(sys.prefix).resolve():  # this tool's own venv
            provided = {_canonical(line.split("==")[0]) for line in session.provided}
            session.tool_own = _tool_closure() - provided
        note = f"; base venv {base.get('prefix')} visible through a .pth file (for what [runtime] provides only)"
    return Row(
        package="wheelhouse",
        check="venv",
        status="PASS",
        detail=f"{session.venv} (Python {base.get('python')}, --system-site-packages){note}",
    )


def _tool_closure() -> set[str]:
    """reprostack and every distribution it requires, transitively, as installed for this interpreter."""
    # Here, not at the top: inside an image (tasks/verify/incontainer.py) this module has only the standard
    # library and KIT_DEPENDENCIES (tasks/verify/image.py), and the tool's venv is never the base there.
    from packaging.requirements import InvalidRequirement, Requirement

    seen: set[str] = set()
    todo = ["reprostack"]
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for line in requires:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _provide(session: _Session, base: Mapping[str, Any]) -> Row:
    """Make the provided set visible in the isolated venv: each distribution's files, linked from the base
    interpreter into one directory that a .pth file adds to the venv's path."""
    wanted = [line.split("==")[0] for line in session.provided]  # "name==version", or "name": any version
    # The provided version wherever it is on the interpreter's path: doit's own venv may put another
    # copy (its pinned filelock, say) in front of the base's.
    pinned = {line.split("==")[0]: line.split("==", 1)[1] for line in session.provided if "==" in line}
    found = session.runner_info(session.python, wanted, log="provided-info", versions=pinned)
    if isinstance(found, Completed):
        return Row(
            package="wheelhouse", check="venv", status="FAIL", detail=found.failure("inspecting the provided set")
        )
    # What the target provides includes what those distributions themselves need (torch's own
    # dependencies, say): their requirements, followed in the base interpreter's environment.
    names = list(wanted)
    todo = [d for d in found["dists"].values() if d.get("found")]
    while todo:
        more = {_requirement_name(r) for d in todo for r in d.get("requires", []) if "extra ==" not in r} - set(names)
        if not more:
            break
        extra = session.runner_info(session.python, sorted(more), log="provided-info")
        if isinstance(extra, Completed):
            break
        names += sorted(more)
        todo = [d for d in extra["dists"].values() if d.get("found")]
        found["dists"].update({k: v for k, v in extra["dists"].items() if v.get("found")})
    missing = []
    shared = session.scratch / "provided"
    shutil.rmtree(shared, ignore_errors=True)
    shared.mkdir(parents=True)
    for name in names[len(wanted) :]:
        dist = found["dists"].get(name, {"found": False})
        if dist.get("found"):
            location = Path(dist["location"])
            tops = {Path(f).relative_to(location).parts[0] for f in dist["files"] if Path(f).is_relative_to(location)}
            for top in sorted(tops):
                if not top.startswith(".."):
                    _link_merged(location / top, shared / top)
    for line, name in zip(session.provided, wanted, strict=True):
        dist = found["dists"].get(name, {"found": False})
        version = line.split("==", 1)[1] if "==" in line else ""
        if not dist.get("found"):
            missing.append(f"{line} (not installed for {session.python})")
            continue
        if version and dist["version"].split("+")[0] != version.split("+")[0]:
            missing.append(f"{line} (the base interpreter has {dist['version']})")
        location = Path(dist["location"])
        tops = {Path(f).relative_to(location).parts[0] for f in dist["files"] if Path(f).is_relative_to(location)}
        for top in sorted(tops):
            if not top.startswith(".."):
                _link_merged(location / top, shared / top)
    for site_dir in _venv_site_dirs(session.venv):
        write_atomic(site_dir / "_repro_provided.pth", f"{shared}\n")
    if missing:
        return Row(
            package="wheelhouse",
            check="venv",
            status="FAIL",
            detail="the target must provide, but the base interpreter lacks: " + "; ".join(missing),
        )
    return Row(
        package="wheelhouse",
        check="venv",
        status="PASS",
        detail=f"{session.venv}: isolated (no system site-packages), sees {_n(len(wanted), 'provided distribution')}"
        f" and the {_n(len(names) - len(wanted), 'distribution')} they need",
    )


def _requirement_name(line: str) -> str:
    """The distribution a requirement line names (``torch>=2; python_version>'3'`` -> ``torch``)."""
    return re.split(r"[\s;<>=!~\[(]", line.strip(), maxsplit=1)[0]


def _link_merged(src: Path, dest: Path) -> None:
    """Link ``src`` at ``dest``; where two distributions share a directory (namespace packages such as
    ``nvidia/``), ``dest`` becomes a real directory holding links to both's entries."""
    if not dest.exists() and not dest.is_symlink():
        dest.symlink_to(src)
        return
    if not (src.is_dir() and dest.is_dir()):
        return  # the same file from two distributions: the first stays
    if dest.is_symlink():
        previous = dest.resolve()
        dest.unlink()
        dest.mkdir()
        for child in previous.iterdir():
            _link_merged(child, dest / child.name)
    for child in src.iterdir():
        _link_merged(child, dest / child.name)


def _use_installed(session: _Session, base: Mapping[str, Any]) -> Row:
    """Check ``session.python``'s own environment instead of a scratch venv."""
    session.venv = Path(str(base["prefix"]))
    session.venv_python = Path(session.python)
    session.env = child_env(session.venv, session.gpu)
    session.scratch.mkdir(parents=True, exist_ok=True)
    return Row(
        package="wheelhouse",
        check="installed",
        status="PASS",
        detail=f"checking what {session.python} (Python {base.get('python')}, prefix {session.venv}) has installed",
    )


def _venv_site_dirs(venv: Path) -> list[Path]:
    return sorted(p for p in venv.glob("lib*/python*/site-packages") if p.is_dir())


def _install(session: _Session) -> Row:
    requirements = session.wheel_dir / "requirements.txt"
    if not requirements.is_file():
        return Row(
            package="wheelhouse",
            check="install",
            status="FAIL",
            detail=f"{requirements} does not exist; rebuild the wheelhouse with `doit wheels`",
        )
    done = session.run(
        [
            *session.pip, "install",
            "--no-index", "--no-deps", "--ignore-installed", "--require-hashes",
            "--find-links", str(session.wheel_dir),
            "-r", str(requirements),
        ],
        log="install",
        timeout=TOOL_TIMEOUT_S,
    )  # fmt: skip
    if not done.ok:
        return Row(package="wheelhouse", check="install", status="FAIL", detail=done.failure("pip install"))
    return Row(
        package="wheelhouse",
        check="install",
        status="PASS",
        detail="pip install --no-index --no-deps --require-hashes -r requirements.txt",
    )


@dataclass(frozen=True, kw_only=True)
class _Installed:
    """One installed wheel as the venv's interpreter sees it."""

    location: Path
    files: tuple[Path, ...]
    top_level: tuple[str, ...]
    shared_objects: tuple[Path, ...]
    extension_modules: tuple[str, ...]


def _installed(dist: Mapping[str, Any], ext_suffixes: Sequence[str]) -> _Installed:
    location = Path(dist["location"])
    files = tuple(Path(f) for f in dist["files"])
    shared = tuple(f for f in files if is_shared_object_name(f.name) and elfcheck.is_elf(f))
    modules = []
    for f in shared:
        try:
            rel = f.relative_to(location)
        except ValueError:
            continue
        name = module_name(rel.as_posix(), ext_suffixes)
        # A library named like an extension that exports no PyInit_ is not a
        # module (torch_memory_saver's LD_PRELOAD hooks): it is dlopened only.
        if name is not None and f"PyInit_{name.rpartition('.')[2]}" in elfcheck.defined_symbols(f):
            modules.append(name)
    return _Installed(
        location=location,
        files=files,
        top_level=tuple(dist.get("top_level", [])),
        shared_objects=shared,
        extension_modules=tuple(modules),
    )


def _verify_wheel(
    session: _Session,
    manifest: Manifest,
    spec: WheelSpec,
    info: Mapping[str, Any],
    cuobjdump: Path | None,
    *,
    smoke_timeout: float,
) -> Iterator[Row]:
    pkg = spec.package
    dist = info["dists"].get(spec.name, {"found": False})
    if not dist.get("found"):
        yield Row(package=pkg, check="install", status="FAIL", detail=f"{spec.name} is not installed in {session.venv}")
        return
    venv_prefix = str(Path(info["prefix"]).resolve())
    if dist["version"] != spec.version or not dist["location"].startswith(venv_prefix):
        yield Row(
            package=pkg,
            check="install",
            status="FAIL",
            detail=(
                f"the venv sees {spec.name} {dist['version']} from {dist['location']}, "
                f"expected {spec.version} from the wheelhouse"
            ),
        )
        return
    installed = _installed(dist, info["ext_suffixes"])

    problems = dist.get("requirement_problems", [])
    if not spec.deps:
        yield Row(package=pkg, check="deps", status="SKIP", detail="deps = false in the lock: installed without them")
    elif problems:
        yield Row(package=pkg, check="deps", status="FAIL", detail="unmet: " + "; ".join(problems))
    else:
        yield Row(package=pkg, check="deps", status="PASS", detail="all requirements met")

    if spec.origin == "prebuilt":
        # Placed as it is, built elsewhere: its imports and smoke test are ours to check, its binaries are not.
        imports = list(spec.imports or installed.top_level)
        yield _import_row(pkg, imports, _run_checks(session, spec, imports, []))
        if spec.smoke:
            yield from _smoke_rows(session, spec, timeout=smoke_timeout)
        return
    imports = list(dict.fromkeys([*(spec.imports or installed.top_level), *installed.extension_modules]))
    results = _run_checks(session, spec, imports, installed.shared_objects)
    yield _import_row(pkg, imports, results)

    elf_infos, elf_errors = _read_elves(installed.shared_objects)
    yield _libs_row(pkg, installed, results, elf_infos, elf_errors)
    yield _symbols_row(session, pkg, installed, results, elf_infos, info.get("torch_lib"))
    yield _arch_row(session, manifest, spec, installed, elf_infos, cuobjdump)
    if spec.smoke:
        yield from _smoke_rows(session, spec, timeout=smoke_timeout)


def _run_checks(
    session: _Session, spec: WheelSpec, imports: Sequence[str], shared: Sequence[Path]
) -> dict[tuple[str, str], _ItemResult]:
    """Run the imports and dlopens in the venv, one process per wheel; after a
    crash, blame the item that was running and go on in a fresh process."""
    items = [("import", m) for m in imports] + [("dlopen", str(p)) for p in shared]
    results: dict[tuple[str, str], _ItemResult] = {}
    preload: list[str] = []
    log = f"{spec.package}.check"
    for attempt in range(MAX_RUNNER_RESTARTS + 1):
        todo = [item for item in items if item not in results]  # preload keys never match
        if not todo:
            break
        request = session.scratch / f"{_safe(spec.package)}.check.{attempt}.json"
        out = session.scratch / f"{_safe(spec.package)}.check.{attempt}.jsonl"
        write_atomic(request, json.dumps({"preload": preload, "items": [{"kind": k, "target": t} for k, t in todo]}))
        out.unlink(missing_ok=True)
        done = session.run(
            [str(session.venv_python), str(RUNNER), "check", str(request), str(out)], log=log, timeout=RUNNER_TIMEOUT_S
        )
        running: tuple[str, str] | None = None
        for event in _read_events(out):
            key = (str(event["kind"]), str(event["target"]))
            if event["phase"] == "start":
                running = key
                continue
            running = None
            if key[0] == "preload" and (event["ok"] or attempt > 0):
                continue  # a preload failure is reported once, on the first attempt
            results[key] = _ItemResult(
                kind=key[0], target=key[1], ok=bool(event["ok"]), error=str(event.get("error", ""))
            )
        if done.ok:
            for kind, target in todo:
                results.setdefault(
                    (kind, target),
                    _ItemResult(
                        kind=kind, target=target, ok=False, error=f"no result from the runner; log: {done.log}"
                    ),
                )
            break
        why = done.failure("verify_runner")
        if running is None or running[0] == "preload":
            # Died outside any item (while importing torch, or at exit):
            # nothing more can be learned by restarting.
            where = f"while importing {running[1]}" if running else "outside the checks"
            for kind, target in todo:
                results.setdefault(
                    (kind, target), _ItemResult(kind=kind, target=target, ok=False, error=f"runner died {where}: {why}")
                )
            break
        results[running] = _ItemResult(kind=running[0], target=running[1], ok=False, error=f"crashed: {why}")
        preload = [t for (k, t), r in results.items() if k == "import" and r.ok]
    return results


def _read_events(path: Path) -> Iterator[dict[str, Any]]:
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(event, dict) and {"phase", "kind", "target"} <= event.keys():
            yield event


def _import_row(pkg: str, imports: Sequence[str], results: Mapping[tuple[str, str], _ItemResult]) -> Row:
    if not imports:
        return Row(
            package=pkg,
            check="import",
            status="FAIL",
            detail="nothing to import: no verify.imports and no top-level package found",
        )
    failed = [r for (kind, _), r in results.items() if kind == "preload" and not r.ok]
    failed += [results[("import", m)] for m in imports if not results[("import", m)].ok]
    if failed:
        return Row(
            package=pkg, check="import", status="FAIL", detail="\n".join(f"{r.target}: {r.error}" for r in failed)
        )
    return Row(package=pkg, check="import", status="PASS", detail=f"{_n(len(imports), 'module')}: {', '.join(imports)}")


def _read_elves(paths: Sequence[Path]) -> tuple[dict[Path, elfcheck.ElfInfo], dict[Path, str]]:
    infos: dict[Path, elfcheck.ElfInfo] = {}
    errors: dict[Path, str] = {}
    for path in paths:
        try:
            infos[path] = elfcheck.read_elf(path)
        except (OSError, ValueError) as exc:
            errors[path] = str(exc)
    return infos, errors


def _short(path: Path, installed: _Installed) -> str:
    try:
        return path.relative_to(installed.location).as_posix()
    except ValueError:
        return str(path)


def _libs_row(
    pkg: str,
    installed: _Installed,
    results: Mapping[tuple[str, str], _ItemResult],
    elves: Mapping[Path, elfcheck.ElfInfo],
    elf_errors: Mapping[Path, str],
) -> Row:
    if not installed.shared_objects:
        return Row(package=pkg, check="libs", status="SKIP", detail="no shared objects in the wheel")
    problems = [f"{_short(p, installed)}: {e}" for p, e in elf_errors.items()]
    for path in installed.shared_objects:
        result = results[("dlopen", str(path))]
        if result.ok or elfcheck.undefined_symbol(result.error):
            continue
        name = _short(path, installed)
        missing = elfcheck.missing_library(result.error)
        if missing is None:
            problems.append(f"{name}: {result.error}")
            continue
        elf = elves.get(path)
        search = ""
        if elf is not None:
            paths = elf.runpath or elf.rpath
            search = (
                f" (searched {'RUNPATH' if elf.runpath else 'RPATH'} {':'.join(paths)})"
                if paths
                else " (no RPATH/RUNPATH)"
            )
        problems.append(f"{name}: needs {missing}, not found{search}")
    if problems:
        return Row(package=pkg, check="libs", status="FAIL", detail="\n".join(problems))
    needed = sorted({lib for elf in elves.values() for lib in elf.needed if not _SYSTEM_LIB.match(lib)})
    return Row(
        package=pkg,
        check="libs",
        status="PASS",
        detail=(
            f"{_n(len(installed.shared_objects), 'shared object')}: all load with RTLD_NOW; "
            f"NEEDED beyond the C/C++ runtime: {', '.join(needed) or 'none'}"
        ),
    )


def _symbols_row(
    session: _Session,
    pkg: str,
    installed: _Installed,
    results: Mapping[tuple[str, str], _ItemResult],
    elves: Mapping[Path, elfcheck.ElfInfo],
    torch_lib: str | None,
) -> Row:
    if not installed.shared_objects:
        return Row(package=pkg, check="symbols", status="SKIP", detail="no shared objects in the wheel")
    problems = []
    for path in installed.shared_objects:
        result = results[("dlopen", str(path))]
        symbol = elfcheck.undefined_symbol(result.error) if not result.ok else None
        if symbol is not None:
            (pretty,) = session.demangle([symbol])
            problems.append(f"{_short(path, installed)}: undefined symbol {pretty} ({symbol})")

    wanted = {path: elfcheck.torch_namespace(elf.undefined) for path, elf in elves.items()}
    checked = ""
    if any(wanted.values()):
        if torch_lib is None:
            problems.append("the wheel uses c10/at/torch symbols but torch is not installed in the venv")
        else:
            torch_index = session.torch_index(Path(torch_lib))
            own_index = elfcheck.SymbolIndex(elves.keys())
            for path, names in wanted.items():
                missing = [n for n in torch_index.missing(names) if own_index.provider(n) is None]
                if missing:
                    shown = session.demangle(missing[:3])
                    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                    problems.append(
                        f"{_short(path, installed)}: {len(missing)} torch symbols not defined by "
                        f"{torch_lib}: {'; '.join(shown)}{more}"
                    )
            checked = f"; {sum(map(len, wanted.values()))} c10/at/torch references resolved in {torch_lib}"
    if problems:
        return Row(package=pkg, check="symbols", status="FAIL", detail="\n".join(problems))
    return Row(package=pkg, check="symbols", status="PASS", detail=f"no undefined symbols at load{checked}")


def _arch_row(
    session: _Session,
    manifest: Manifest,
    spec: WheelSpec,
    installed: _Installed,
    elves: Mapping[Path, elfcheck.ElfInfo],
    cuobjdump: Path | None,
) -> Row:
    pkg = spec.package
    device = [path for path, elf in elves.items() if elf.has_fatbin]
    if not device:
        if spec.cuda:
            return Row(
                package=pkg,
                check="arch",
                status="FAIL",
                detail="manifest says cuda: true but no shared object carries a CUDA fatbinary",
            )
        return Row(package=pkg, check="arch", status="SKIP", detail="no device code (cuda: false)")
    if not manifest.archs:
        return Row(
            package=pkg, check="arch", status="FAIL", detail="device code found but the manifest lists no target archs"
        )
    if cuobjdump is None:
        return Row(package=pkg, check="arch", status="FAIL", detail=f"cuobjdump not found: {CUOBJDUMP_HINT}")
    problems = []
    seen = []
    for path in device:
        name = _short(path, installed)
        listings = []
        for flag in ("--list-elf", "--list-ptx"):
            done = session.run([str(cuobjdump), flag, str(path)], log=f"{pkg}.cuobjdump", timeout=TOOL_TIMEOUT_S)
            if done.timed_out or (done.returncode != 0 and "does not contain device code" not in done.output):
                problems.append(f"{name}: {done.failure(f'cuobjdump {flag}')}")
            listings.append(done.output)
        code = parse_cuobjdump(*listings)
        wrong = arch_problems(code, manifest.archs)
        if wrong:
            problems.append(f"{name}: {'; '.join(wrong)} [{describe_device_code(code)}]")
        seen.append(f"{name}: {describe_device_code(code)}")
    if problems:
        return Row(package=pkg, check="arch", status="FAIL", detail="\n".join(problems))
    return Row(
        package=pkg,
        check="arch",
        status="PASS",
        detail=f"{_n(len(device), 'object')} with SASS for {', '.join(manifest.archs)}: " + "; ".join(seen),
    )


_SMOKE_STATUSES = ("PASS", "FAIL", "SKIP")


def parse_smoke_output(text: str) -> list[tuple[str, Status, str]]:
    """The ``{"check", "status", "detail"}`` JSON lines of a smoke script."""
    found: list[tuple[str, Status, str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(data, dict) or data.get("status") not in _SMOKE_STATUSES or "check" not in data:
            continue
        status: Status = data["status"]
        found.append((str(data["check"]), status, str(data.get("detail", ""))))
    return found


def _smoke_rows(session: _Session, spec: WheelSpec, *, timeout: float) -> Iterator[Row]:
    assert spec.smoke is not None
    pkg = spec.package
    script = SMOKE_DIR / f"{spec.smoke}.py"
    if not script.is_file():
        yield Row(package=pkg, check="smoke", status="FAIL", detail=f"no smoke script {script}")
        return
    # Run a copy under another name: a script named like its package
    # (flash_attn.py) would otherwise import itself instead of the package.
    work = session.scratch / "smoke"
    work.mkdir(parents=True, exist_ok=True)
    copy = work / f"smoke_{spec.smoke}.py"
    shutil.copyfile(script, copy)
    shutil.copyfile(SMOKE_DIR / "_harness.py", work / "_harness.py")
    done = session.run([str(session.venv_python), str(copy)], log=f"{pkg}.smoke", timeout=timeout, cwd=work)
    found = parse_smoke_output(done.output)
    for check, status, detail in found:
        yield Row(package=pkg, check=f"smoke:{check}", status=status, detail=detail)
    if done.timed_out:
        yield Row(package=pkg, check="smoke", status="FAIL", detail=f"timed out after {timeout:g} s; log: {done.log}")
    elif not done.ok:
        yield Row(package=pkg, check="smoke", status="FAIL", detail=done.failure(f"smoke script {script.name}"))
    elif not found:
        yield Row(
            package=pkg, check="smoke", status="FAIL", detail=f"{script.name} reported no checks; log: {done.log}"
        )
