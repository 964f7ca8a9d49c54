"""The toolchain fingerprint: everything about the build environment that can change a wheel.

Probing runs compilers and imports torch (seconds), so the fingerprint is
memoised in the cache under a cheap stamp: the environment variables that
steer tool lookup and the file status (inode, size, mtime) of the Python
executable, its site-packages directories and each tool found on PATH. An
install or upgrade changes one of those and triggers a new probe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import sysconfig
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from tasks.core import proc
from tasks.core.errors import ToolchainError
from tasks.core.fsutil import write_atomic
from tasks.env import compilers
from tasks.lock.lockfile import Toolchain
from tasks.store.cache import Cache

#: 3: nvcc by its resolved path; ninja no longer in the key (it cannot change a wheel's bytes).
FINGERPRINT_VERSION = 7  # 4: Python's C headers; 5: the first copy of a distribution on sys.path; 6: nvcc itself;
# 7: the other compilers a build runs (sysconfig's, nvcc's host compiler), where they are other programs than cc/c++
TOOLS = ("nvcc", "cc", "c++", "gcc", "g++", "cmake", "ninja", "cuobjdump")
COMPILER_ENV = {"cc": "CC", "c++": "CXX"}
STEERING_ENV = (
    "PATH",
    "CC",
    "CXX",
    "CUDAHOSTCXX",
    "CUDA_HOME",
    "CUDA_PATH",
    "CUDNN_PATH",
    "LD_LIBRARY_PATH",
    "NVCC",
    "PYTHONPATH",
    "VIRTUAL_ENV",
)

# Runs inside the build interpreter; prints one JSON document.
_PROBE = r"""
import json, sys, sysconfig, importlib.metadata as md, importlib.util
import os
out = {"python": sys.version.split()[0], "implementation": sys.implementation.cache_tag,
       "soabi": sysconfig.get_config_var("SOABI"), "platform": sysconfig.get_platform(),
       "headers": os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
       "glibc": os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else ""}
if importlib.util.find_spec("torch") is not None:
    import torch
    out["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                    "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI),
                    "git": getattr(torch.version, "git_version", "")}
dists = {}
for d in md.distributions():  # in sys.path order: the first copy of a name is the one imported
    name = d.metadata["Name"]
    if name:
        dists.setdefault(name.lower().replace("_", "-"), d.version)
out["dists"] = dists
try:
    import nvidia.cudnn, os
    out["cudnn_pip"] = list(nvidia.cudnn.__path__)[0]  # a namespace package: no __file__
except Exception:
    pass
