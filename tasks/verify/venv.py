"""Where verify installs the wheelhouse and runs its checks, behind one protocol (pypa/build's IsolatedEnv).

- :class:`SharedVenv`: a scratch venv with ``--system-site-packages`` over the base interpreter (its torch);
  where the base is itself a venv, its site directories through a ``.pth`` file. What only this tool's own
  venv has does not meet a requirement (the session's ``foreign`` directories, ``tool_own``).
- :class:`IsolatedVenv` (``isolated=on``): a scratch venv that sees no site-packages of the base, only the
  distributions the lock's ``[runtime] provided`` names, and what they need, linked in from the base.
- :class:`InstalledEnv`: no venv; the environment of ``python`` itself (the runtime image's).

This tool's own venv (the checkout's ``.venv``, a ``--system-site-packages`` venv over the base, pipx's) holds
the tool's pinned dependencies, which the base interpreter may see before its own copies: its site directories
are kept apart (:func:`apart`): the isolated venv links nothing from them, the shared one sees them after the
base's. They are the base only where the provided set itself is installed there (a checkout's venv into which
torch was installed).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import sys
import sysconfig
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from tasks.core.fsutil import write_atomic
from tasks.core.proc import Completed
from tasks.verify.report import Row
from tasks.verify.session import RUNNER, TOOL_TIMEOUT_S, VerifySession, _n, child_env


class VerifyEnv(Protocol):
    """An environment to verify in: made (or found) for a session, then given the wheelhouse."""

    def prepare(self, session: VerifySession, base: Mapping[str, Any]) -> Row:
        """Make the environment (``session.venv``, ``session.venv_python``, ``session.pip``); the ``venv`` row."""
        ...

    def install(self, session: VerifySession) -> Row | None:
        """Install the wheelhouse offline, hash-pinned; the ``install`` row (None: nothing to install)."""
        ...


class SharedVenv:
    """A scratch venv over the base interpreter's site-packages."""

    def prepare(self, session: VerifySession, base: Mapping[str, Any]) -> Row:
        return _make_venv(session, base)

    def install(self, session: VerifySession) -> Row | None:
        return _install(session)


class IsolatedVenv(SharedVenv):
    """A scratch venv that sees the base's provided set only."""


class InstalledEnv:
    """The environment of the session's ``python`` itself: nothing made, nothing installed."""

    def prepare(self, session: VerifySession, base: Mapping[str, Any]) -> Row:
        return _use_installed(session, base)

    def install(self, session: VerifySession) -> Row | None:
        return None


def for_session(session: VerifySession) -> VerifyEnv:
    """The environment a session asks for (``installed``, ``isolated``, else shared)."""
    if session.installed:
        return InstalledEnv()
    return IsolatedVenv() if session.isolated else SharedVenv()


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _is_base_site(path: Path, base: Mapping[str, Any]) -> bool:
    """Whether ``path`` belongs to the base interpreter itself (its base_prefix), not to the venv it runs in."""
    root = str(base.get("base_prefix") or "")
    return bool(root) and path.resolve().is_relative_to(Path(root).resolve())


#: What a venv is made with, beside the tool: never a reason to count the tool's venv as the base.
_VENV_SEEDS = frozenset({"pip", "setuptools", "wheel"})


def tool_site_dirs() -> list[str]:
    """The site directories of the venv this tool runs in (none outside a venv): where its own pinned
    dependencies are installed."""
    if sys.prefix == sys.base_prefix:
        return []
    paths = sysconfig.get_paths()
    return sorted({os.path.realpath(paths[key]) for key in ("purelib", "platlib")})


def apart(session: VerifySession, base: Mapping[str, Any]) -> tuple[list[str], str]:
    """The site directories of this tool's own venv that the base interpreter sees and that are not the base,
    with a note for the ``venv`` row: those the interpreter's path holds, unless the provided set (what of it is
    not the tool's own, nor pip, setuptools or wheel) is installed there and nowhere else (torch installed into
    a checkout's venv: that venv is then the base)."""
    seen = {os.path.realpath(d) for d in [*base.get("site_dirs", []), *base.get("sys_path", [])]}
    own = [d for d in tool_site_dirs() if d in seen]
    if not own:
        return [], ""
    wanted = {_canonical(line.split("==")[0]): line.partition("==")[2] for line in session.provided}
    if wanted:
        found = session.runner_info(session.python, sorted(wanted), log="provided-where",
                                    versions={n: v for n, v in wanted.items() if v}, hide=own)  # fmt: skip
        if not isinstance(found, Completed):
            tool = _tool_closure() | _VENV_SEEDS
            dists = {n: d for n, d in found["dists"].items() if n not in tool}
            only = sorted(n for n, d in dists.items() if d.get("hidden"))
            if only and not any(d.get("found") for d in dists.values()):
                return [], f"; this tool's venv {own[0]} holds {_some(only)} of the provided set: it is the base here"
    return own, f"; this tool's own venv {own[0]} kept apart: none of its distributions stands in for the base's"


