"""Checks that must run inside the verification venv's own interpreter.

A standalone script: standard library only, any Python from 3.8 on, because
it runs under the interpreter being verified, not the one running doit.

    python verify_runner.py info  REQUEST.json OUT.json
    python verify_runner.py check REQUEST.json OUT.jsonl

``info`` describes the interpreter (extension suffixes, site directories,
where torch's libraries are) and the requested distributions (version,
location, installed files, top-level packages, unmet requirements).

``check`` imports ``torch`` when it is installed, then the request's
``preload`` modules, then runs each item in order: ``import`` a module, or
``dlopen`` a shared object through ``ctypes.CDLL`` (RTLD_NOW, so undefined
symbols fail here and not at first call). It appends one JSON line when an
item starts and one when it ends, flushed at once, so that the caller can
tell which item was running if the process dies (a segfault in an extension
takes the interpreter with it) and go on with the rest in a new process.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import re
import site
import sys
import sysconfig
import traceback
from collections.abc import Callable, Collection, Sequence
from typing import Any, TextIO


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text.strip()


def _torch_lib_dir() -> str | None:
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        lib = os.path.join(location, "lib")
        if os.path.isdir(lib):
            return lib
    return None


def _packaging() -> tuple[Any, Any] | None:
    """packaging's requirements and version modules, or pip's vendored copy."""
    for base in ("packaging", "pip._vendor.packaging"):
        try:
            return (importlib.import_module(base + ".requirements"), importlib.import_module(base + ".version"))
        except ImportError:
            continue
    return None


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _only_foreign(name: str, foreign: Sequence[str], allowed: Collection[str]) -> str:
    """Where ``name`` is installed when that is one of the ``foreign`` directories (the verifying tool's own
    environment, which the wheelhouse's install command does not see) and it is not ``allowed``; else ''."""
    if not foreign or _canonical(name) in allowed:
        return ""
    try:
        where = os.path.realpath(str(importlib.metadata.distribution(name).locate_file("")))
    except importlib.metadata.PackageNotFoundError:
        return ""
    return where if any(where == f or where.startswith(f.rstrip(os.sep) + os.sep) for f in foreign) else ""


def _requirement_problems(
    dist: importlib.metadata.Distribution, foreign: Sequence[str] = (), allowed: Collection[str] = ()
) -> list[str]:
    """Requirements of ``dist`` that the environment does not satisfy, with those of the extras it asks
    for (``repro-shapes[round]``: what repro-shapes needs for ``round``, which ``pip --no-deps`` never saw).

    A requirement met only by a distribution in one of the ``foreign`` directories, and not ``allowed``
    (the provided set), is unmet: the install command of the wheelhouse would not find it offline."""
    modules = _packaging()
    if modules is None:
        return ["cannot check requirements: neither packaging nor pip is importable"]
    requirements, versions = modules
    problems = []
    todo: list[tuple[str, str, tuple[str, ...]]] = [(line, "", ()) for line in dist.requires or []]
    followed = set()
    while todo:
        line, via, extras = todo.pop(0)
        try:
            req = requirements.Requirement(line)
        except requirements.InvalidRequirement as exc:
            problems.append(f"invalid requirement {line!r}: {exc}")
            continue
        if via:  # only what the extra adds: the distribution's own requirements are checked as its own
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                continue
            if not any(req.marker.evaluate({"extra": extra}) for extra in extras):
                continue
            shown = f"{req.name}{req.specifier} (for {via})"
        elif req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        else:
            shown = str(req)
        try:
            installed = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{shown} (not installed)")
            continue
        elsewhere = _only_foreign(req.name, foreign, allowed)
        if elsewhere:
            problems.append(f"{shown} (only in {elsewhere}, the verifying tool's own environment: neither in the "
                            "wheelhouse nor provided)")  # fmt: skip
            continue
        if req.extras and (req.name.lower(), tuple(sorted(req.extras))) not in followed:
            followed.add((req.name.lower(), tuple(sorted(req.extras))))
            asked = f"{req.name}[{','.join(sorted(req.extras))}]"
            todo += [(sub, asked, tuple(sorted(req.extras))) for sub in importlib.metadata.requires(req.name) or []]
        if not req.specifier:
            continue
        try:
            satisfied = req.specifier.contains(installed, prereleases=True)
        except versions.InvalidVersion:
            satisfied = False
        if not satisfied:
            problems.append(f"{shown} (installed: {installed})")
    return problems


def _top_level(dist: importlib.metadata.Distribution, files: list[str], location: str) -> list[str]:
    text = dist.read_text("top_level.txt")
    if text:
        return [line.strip() for line in text.splitlines() if line.strip()]
    names = set()
    for path in files:
        rel = os.path.relpath(path, location)
        parts = rel.split(os.sep)
        head = parts[0]
        if head.startswith("..") or head.endswith((".dist-info", ".data")) or head == "__pycache__":
            continue
        if len(parts) == 1:
            if head.endswith(".py"):
                names.add(head[:-3])
        elif len(parts) == 2 and parts[1] == "__init__.py":
            names.add(head)
    return sorted(names)


def _under(path: str, dirs: Sequence[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip(os.sep) + os.sep) for d in dirs)


def _describe_dist(
    name: str, version: str = "", foreign: Sequence[str] = (), allowed: Collection[str] = (), hide: Sequence[str] = ()
) -> dict[str, Any]:
    """The distribution ``name`` first on the path, or, with ``version``, the first copy of that version
    (public part compared: ``2.11.0`` is ``2.11.0+cu130``); a copy in one of the ``hide`` directories (the
    verifying tool's own venv) is passed over, and named as ``hidden`` when it is the only one."""
    dist, hidden = None, ""
    for candidate in importlib.metadata.distributions(name=name):  # every copy, in the order of the path
        where = os.path.realpath(str(candidate.locate_file("")))
        if _under(where, hide):
            hidden = hidden or where
            continue
        if dist is None:
            dist = candidate
        if not version or candidate.version.split("+")[0] == version.split("+")[0]:
            dist = candidate
            break
    if dist is None:
        return {"found": False, "hidden": hidden} if hidden else {"found": False}
    location = os.path.realpath(str(dist.locate_file("")))
    files = sorted({os.path.realpath(str(dist.locate_file(path))) for path in (dist.files or [])})
    return {
        "found": True,
        "name": dist.metadata["Name"],
        "version": dist.version,
        "location": location,
        "files": files,
        "top_level": _top_level(dist, files, location),
        "requirement_problems": _requirement_problems(dist, foreign, allowed),
        "requires": list(dist.requires or []),
    }


def info(request: dict[str, Any]) -> dict[str, Any]:
    site_dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "prefix": sys.prefix,
        "base_prefix": sys.base_prefix,
        "in_venv": sys.prefix != sys.base_prefix,
        "site_dirs": site_dirs,
        "sys_path": [p for p in sys.path if p],
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "ext_suffixes": list(importlib.machinery.EXTENSION_SUFFIXES),
        "torch_lib": _torch_lib_dir(),
        "dists": {
            name: _describe_dist(
                name,
                request.get("versions", {}).get(name, ""),
                [os.path.realpath(d) for d in request.get("foreign", [])],
                {_canonical(n) for n in request.get("allowed", [])},
                [os.path.realpath(d) for d in request.get("hide", [])],
            )
            for name in request.get("dists", [])
        },
    }