print(json.dumps(out))
"""


def _stat_key(path: str | None) -> list[Any]:
    if not path:
        return [None]
    try:
        st = os.stat(path)
    except OSError:
        return [path, None]
    return [path, st.st_ino, st.st_size, st.st_mtime_ns]


def _site_dirs() -> list[str]:
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    paths.update(p for p in sys.path if p.endswith("site-packages"))
    return sorted(paths)


def nvcc_takes_seed(nvcc: str) -> bool:
    """Whether this nvcc has ``-frandom-seed`` (tasks/env/reproducible.py uses it), from its ``--help``."""
    try:
        res = proc.query([nvcc, "--help"], timeout=120, text=True)
    except (OSError, proc.TimeoutExpired):
        return False
    return "-frandom-seed" in res.stdout


def stamp(env: Mapping[str, str]) -> str:
    """A cheap digest that changes whenever the fingerprint may have changed."""
    doc = {
        "v": FINGERPRINT_VERSION,
        "env": {k: env.get(k, "") for k in STEERING_ENV},
        "python": _stat_key(os.path.realpath(sys.executable)),
        "site": [_stat_key(p) for p in _site_dirs()],
        "tools": {t: _stat_key(_which(t, env)) for t in TOOLS},
        "compilers": {n: _stat_key(shutil.which(n, path=env.get("PATH"))) for n in _other_compiler_names(env)},
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _which(tool: str, env: Mapping[str, str]) -> str | None:
    if tool == "nvcc":
        if env.get("NVCC"):
            return shutil.which(env["NVCC"], path=env.get("PATH"))
        found = shutil.which("nvcc", path=env.get("PATH"))
        if found:
            return found
        for home in (env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda"):
            if home and Path(home, "bin", "nvcc").is_file():
                return str(Path(home, "bin", "nvcc"))
        return None
    override = env.get(COMPILER_ENV.get(tool, ""), "")
    if override:
        return shutil.which(override.split()[0], path=env.get("PATH"))
    return shutil.which(tool, path=env.get("PATH"))


def _other_compiler_names(env: Mapping[str, str]) -> list[str]:
    """Compilers a build runs besides ``cc`` and ``c++`` (or CC and CXX): this Python's (setuptools compiles and
    links with sysconfig's CC, CXX, LDSHARED, LDCXXSHARED) and nvcc's host compiler (CUDAHOSTCXX, else g++)."""
    names = [compilers.first_word(str(sysconfig.get_config_var(v) or "")) for v in compilers.SYSCONFIG_VARS]
    names += ["gcc", "g++", compilers.first_word(env.get("CUDAHOSTCXX", ""))]
    return list(dict.fromkeys(n for n in names if n))


def other_compilers(env: Mapping[str, str]) -> dict[str, str]:
    """Of :func:`_other_compiler_names`, those that are other programs than cc's and c++'s (by resolved path):
    name -> its ``--version`` line. Empty where they all are the same compilers (then keys stay as they were)."""
    known = {os.path.realpath(p) for p in (_which("cc", env), _which("c++", env)) if p}
    found = {}
    for name in _other_compiler_names(env):
        path = shutil.which(name, path=env.get("PATH"))
        if path and os.path.realpath(path) not in known:
            known.add(os.path.realpath(path))
            found[name] = _first_line([path, "--version"])
    return found


def nvcc_itself(found: str) -> str:
    """The nvcc program that ``found`` runs, by its resolved path: through symlinks, and through a wrapper
    script (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``) by the directory nvcc reports it runs from."""
    here = ""
    with contextlib.suppress(OSError, proc.TimeoutExpired):
        res = proc.query([found, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull], timeout=60)
        m = re.search(r"^#\$ _HERE_=(.+)$", res.stderr.decode("utf-8", "replace"), flags=re.M)
        here = m.group(1).strip() if m else ""
    inside = os.path.join(here, "nvcc") if here else ""
    return os.path.realpath(inside if inside and os.path.isfile(inside) else found)


def _first_line(cmd: list[str], pattern: str = "") -> str:
    try:
        res = proc.query(cmd, timeout=60)
    except (OSError, proc.TimeoutExpired):
        return ""
    text = (res.stdout or res.stderr).decode("utf-8", "replace")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if pattern:
        lines = [ln for ln in lines if re.search(pattern, ln)] or lines
    return lines[0] if lines else ""


def _cudnn_version(paths: Iterable[str]) -> tuple[str, str]:
    for base in paths:
        header = Path(base) / "include" / "cudnn_version.h"
        if header.is_file():
            text = header.read_text(errors="replace")
            nums = [re.search(rf"#define CUDNN_{k}\s+(\d+)", text) for k in ("MAJOR", "MINOR", "PATCHLEVEL")]
            if all(nums):
                return ".".join(m.group(1) for m in nums if m), base
    return "", ""


def probe(env: Mapping[str, str]) -> dict[str, Any]:
    """Run the tools and the interpreter to build the fingerprint (slow: seconds)."""
    res = proc.query([sys.executable, "-c", _PROBE], env=env, timeout=300)
    if res.returncode != 0:
        raise ToolchainError(f"cannot probe the build interpreter {sys.executable}: {res.stderr.decode()[-2000:]}")
    info: dict[str, Any] = json.loads(res.stdout)
    dists = info.pop("dists")
    found = _which("nvcc", env)
    # The resolved path: nvcc writes the path it was started by into what it links (nvlink's
    # -L options), so builds start it by this path (see cuda_env) and the key records it.
    nvcc = nvcc_itself(found) if found else ""
    tools: dict[str, Any] = {
        "nvcc": _first_line([nvcc, "--version"], r"release") if nvcc else "",
        "nvcc_path": nvcc,
        "nvcc_random_seed": nvcc_takes_seed(nvcc) if nvcc else False,
        "cc": _first_line([_which("cc", env) or "cc", "--version"]),
        "cxx": _first_line([_which("c++", env) or "c++", "--version"]),
        "cmake": _first_line([cmake, "--version"]) if (cmake := _which("cmake", env)) else "",
        "ninja": _first_line([ninja, "--version"]) if (ninja := _which("ninja", env)) else "",
        "compilers": other_compilers(env),
    }
    cudnn_candidates = [env.get("CUDNN_PATH", ""), info.pop("cudnn_pip", ""), "/usr"]
    cudnn_version, cudnn_path = _cudnn_version([c for c in cudnn_candidates if c])
    cuda_home = str(Path(nvcc).parent.parent) if nvcc else ""
    return {
        "python": info,
        "tools": tools,
        "cudnn": {"version": cudnn_version, "path": cudnn_path},
        "cuda_home": cuda_home,
        "dists": dists,
    }


def detect(cache: Cache, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The toolchain description, memoised under :func:`stamp`."""
    env = dict(os.environ if env is None else env)
    key = stamp(env)
    memo = cache.root / "toolchain" / f"{key}.json"
    try:
        return dict(json.loads(memo.read_text()))
    except (FileNotFoundError, ValueError):
        pass
    info = probe(env)
    cache.ensure()
    write_atomic(memo, json.dumps(info, indent=2, sort_keys=True) + "\n")
    return info