def _some(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _make_venv(session: VerifySession, base: Mapping[str, Any]) -> Row:
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
    session.apart, apart_note = apart(session, base)
    note = ""
    if session.isolated:
        return _provide(session, base, apart_note)
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
        # This tool's own venv after every directory of the base: its pins never in front of the base's copies.
        pth_dirs.sort(key=lambda d: os.path.realpath(d) in session.apart)
        for site_dir in _venv_site_dirs(session.venv):
            write_atomic(site_dir / "_repro_verify_base.pth", "".join(f"{d}\n" for d in pth_dirs))
        session.foreign = [str(d) for d in pth_dirs if not _is_base_site(Path(d), base)]
        if Path(str(base.get("prefix", ""))).resolve() == Path(sys.prefix).resolve():  # this tool's own venv
            provided = {_canonical(line.split("==")[0]) for line in session.provided}
            session.tool_own = _tool_closure() - provided
        note = f"; base venv {base.get('prefix')} visible through a .pth file (for what [runtime] provides only)"
    note += apart_note
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


def _provide(session: VerifySession, base: Mapping[str, Any], apart_note: str = "") -> Row:
    """Make the provided set visible in the isolated venv: each distribution's files, linked from the base
    interpreter into one directory that a .pth file adds to the venv's path; never a copy in this tool's own
    venv (``session.apart``), whatever the base interpreter sees first.

    A provided distribution the base lacks, or holds at another version, fails the row when a wheel needs it
    (preflight.json's ``needs``, the rule of `doit preflight`); otherwise it is a note."""
    lines = {_canonical(line.split("==")[0]): line for line in session.provided}  # "name==version", or "name"
    wanted = list(lines)
    # The provided version wherever it is on the interpreter's path: doit's own venv may put another
    # copy (its pinned filelock, say) in front of the base's.
    pinned = {name: line.split("==", 1)[1] for name, line in lines.items() if "==" in line}
    found = session.runner_info(session.python, wanted, log="provided-info", versions=pinned, hide=session.apart)
    if isinstance(found, Completed):
        return Row(
            package="wheelhouse", check="venv", status="FAIL", detail=found.failure("inspecting the provided set")
        )
    # What the target provides includes what those distributions themselves need (torch's own
    # dependencies, say): their requirements, followed in the base interpreter's environment.
    names = list(wanted)
    todo = [d for d in found["dists"].values() if d.get("found")]
    while todo:
        more = {_canonical(_requirement_name(r)) for d in todo for r in d.get("requires", []) if "extra ==" not in r}
        more -= set(names)
        if not more:
            break
        extra = session.runner_info(session.python, sorted(more), log="provided-info", hide=session.apart)
        if isinstance(extra, Completed):
            break
        names += sorted(more)
        todo = [d for d in extra["dists"].values() if d.get("found")]
        found["dists"].update({k: v for k, v in extra["dists"].items() if v.get("found")})
    shared = session.scratch / "provided"
    shutil.rmtree(shared, ignore_errors=True)
    shared.mkdir(parents=True)
    for name in names:  # the provided set first: where two hold one file, the first linked stays
        dist = found["dists"].get(name, {"found": False})
        if dist.get("found"):
            location = Path(dist["location"])
            tops = {Path(f).relative_to(location).parts[0] for f in dist["files"] if Path(f).is_relative_to(location)}
            for top in sorted(tops):
                if not top.startswith(".."):
                    _link_merged(location / top, shared / top)
    from tasks.outside.preflight import satisfies

    needed = _needed(session)
    missing, drift = [], []
    for name, line in lines.items():
        dist = found["dists"].get(name, {"found": False})
        version = line.split("==", 1)[1] if "==" in line else ""
        users, specifiers = (needed or {}).get(name, ([], None))
        is_needed = needed is None or name in needed
        problem = ""
        if not dist.get("found"):
            elsewhere = "; this tool's own venv has one, which does not count" if dist.get("hidden") else ""
            problem = f"{line} (not installed for {session.python}{elsewhere})"
        elif version and dist["version"].split("+")[0] != version.split("+")[0]:
            problem = f"{line} (the base interpreter has {dist['version']})"
            refused = [s for s in specifiers or [] if not satisfies(dist["version"], s)]
            if is_needed and specifiers is not None and not refused:
                drift.append(problem)  # another version than captured, which what needs it accepts (as preflight)
                continue
            if refused:
                problem += f", not {','.join(refused)}"
        if problem and is_needed:
            missing.append(problem + (f" needed by {_some(users, 2)}" if users else ""))
        elif problem:
            drift.append(problem)
    for site_dir in _venv_site_dirs(session.venv):
        write_atomic(site_dir / "_repro_provided.pth", f"{shared}\n")
    note = ""
    if drift:
        verb = "differs" if len(drift) == 1 else "differ"
        note = (f"; note: {_n(len(drift), 'distribution')} of the captured base {verb} where the wheels do not care: "
                f"{'; '.join(drift[:6])}{' ...' if len(drift) > 6 else ''}")  # fmt: skip
    if missing:
        return Row(
            package="wheelhouse",
            check="venv",
            status="FAIL",
            detail="the target must provide, and the wheels need, but the base interpreter lacks: "
            + "; ".join(missing)
            + note,
        )
    return Row(
        package="wheelhouse",
        check="venv",
        status="PASS",
        detail=f"{session.venv}: isolated (no system site-packages), sees {_n(len(wanted), 'provided distribution')}"
        f" and the {_n(len(names) - len(wanted), 'distribution')} they need{apart_note}{note}",
    )


def _needed(session: VerifySession) -> dict[str, tuple[list[str], list[str] | None]] | None:
    """canonical name -> the wheels that need that provided distribution and the version specifiers they need it
    at (None: its captured version), from the wheelhouse's preflight.json (read as the node's checker reads it);
    None (every provided distribution needed) without one of format 2 or later."""
    from tasks.outside import preflight

    try:
        spec = preflight.load_spec(str(session.wheel_dir))
    except (OSError, ValueError):
        return None
    return preflight.needed_provided(spec) if spec["format"] >= 2 else None


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


def _use_installed(session: VerifySession, base: Mapping[str, Any]) -> Row:
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


def _install(session: VerifySession) -> Row:
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