def _do_import(target: str) -> str:
    if target not in sys.modules:
        # A package may load its own extension under another name (TE loads
        # transformer_engine/transformer_engine_torch*.so as the top-level
        # transformer_engine_torch); importing the file a second time would
        # register its pybind11 types twice and fail. That it loaded counts.
        spec = importlib.util.find_spec(target)
        origin = os.path.realpath(spec.origin) if spec is not None and spec.origin else ""
        if origin.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            for name, loaded in list(sys.modules.items()):
                path = getattr(loaded, "__file__", None)
                if path and name != target and os.path.realpath(path) == origin:
                    return f"{origin} (already loaded as {name})"
    module = importlib.import_module(target)
    return str(getattr(module, "__file__", "") or "")


def _do_dlopen(target: str) -> str:
    ctypes.CDLL(target)  # CPython opens with RTLD_NOW: unresolved symbols fail here
    return target


_ACTIONS: dict[str, Callable[[str], str]] = {"preload": _do_import, "import": _do_import, "dlopen": _do_dlopen}


class _Events:
    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def emit(self, **event: Any) -> None:
        self._stream.write(json.dumps(event, sort_keys=True) + "\n")
        self._stream.flush()


def _run_item(events: _Events, kind: str, target: str) -> bool:
    events.emit(phase="start", kind=kind, target=target)
    print(f"verify_runner: {kind} {target}", flush=True)
    try:
        detail = _ACTIONS[kind](target)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit from a module counts too
        traceback.print_exc()
        sys.stdout.flush()
        events.emit(phase="end", kind=kind, target=target, ok=False, error=_error_text(exc))
        return False
    events.emit(phase="end", kind=kind, target=target, ok=True, detail=detail)
    return True


def check(request: dict[str, Any], stream: TextIO) -> None:
    events = _Events(stream)
    preload = list(request.get("preload", []))
    if _torch_lib_dir() is not None and "torch" not in preload:
        preload.insert(0, "torch")
    for module in preload:
        _run_item(events, "preload", module)
    for item in request.get("items", []):
        _run_item(events, item["kind"], item["target"])


def _forget_own_directory() -> None:
    """Run as a script, Python puts tasks/outside/ first on sys.path, where modules
    such as ``build`` or ``index`` would shadow what the checked packages import."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]


def main(argv: list[str]) -> int:
    _forget_own_directory()
    if len(argv) != 4 or argv[1] not in ("info", "check"):
        sys.stderr.write("usage: verify_runner.py info|check REQUEST.json OUT\n")
        return 2
    mode, request_path, out_path = argv[1], argv[2], argv[3]
    with open(request_path, encoding="utf-8") as fh:
        request = json.load(fh)
    if mode == "info":
        result = info(request)
        tmp = out_path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1, sort_keys=True)
        os.replace(tmp, out_path)
        return 0
    with open(out_path, "a", encoding="utf-8") as stream:
        check(request, stream)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