def nvcc_release(info: Mapping[str, Any]) -> str:
    m = re.search(r"release (\d+\.\d+)", info["tools"].get("nvcc", ""))
    return m.group(1) if m else ""


def fingerprint(info: Mapping[str, Any], *, extras: Iterable[str] = (), cuda: bool = False) -> dict[str, Any]:
    """The part of the toolchain that enters a package's action key: what can change its wheel's bytes.

    Not ninja's version: ninja only orders the compiles (see description() for the SBOM's record).
    For CUDA packages, nvcc's release line and the path it is started by (its resolved path).
    """
    py = info["python"]
    fp: dict[str, Any] = {
        "python": py["python"],
        "abi": py["soabi"],
        "platform": py["platform"],
        "torch": py.get("torch", {}).get("version", ""),
        "torch_cuda": py.get("torch", {}).get("cuda") or "",
        "torch_cxx11_abi": py.get("torch", {}).get("cxx11_abi"),
        "cc": info["tools"]["cc"],
        "cxx": info["tools"]["cxx"],
        "cmake": info["tools"]["cmake"],
    }
    if info["tools"].get("compilers"):  # only where a build's compilers are not all cc's and c++'s
        fp["compilers"] = info["tools"]["compilers"]
    if cuda:
        fp["nvcc"] = info["tools"]["nvcc"]
        fp["nvcc_path"] = info["tools"].get("nvcc_path", "")
    if "cudnn" in extras:
        fp["cudnn"] = info["cudnn"]["version"]
    return fp


def description(info: Mapping[str, Any], *, extras: Iterable[str] = (), cuda: bool = False) -> dict[str, Any]:
    """What the SBOM records of the toolchain: the key's fingerprint plus tools outside the key (ninja)."""
    return {**fingerprint(info, extras=extras, cuda=cuda), "ninja": info["tools"].get("ninja", "")}


def cuda_env(env: Mapping[str, str], info: Mapping[str, Any]) -> dict[str, str]:
    """``env`` with the probed nvcc reached by its resolved path, however the host's PATH reaches it.

    nvcc records the directory it was started from in the objects it links (nvlink's ``-L``
    options), so ``/usr/local/cuda/bin/nvcc`` and ``/usr/local/cuda-13.0/bin/nvcc`` (one file
    through a symlinked directory) gave two wheels under one key. The resolved bin directory goes
    first on PATH, and CUDA_HOME, CUDA_PATH (and NVCC, where set) name the resolved install.
    """
    out = dict(env)
    nvcc = str(info["tools"].get("nvcc_path") or "")
    if not nvcc:
        return out
    home = str(info.get("cuda_home") or Path(nvcc).parent.parent)
    out["PATH"] = os.pathsep.join([str(Path(nvcc).parent), out.get("PATH", os.defpath)])
    out["CUDA_HOME"] = out["CUDA_PATH"] = home
    if out.get("NVCC"):
        out["NVCC"] = nvcc
    return out


