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

With ``train=True`` (``doit verify train=on``), the ``training`` rows close the report: a few FP8 MoE training
steps of a tiny megatron_core GPT on every GPU, launched by torchrun in the venv (tasks/verify/train.py).

Before installing, ``sha256`` checks each wheel against ``manifest.json`` and
``provenance`` against the subject digest of its in-toto statement
(``wheels/provenance/``).

The result is a :class:`Report`, also written to ``report.json`` and
``report.txt`` in the work directory. ``run_verify`` raises
:class:`~tasks.core.errors.VerifyFailed` when any check fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tasks.core.errors import ReproError, VerifyFailed
from tasks.core.fsutil import write_atomic
from tasks.core.proc import Completed
from tasks.core.proc import signal_text as signal_text  # verify.signal_text, as it was
from tasks.core.treehash import file_sha256
from tasks.stages import provenance
from tasks.store.manifest import MODULE_PATTERN, Manifest, WheelSpec, load_manifest
from tasks.verify import elfcheck
from tasks.verify.cuda import (
    CUOBJDUMP_HINT,
    arch_problems,
    describe_device_code,
    find_cuobjdump,
    parse_cuobjdump,
)
from tasks.verify.report import Report, Row, Status, one_line
from tasks.verify.session import (
    GPU_MODES,
    MAX_RUNNER_RESTARTS,
    RUNNER,
    RUNNER_TIMEOUT_S,
    SMOKE_DIR,
    SMOKE_TIMEOUT_S,
    TOOL_TIMEOUT_S,
    GpuMode,
    VerifySession,
    _ItemResult,
    _n,
    _safe,
)
from tasks.verify.train import TRAIN_TIMEOUT_S, train_rows
from tasks.verify.venv import _canonical, for_session

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


# --------------------------------------------------------------------------
# The run


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
    train: bool = False,
    train_timeout: float = TRAIN_TIMEOUT_S,
) -> Report:
    """Install ``wheel_dir`` into a fresh venv under ``work_dir`` and check it.

    With ``isolated=True`` the venv does not see the base interpreter's site-packages, only the
    distributions manifest.json's runtime section says the target provides (linked in from the base
    interpreter): so every requirement the wheelhouse does not carry shows up as unmet.

    With ``installed=True`` nothing is installed: the checks run on the
    environment of ``python`` itself, where the wheelhouse must already be
    installed (the runtime image's venv, see tasks/verify/image.py).

    With ``train=True`` the training check runs last (tasks/verify/train.py), given ``train_timeout`` seconds.

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
    session = VerifySession(
        wheel_dir=wheel_dir,
        work_dir=work_dir,
        python=str(Path(resolved).absolute()),
        gpu=cast(GpuMode, gpu),  # checked against GPU_MODES above
        log_dir=Path(log_dir).resolve() if log_dir is not None else work_dir / "logs",
        installed=installed,
        isolated=isolated,
    )
    session.provided = manifest.provided
    rows = list(_verify(session, manifest, smoke_timeout=smoke_timeout, train=train, train_timeout=train_timeout))
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
    if any(row.package == "training" for row in failures):
        said.append(
            "The training check (train=on): its first failed row names the missing component, or the rank, run and"
            " step that failed; each rank's output is in train.rank<R>.log beside the other logs, torchrun's in "
            "train.log, the loss curves and figures in train.json of the work directory."
        )
    recipe = ("install", "import", "libs", "symbols", "arch")
    if not said or any(
        (row.check in recipe or row.check.startswith("smoke")) and "No module named" not in row.detail
        for row in failures
        if row.package not in ("wheelhouse", "closure", "environment", "training")
    ):
        said.append("The wheel's recipe or patches: fix them, rebuild with `doit wheels`, then rerun `doit verify`.")
    return " ".join(said)


_SYSTEM_LIB = re.compile(r"^(ld-linux.*|lib(c|m|dl|rt|pthread|util|gcc_s|stdc\+\+)\.so(\.\d+)*)$")


def _verify(
    session: VerifySession,
    manifest: Manifest,
    *,
    smoke_timeout: float,
    train: bool = False,
    train_timeout: float = TRAIN_TIMEOUT_S,
) -> Iterator[Row]:
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
    env = for_session(session)
    venv_row = env.prepare(session, base)
    yield venv_row
    if venv_row.status == "FAIL":
        return
    install_row = env.install(session)
    if install_row is not None:
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
    if train:
        yield from train_rows(session, timeout=train_timeout)


def _environment_rows(session: VerifySession, spec: WheelSpec, *, smoke_timeout: float) -> Iterator[Row]:
    """``[runtime] verify``: what the environment as a whole must import and run (the recipe's own checks)."""
    if spec.imports:
        yield _import_row(spec.package, list(spec.imports), _run_checks(session, spec, list(spec.imports), []))
    if spec.smoke:
        yield from _smoke_rows(session, spec, timeout=smoke_timeout)


def _closure_rows(session: VerifySession, manifest: Manifest, info: Mapping[str, Any]) -> Iterator[Row]:
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


def _pip_check_row(session: VerifySession, manifest: Manifest) -> Row:
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
    session: VerifySession,
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
    session: VerifySession, spec: WheelSpec, imports: Sequence[str], shared: Sequence[Path]
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
    session: VerifySession,
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
    session: VerifySession,
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


def _smoke_rows(session: VerifySession, spec: WheelSpec, *, timeout: float) -> Iterator[Row]:
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