def _matches(spec: str, version: str) -> bool:
    if not spec:
        return True
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def torch_requirement(info: Mapping[str, Any]) -> str:
    """``torch==<version>`` of the probed torch's distribution, local label kept (``2.11.0+cu130`` is not
    ``2.11.0+cpu``).

    What a wheel compiled against that torch records in its Requires-Dist (tasks/stages/build.py), so that pip
    refuses to install it beside any other torch, where its extension would not load. The version is the
    installed distribution's (its METADATA, what pip compares), not ``torch.__version__``: PyPI's CUDA
    wheels and images' own builds install as ``2.11.0`` while ``torch.__version__`` says
    ``2.11.0+cu130``, and a pin on the latter is one no installed torch satisfies (seen on the H100 host).
    Where the distribution carries no label, ``==2.11.0`` also admits a ``2.11.0+cpu``: preflight's torch
    check (its CUDA) is what tells those apart.
    """
    found = info["python"].get("torch")
    if not found:
        raise ToolchainError(f"torch is not importable by {sys.executable}, yet the package builds against it")
    version = str(info.get("dists", {}).get("torch") or found["version"])
    try:
        Version(version)
    except InvalidVersion:
        raise ToolchainError(
            f"torch's version {version!r} is not a PEP 440 version, so no wheel can require it exactly; set "
            "torch_unpinned (with the reason) for the packages that build against it"
        ) from None
    return f"torch=={version}"


def builds_against_torch(build_requires: Iterable[str]) -> bool:
    """Whether a package's build requirements name torch (its build imports it)."""
    return any(Requirement(r).name.lower() == "torch" for r in build_requires)


def toolchain_problems(tc: Toolchain, info: Mapping[str, Any], *, torch: bool = True, cuda: bool = True) -> list[str]:
    """What of ``[toolchain]`` the probed toolchain does not satisfy.

    Python always; torch and torch_cuda only where ``torch`` (the package builds against torch);
    nvcc only where ``cuda`` (the package compiles CUDA or reads the CUDA install).
    """
    problems = []
    py = info["python"]
    if not _matches(tc.python, py["python"]):
        problems.append(f"python {py['python']} does not satisfy {tc.python!r}")
    found = py.get("torch")
    if torch:
        if tc.torch and not found:
            problems.append(f"torch is not importable by {sys.executable} (the lock expects {tc.torch!r})")
        elif found and not _matches(tc.torch, found["version"].split("+")[0]):
            problems.append(f"torch {found['version']} does not satisfy {tc.torch!r}")
        if tc.torch_cuda and not (found and found.get("cuda") and _matches(tc.torch_cuda, found["cuda"])):
            problems.append(f"torch's CUDA {found.get('cuda') if found else None} does not satisfy {tc.torch_cuda!r}")
        elif cuda and found and not found.get("cuda"):
            problems.append(
                f"torch {found['version']} is a CPU build (torch.version.cuda is None), and a cuda = true package "
                "compiles CUDA against torch: install a CUDA build of torch (pip install torch --index-url "
                "https://download.pytorch.org/whl/cu130, the one your [toolchain] cuda names)"
            )
    if cuda and tc.cuda:
        release = nvcc_release(info)
        if not release:
            problems.append(f"nvcc not found (the lock expects CUDA {tc.cuda!r}); put it on PATH or set CUDA_HOME")
        elif not _matches(tc.cuda, release):
            problems.append(f"nvcc {release} does not satisfy {tc.cuda!r}")
    return problems


def check_expectations(
    tc: Toolchain, info: Mapping[str, Any], *, lock: Path, package: str = "", torch: bool = True, cuda: bool = True
) -> None:
    """Refuse to build against a toolchain the lock does not expect (for ``package``, where given)."""
    problems = toolchain_problems(tc, info, torch=torch, cuda=cuda)
    if problems:
        what = f"package {package}: " if package else ""
        raise ToolchainError(
            f"{what}the build toolchain does not match {lock} [toolchain]:\n  - "
            + "\n  - ".join(problems)
            + "\nUse the environment the lock was written for, or change [toolchain] deliberately."
        )


def check_build_requires(requires: Iterable[str], info: Mapping[str, Any], *, package: str) -> dict[str, str]:
    """Installed versions of a package's build requirements; error listing what is missing."""
    dists: Mapping[str, str] = info["dists"]
    found, missing = {}, []
    for raw in requires:
        req = Requirement(raw)
        name = req.name.lower().replace("_", "-")
        version = dists.get(name)
        if version is None or not _matches(str(req.specifier), version):
            missing.append(raw if version is None else f"{raw} (installed: {version})")
        else:
            found[name] = version
    if missing:
        quoted = " ".join(f"'{m.split(' (')[0]}'" for m in missing)
        raise ToolchainError(
            f"package {package}: build requirements not satisfied in {sys.executable}: {', '.join(missing)}. "
            f"Builds run without isolation; install them first: {sys.executable} -m pip install {quoted}"
        )
    return found
