"""`doit preflight`: the target node checks itself against what the wheels need, before anything is installed.

Runs elsewhere: on a cluster node, from a wheelhouse, an unpacked bundle or an image, offline, with only
the standard library of the node's Python (3.8 or newer) and no checkout of this project. `doit wheels`
ships a copy of this file as ``wheels/preflight.py`` beside ``wheels/preflight.json`` (what the wheels
need: the build's CUDA, torch and glibc, the target archs, the provided set and what each wheel needs of it)::

    python3 wheels/preflight.py                      # checks this interpreter and this node
    python3 wheels/preflight.py --python /opt/venv/bin/python --json report.json
    python3 wheels/preflight.py --gpu off            # a node meant to run without a GPU

Checks, one line each with what was found and what is needed:

- ``driver``: the NVIDIA driver's CUDA version (``cuDriverGetVersion`` of libcuda, through ctypes) against
  the CUDA the wheels were built with (minor version compatibility: the same major or newer);
- ``gpu``: each GPU's compute capability (``cuDeviceGetAttribute``) against the SASS archs of the CUDA
  wheels (``sm_90a`` runs on 9.0 only; ``sm_90`` on 9.x);
- ``glibc``: the node's glibc against the wheels' platform tags (``manylinux_2_28``: 2.28; ``linux_*``: the
  build host's glibc);
- ``python``: the interpreter's version and ABI against every wheel's tags;
- ``torch``: the installed torch (version with its local label, CUDA, C++ ABI) against what the wheels pin
  (their ``Requires-Dist: torch==``) and were compiled with;
- ``provided``: the installed distributions against the provided set the closure was resolved around: those
  the wheels need (each wheel's ``needs`` in preflight.json: what it requires of the provided set, followed
  through the provided distributions' own requirements, with the version specifiers of each requirement on
  the way) must be installed at a version those specifiers accept, by PEP 440 as pip check judges it (format 2,
  without specifiers: at their captured versions); any other difference from the captured base is a note
  (``--strict``: every provided distribution must be at its captured version).

Its inputs are not trusted (docs/security.md): preflight.json must be a regular file of at most
``MAX_SPEC_BYTES`` of the shape :func:`check_spec` describes, and each wheel it names a plain file name of
the wheelhouse that is a regular file, whose METADATA is read up to ``MAX_METADATA_BYTES``; a fifo, a
device, a link to one, another shape or a nesting too deep is one line and exit status 10, never a wait.

Exit status (docs/tasks.md#exit-statuses): 0 when every check passes or is skipped, 21 when one fails
(no NVIDIA driver included), 10 when the wheelhouse cannot be read. ``REPRO_LIBCUDA`` names another
libcuda (tests load a fake one).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import os
import platform
import re
import stat
import subprocess
import sys
import zipfile
from typing import Any

#: What `doit wheels` writes beside this file.
SPEC_FILE = "preflight.json"
#: 3: each wheel's ``needs`` are requirements (a name and the version specifiers that reached it). 2: names
#: (then needed at their captured versions). 1 (no ``needs``) is still read: every provided distribution is
#: then needed at its captured version.
SPEC_FORMAT = 3
READ_FORMATS = (1, 2, 3)
#: The most this checker reads of preflight.json, and of one wheel's METADATA.
MAX_SPEC_BYTES = 32 * 1024 * 1024
MAX_METADATA_BYTES = 8 * 1024 * 1024
EXIT_OK = 0
EXIT_FAILED = 21  # tasks.core.errors.PreflightFailed
EXIT_UNREADABLE = 10  # tasks.core.errors.ReproError
LIBCUDA_ENV = "REPRO_LIBCUDA"
PROBE_TIMEOUT_S = 300

# CUdevice_attribute values (cuda.h).
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


def check(name: str, status: str, found: str, needed: str, detail: str = "") -> dict[str, Any]:
    return {"check": name, "status": status, "found": found, "needed": needed, "detail": detail}


# --------------------------------------------------------------------------- the driver and the GPUs


def read_driver(library: str = "") -> dict[str, Any]:
    """What libcuda says: ``{"error": ...}`` without a driver, else its CUDA version and each GPU's capability."""
    name = library or os.environ.get(LIBCUDA_ENV, "") or "libcuda.so.1"
    try:
        cuda = ctypes.CDLL(name)
    except OSError as exc:
        return {"error": f"no NVIDIA driver found ({name} cannot be loaded: {exc})"}
    version = ctypes.c_int(0)
    if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return {"error": f"the NVIDIA driver ({name}) does not answer cuDriverGetVersion"}
    out: dict[str, Any] = {"version": version.value, "library": name, "gpus": []}
    status = cuda.cuInit(0)
    if status != 0:
        out["init_error"] = status  # 100: CUDA_ERROR_NO_DEVICE
        return out
    count = ctypes.c_int(0)
    if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        out["init_error"] = -1
        return out
    for ordinal in range(count.value):
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        cuda.cuDeviceGetAttribute(ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, ordinal)
        cuda.cuDeviceGetAttribute(ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, ordinal)
        gpu_name = ""
        if hasattr(cuda, "cuDeviceGetName"):
            buf = ctypes.create_string_buffer(256)
            if cuda.cuDeviceGetName(buf, 256, ordinal) == 0:
                gpu_name = buf.value.decode("utf-8", "replace")
        out["gpus"].append({"index": ordinal, "name": gpu_name, "capability": [major.value, minor.value]})
    return out


def cuda_text(version: int) -> str:
    """cuDriverGetVersion's integer as CUDA's ``major.minor`` (13000 -> 13.0)."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def _release(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def driver_check(driver: dict[str, Any], needed_cuda: str, gpu: str) -> dict[str, Any]:
    if needed_cuda:
        needed = f"CUDA >= {_release(needed_cuda)[0]}.0 (the wheels were built with CUDA {needed_cuda})"
    else:
        needed = "an NVIDIA driver (the lock targets GPUs; no wheel here was built with CUDA)"
    if gpu == "off":
        return check("driver", "SKIP", "not asked (--gpu off)", needed)
    if not driver:
        return check("driver", "SKIP", "not asked", "none: the lock names no GPU archs")
    if "error" in driver:
        return check("driver", "FAIL", driver["error"], needed)
    found = "CUDA {} (driver API {}, {})".format(cuda_text(driver["version"]), driver["version"], driver["library"])
    ok = driver["version"] // 1000 >= _release(needed_cuda)[0]
    detail = "" if ok else f"update the NVIDIA driver to one that supports CUDA {needed_cuda}"
    return check("driver", "PASS" if ok else "FAIL", found, needed, detail)


def runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether SASS for ``arch`` (``sm_90a``, ``sm_90``, ``sm_100f``) runs on a GPU of ``capability``.

    Arch-specific SASS (``a``) runs on exactly that capability; family SASS (``f``) on the same major
    with the same or a higher minor; plain SASS, likewise, on the same major (binary compatibility).
    """
    m = re.match(r"^sm_(\d+)(\d)([af]?)$", arch)
    if not m:
        return False
    major, minor, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
    if suffix == "a":
        return capability == (major, minor)
    return capability[0] == major and capability[1] >= minor


def gpu_check(driver: dict[str, Any], archs: list[str], cuda_wheels: list[str], gpu: str) -> dict[str, Any]:
    needed = "SASS for it among the target archs {} ({})".format(
        ", ".join(archs) or "none", ", ".join(cuda_wheels) or "no wheel here carries device code"
    )
    if gpu == "off":
        return check("gpu", "SKIP", "not asked (--gpu off)", needed)
    if not driver:
        return check("gpu", "SKIP", "not asked", "none: the lock names no GPU archs")
    if "error" in driver:
        return check("gpu", "SKIP", "not asked: the driver check failed", needed)
    if driver.get("init_error") is not None or not driver["gpus"]:
        code = driver.get("init_error")
        return check("gpu", "FAIL", f"no GPU visible to the driver (cuInit: {code})", needed,
                     "check CUDA_VISIBLE_DEVICES and the node's allocation")  # fmt: skip
    seen, bad = [], []
    for card in driver["gpus"]:
        cap = (int(card["capability"][0]), int(card["capability"][1]))
        label = "GPU {} {}sm_{}{}".format(card["index"], card["name"] + " " if card["name"] else "", cap[0], cap[1])
        seen.append(label)
        if not any(runs_on(a, cap) for a in archs):
            bad.append(label)
    if bad:
        hint = f"the wheels' kernels do not run on {', '.join(bad)}: rebuild with archs naming it"
        return check("gpu", "FAIL", "; ".join(seen), needed, hint)
    return check("gpu", "PASS", "; ".join(seen), needed)


# --------------------------------------------------------------------------- the node's libc and Python


def glibc_version() -> str:
    try:
        text = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError, AttributeError):
        text = ""
    return text.split()[-1] if text.startswith("glibc") else ""


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def wheel_tags(filename: str) -> list[tuple[str, str, str]]:
    """The (python, abi, platform) tags of a wheel's file name, compressed tag sets expanded."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) < 5:
        return []
    pys, abis, plats = parts[-3], parts[-2], parts[-1]
    return [(p, a, pl) for p in pys.split(".") for a in abis.split(".") for pl in plats.split(".")]


def glibc_needed(filename: str, build_glibc: str) -> str:
    """The glibc a wheel needs: its manylinux tag's, or the build host's for a ``linux_*`` wheel ('' for any)."""
    needs = []
    for _py, _abi, plat in wheel_tags(filename):
        m = re.match(r"manylinux_(\d+)_(\d+)_", plat)
        legacy = {"manylinux1": "2.5", "manylinux2010": "2.12", "manylinux2014": "2.17"}
        if m:
            needs.append(f"{m.group(1)}.{m.group(2)}")
        elif plat.split("_")[0] in legacy:
            needs.append(legacy[plat.split("_")[0]])
        elif plat.startswith("linux_"):
            needs.append(build_glibc or "?")
        elif plat == "any":
            return ""
    known = [n for n in needs if n != "?"]
    return min(known, key=_version_tuple) if known else ("?" if needs else "")


def glibc_check(wheels: list[str], build_glibc: str, found: str) -> dict[str, Any]:
    needs = {w: glibc_needed(w, build_glibc) for w in wheels}
    top = max((n for n in needs.values() if n and n != "?"), key=_version_tuple, default="")
    needed = "glibc >= {} (the wheels' platform tags{})".format(
        top or "any", f"; linux_* wheels: the build host's {build_glibc}" if build_glibc else ""
    )
    if not found:
        return check("glibc", "FAIL" if top else "SKIP", "no glibc (another libc, or not Linux)", needed)
    short = [w for w, n in needs.items() if n and n != "?" and _version_tuple(found) < _version_tuple(n)]
    if short:
        return check("glibc", "FAIL", "glibc " + found, needed, "too old for: " + ", ".join(sorted(short)))
    return check("glibc", "PASS", "glibc " + found, needed)


def python_check(wheels: list[str], node: dict[str, Any]) -> dict[str, Any]:
    """Each wheel must carry a tag this interpreter takes (its version, ABI and machine)."""
    major, minor = node["version"][:2]
    pys = {f"cp{major}{minor}", f"py{major}", f"py{major}{minor}"}
    abis = {node["abi"], "abi3", "none"} if node["implementation"] == "cpython" else {"none"}
    machine = node["machine"]

    def fits(tag: tuple[str, str, str]) -> bool:
        py, abi, plat = tag
        if abi == "abi3":
            m = re.match(r"cp(\d)(\d+)$", py)
            py_ok = bool(m) and int(m.group(1)) == major and int(m.group(2)) <= minor  # type: ignore[union-attr]
        else:
            py_ok = py in pys
        plat_ok = plat == "any" or (plat.endswith("_" + machine) and plat.startswith(("linux_", "manylinux")))
        return py_ok and abi in abis and plat_ok

    found = "Python {}.{}.{} ({}, ABI {}, {})".format(major, minor, node["version"][2], node["implementation"],
                                                   node["abi"], machine)  # fmt: skip
    bad = [w for w in wheels if not any(fits(t) for t in wheel_tags(w))]
    wanted = sorted({f"{p}-{a}" for w in wheels for p, a, _pl in wheel_tags(w) if a not in ("none",)})
    needed = "a tag of each wheel ({})".format(", ".join(wanted) or "pure Python wheels only")
    if bad:
        return check("python", "FAIL", found, needed, "no tag of theirs fits this interpreter: " + ", ".join(bad))
    return check("python", "PASS", found, needed)


# --------------------------------------------------------------------------- the interpreter's packages

# Runs in the target interpreter (the one the wheels go into): what it has installed, and its torch.
_PROBE = r"""
import json, sys, sysconfig, platform
try:
    import importlib.metadata as md
except ImportError:
    md = None
names = json.loads(sys.argv[1])
ask_torch = len(sys.argv) < 3 or sys.argv[2] == "torch"
out = {"version": list(sys.version_info[:3]), "implementation": sys.implementation.name,
       "abi": "cp%d%d" % sys.version_info[:2], "soabi": sysconfig.get_config_var("SOABI") or "",
       "machine": platform.machine(), "dists": {}}
for name in names:
    out["dists"][name] = None
    for spelt in (name, name.replace("-", "_")):  # Python 3.8 finds typing_extensions-*.dist-info as written only
        try:
            out["dists"][name] = md.version(spelt) if md else None
            break
        except Exception:
            pass
if ask_torch and out["dists"].get("torch"):
    try:
        import torch
        out["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                        "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}
    except Exception as exc:
        out["torch_error"] = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps(out))
"""


def probe_python(python: str, names: list[str], *, torch: bool = True) -> dict[str, Any]:
    """What ``python`` has: its version, ABI, machine, the versions of ``names``, and, with ``torch``, what its
    torch says of itself (importing torch takes seconds: only where a wheel was built against it)."""
    env = dict(os.environ)
    for var in ("PYTHONHOME", "PYTHONSTARTUP", "PYTHONINSPECT"):
        env.pop(var, None)
    try:
        res = subprocess.run([python, "-c", _PROBE, json.dumps(names), "torch" if torch else "-"], capture_output=True,
                             stdin=subprocess.DEVNULL, env=env, timeout=PROBE_TIMEOUT_S)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python} cannot be run: {exc}"}
    if res.returncode != 0:
        return {"error": "{} failed: {}".format(python, res.stderr.decode("utf-8", "replace").strip()[-400:])}
    text = res.stdout.decode("utf-8", "replace").strip()
    try:  # the last line: a sitecustomize may print before it
        lines = text.splitlines()
        result = json.loads(lines[-1]) if lines else None
    except (ValueError, RecursionError):
        result = None
    if not isinstance(result, dict) or not isinstance(result.get("dists"), dict) or "version" not in result:
        return {"error": f"{python} printed no report of what it holds (its output ends: {text[-200:]!r})"}
    return result


# --------------------------------------------------------------------------- PEP 440 versions and specifiers

_VERSION = re.compile(
    r"v?(?:([0-9]+)!)?([0-9]+(?:\.[0-9]+)*)"  # epoch, release
    r"(?:[-_.]?(alpha|a|beta|b|preview|pre|c|rc)[-_.]?([0-9]*))?"  # pre-release
    r"(?:-([0-9]+)|[-_.]?(post|rev|r)[-_.]?([0-9]*))?"  # post-release
    r"(?:[-_.]?(dev)[-_.]?([0-9]*))?"  # development release
    r"(?:\+([a-z0-9]+(?:[-_.][a-z0-9]+)*))?",  # local label
    re.ASCII | re.IGNORECASE,
)
_PRE = {"alpha": "a", "a": "a", "beta": "b", "b": "b", "preview": "rc", "pre": "rc", "c": "rc", "rc": "rc"}
_SPECIFIER = re.compile(r"\s*(===|==|!=|~=|>=|<=|>|<)\s*(\S+)\s*")


@functools.total_ordering
@dataclasses.dataclass(frozen=True, eq=False)
class Version:
    """A PEP 440 version, normalised (``1.0-RC.2`` is 1.0rc2), equal and ordered as PEP 440 says (1.0 == 1.0.0;
    1.0.dev1 < 1.0a1 < 1.0rc2 < 1.0 < 1.0+cpu < 1.0.post1.dev3 < 1.0.post1; a numeric local segment above a word)."""

    epoch: int
    release: tuple[int, ...]  # as written: the stem of ``~=`` is taken from it
    pre: tuple[str, int] | None  # ("a" | "b" | "rc", its number)
    post: int | None
    dev: int | None
    local: tuple[int | str, ...]  # () without a local label

    @property
    def public(self) -> Version:
        return dataclasses.replace(self, local=())

    @property
    def is_prerelease(self) -> bool:
        return self.pre is not None or self.dev is not None

    def _key(self) -> tuple[Any, ...]:
        release = list(self.release)
        while len(release) > 1 and release[-1] == 0:
            release.pop()
        if self.pre is not None:
            pre: tuple[int, int] = (("a", "b", "rc").index(self.pre[0]), self.pre[1])
        else:  # 1.0.dev1 before 1.0a1; a release (and its post-releases) after its pre-releases
            pre = (-1, 0) if self.dev is not None and self.post is None else (3, 0)
        post = -1 if self.post is None else self.post
        dev = (1, 0) if self.dev is None else (0, self.dev)
        local = tuple((1, part) if isinstance(part, int) else (0, part) for part in self.local)
        return (self.epoch, tuple(release), pre, post, dev, local)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Version) and self._key() == other._key()

    def __lt__(self, other: Version) -> bool:
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def parse_version(text: str) -> Version | None:
    """``text`` as a PEP 440 version (any case, a leading ``v``, the other spellings PEP 440 normalises), or None."""
    m = _VERSION.fullmatch(text.strip())
    if m is None:
        return None
    epoch, release, pre_l, pre_n, post_dash, post_l, post_n, dev_l, dev_n, local = m.groups()
    return Version(
        epoch=int(epoch or 0),
        release=tuple(int(p) for p in release.split(".")),
        pre=(_PRE[pre_l.lower()], int(pre_n or 0)) if pre_l else None,
        post=int(post_dash) if post_dash else int(post_n or 0) if post_l else None,
        dev=int(dev_n or 0) if dev_l else None,
        local=tuple(int(p) if p.isdigit() else p for p in re.split("[-_.]", local.lower())) if local else (),
    )


def parse_specifier(text: str) -> tuple[str, str, Version | None] | None:
    """One PEP 440 version specifier as (operator, its version as written, that version parsed: for ``==V.*`` and
    ``!=V.*`` V, None for ``===``), or None where it is not one: ``~=`` needs two release numbers, and only ``==``
    and ``!=`` take a local label or a ``.*`` after release numbers (what packaging, and so pip, refuses too)."""
    m = _SPECIFIER.fullmatch(text)
    if m is None:
        return None
    op, want = m.groups()
    if op == "===":
        return op, want, None
    wild = op in ("==", "!=") and want.endswith(".*")
    target = parse_version(want[:-2] if wild else want)
    if target is None or (wild and (target.pre, target.post, target.dev, target.local) != (None, None, None, ())):
        return None
    if (target.local and op not in ("==", "!=")) or (op == "~=" and len(target.release) < 2):
        return None
    return op, want, target


def _starts_with(have: Version, epoch: int, stem: tuple[int, ...]) -> bool:
    """Whether ``have``'s release, padded with zeros, starts with ``stem`` (``==1.0.*``: 1, 1.0.7, 1.0rc1)."""
    padded = have.release + (0,) * (len(stem) - len(have.release))
    return have.epoch == epoch and padded[: len(stem)] == stem


def satisfies(version: str, specifier: str) -> bool:
    """Whether the installed ``version`` meets one PEP 440 specifier (``>=4.10``, ``==2.11.*``, ``~=1.4.2``,
    ``!=3.0``), as pip check judges it: ``packaging.specifiers.Specifier(specifier).contains(version,
    prereleases=True)``, a pre-release judged like any version (a node holds what it holds). ``~=22.0`` is
    ``>=22.0, ==22.*``; ``<V`` takes no pre-release of V, ``>V`` no post-release or local version of V (unless V is
    one); ``==V`` without a local label takes V's. A version that is not PEP 440 meets only ``===`` (equal as
    written, in any case); a specifier that is not one is a ValueError (:func:`check_spec` refuses it earlier)."""
    parsed = parse_specifier(specifier)
    if parsed is None:
        raise ValueError(f"{specifier!r} is not a PEP 440 version specifier")
    op, want, target = parsed
    if target is None:  # ===
        return version.lower() == want.lower()
    have = parse_version(version)
    if have is None:
        return False
    if op in ("==", "!="):
        if want.endswith(".*"):
            same = _starts_with(have, target.epoch, target.release)
        else:
            same = (have if target.local else have.public) == target
        return same == (op == "==")
    if op == "~=":
        return have.public >= target and _starts_with(have, target.epoch, target.release[:-1])
    if op == ">=":
        return have.public >= target
    if op == "<=":
        return have.public <= target
    if op == "<":
        early = dataclasses.replace(target, dev=0)  # V's earliest pre-release
        return have < target and (target.is_prerelease or not have.is_prerelease or have < early)
    of_target = dataclasses.replace(have, post=None, dev=None, local=()) == target  # a post-release of V
    post = have.post is not None and target.post is None and of_target
    return have > target and not post and not (have.local and have.public == target)


def version_matches(installed: str, pin: str) -> bool:
    """Whether pip takes ``installed`` for ``==pin`` (:func:`satisfies`): a pin without a local label matches any
    local label of its version (``==2.11.0`` takes ``2.11.0+cu130``, as pip does), one with a label only that
    label; a pin that is not a PEP 440 version matches only itself, as written."""
    if parse_specifier("==" + pin) is None:
        return installed.strip().lower() == pin.strip().lower()
    return satisfies(installed, "==" + pin)


def torch_check(pins: dict[str, str], build: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """The node's torch against the wheels' ``torch==`` pins and the torch they were compiled with."""
    versions = sorted(set(pins.values()))
    if not versions and not build.get("torch"):
        return check("torch", "SKIP", "not asked", "none: no wheel builds against torch")
    want = versions[0] if len(versions) == 1 else " and ".join(versions)
    cuda = build.get("torch_cuda") or "none (CPU)"
    abi = build.get("torch_cxx11_abi")
    needed = "torch {} (CUDA {}{})".format(
        want or build.get("torch", ""), cuda, "" if abi is None else f", C++11 ABI {int(bool(abi))}"
    )
    if len(versions) > 1:
        return check("torch", "FAIL", "(not asked)", needed, "the wheels pin different torches: rebuild them together")
    installed = node.get("dists", {}).get("torch")
    if not installed:
        return check("torch", "FAIL", "torch not installed for this interpreter", needed,
                     "install the torch the wheels were built against first")  # fmt: skip
    info = node.get("torch")
    if info is None:
        return check("torch", "FAIL", "torch {} (cannot import: {})".format(installed, node.get("torch_error", "?")),
                     needed)  # fmt: skip
    shown = info["version"] if installed == info["version"] else f"{info['version']}, installed as {installed}"
    found = "torch {} (CUDA {}, C++11 ABI {})".format(shown, info["cuda"] or "none (CPU)",
                                                      int(bool(info["cxx11_abi"])))  # fmt: skip
    problems = []
    target = want or build.get("torch", "")
    if target and not version_matches(installed, target):
        problems.append(f"version {installed} is not {target}")
    if (info["cuda"] or "") != (build.get("torch_cuda") or ""):
        problems.append("CUDA {} is not {}".format(info["cuda"], build.get("torch_cuda") or None))
    if abi is not None and bool(info["cxx11_abi"]) != bool(abi):
        problems.append("its C++ ABI differs (the extensions would not load: undefined symbols)")
    if problems:
        return check("torch", "FAIL", found, needed, "; ".join(problems))
    return check("torch", "PASS", found, needed)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_NEED = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)((?:(?:===|==|!=|~=|>=|<=|>|<)[A-Za-z0-9.*+!_-]+,?)*)$")


def _is_need(text: str) -> bool:
    m = _NEED.match(text)
    return m is not None and all(parse_specifier(p) for p in m.group(2).split(",") if p)


def needed_provided(spec: dict[str, Any]) -> dict[str, tuple[list[str], list[str] | None]]:
    """canonical name -> (the wheels that need that provided distribution, the version specifiers they need it
    at; None: at its captured version), from preflight.json's ``needs``; a format 1 description says nothing of
    it: every provided distribution is then needed, at its captured version, by the provided set itself."""
    if spec["format"] < 2:
        return {canonical(line.partition("==")[0]): ([], None) for line in spec["provided"]}
    needed: dict[str, tuple[list[str], list[str] | None]] = {}
    for wheel in spec["wheels"]:
        for need in wheel["needs"]:
            m = _NEED.match(need)
            if m is None:
                continue  # (check_spec refused it)
            users, specifiers = needed.setdefault(canonical(m.group(1)), ([], [] if spec["format"] >= 3 else None))
            users.append(wheel["filename"])
            if specifiers is not None:
                specifiers.extend(p for p in m.group(2).split(",") if p)
    return needed


def _some(items: list[str], most: int = 8) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def provided_check(
    provided: list[str],
    node: dict[str, Any],
    needed: dict[str, tuple[list[str], list[str] | None]] | None = None,
    strict: bool = False,
) -> dict[str, Any]:
    """The node's distributions against the provided set: those the wheels need (``needed``; None: all of them)
    must be installed, at a version every specifier that reached them accepts (None: at the captured version);
    any other difference from the captured base is compared too, and is a note, or, ``strict``, a failure."""
    if not provided:
        return check("provided", "SKIP", "not asked", "none: the lock's [runtime] provides nothing")
    wanted, other_drift, seen, failed = [], [], [], []
    for line in provided:
        name, _, version = line.partition("==")
        key = canonical(name)
        is_needed = strict or needed is None or key in needed
        users, specifiers = (needed or {}).get(key, ([], None))
        exact = strict or specifiers is None
        if is_needed:
            wanted.append(line)
        have = node.get("dists", {}).get(name)
        problem = ""
        drift = ""
        if not have:
            problem = f"{name} not installed"
        else:
            if version and not version_matches(have, version):
                drift = f"{name} is {have}, not {version}"
            refused = [s for s in specifiers or [] if not satisfies(have, s)]
            if refused:
                problem = f"{name} is {have}, not {','.join(refused)}"
            elif drift and exact:
                problem = drift
            if is_needed and not problem:
                seen.append(f"{name} {have}")
        if problem and is_needed:
            failed.append(problem + (f" (needed by {_some(users, 3)})" if users else ""))
        elif problem or drift:
            other_drift.append(problem or drift)
    if strict:
        needed_text = f"every provided distribution ({len(provided)}) at its captured version (--strict)"
    elif needed is None:
        needed_text = f"every provided distribution ({len(provided)}) at its captured version (format 1)"
    else:
        needed_text = (f"the {len(wanted)} of the {len(provided)} provided distributions the wheels need, at a "
                       "version their requirements accept")  # fmt: skip
    found = _some(seen) if seen else ("none of them" if wanted else "nothing needed")
    note = ""
    if other_drift:
        count = f"{len(other_drift)} other difference{'s' if len(other_drift) > 1 else ''}"
        note = (f"note: {count} from the captured base, which the wheels' needs allow: "
                f"{_some(other_drift)} (--strict fails on them)")  # fmt: skip
    if failed:
        return check("provided", "FAIL", found, needed_text, "; ".join(failed) + ("; " + note if note else ""))
    return check("provided", "PASS", found, needed_text, note)


# --------------------------------------------------------------------------- the wheelhouse


class Unreadable(ValueError):
    """The wheelhouse cannot be read: its description or a wheel it names is missing, of another kind or shape."""


def read_regular(path: str, limit: int) -> bytes:
    """The bytes of ``path``, a regular file (a link to one is followed) of at most ``limit`` bytes: a fifo, a
    device (``/dev/zero``), a directory or a larger file is refused, before anything is read from it."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)  # a fifo: no wait for a writer
    fd = os.open(path, flags)
    try:
        _regular(fd, path)
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise Unreadable(f"{path} is larger than {limit} bytes")
    return data


def _regular(fd: int, path: str) -> None:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        kinds = ((stat.S_ISFIFO, "a fifo"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                 (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
        kind = next((text for test, text in kinds if test(mode)), "not a file")
        raise Unreadable(f"{path} is {kind}, not a regular file")


def wheel_metadata(path: str) -> str:
    """The METADATA of the wheel ``path`` (a regular file; the member read up to ``MAX_METADATA_BYTES``)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        _regular(fd, path)
        with os.fdopen(os.dup(fd), "rb") as fh, zipfile.ZipFile(fh) as zf:
            info = next((i for i in zf.infolist() if i.filename.endswith(".dist-info/METADATA")
                         and i.filename.count("/") == 1), None)  # fmt: skip
            if info is None:
                raise Unreadable(f"{path} has no *.dist-info/METADATA")
            if info.file_size > MAX_METADATA_BYTES:
                raise Unreadable(f"{path}: its METADATA says {info.file_size} bytes, more than {MAX_METADATA_BYTES}")
            with zf.open(info) as member:
                data = member.read(MAX_METADATA_BYTES + 1)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError, RuntimeError) as exc:
        raise Unreadable(f"{path} is not a readable wheel ({type(exc).__name__}: {exc})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_METADATA_BYTES:
        raise Unreadable(f"{path}: its METADATA is larger than {MAX_METADATA_BYTES} bytes")
    return data.decode("utf-8", "replace")


def torch_pins(wheel_dir: str, filenames: list[str]) -> dict[str, str]:
    """filename -> the exact torch its METADATA requires (``Requires-Dist: torch==X``), for those that pin one."""
    pins = {}
    for name in filenames:
        text = wheel_metadata(os.path.join(wheel_dir, name))
        for line in text.split("\n\n", 1)[0].splitlines():
            m = re.match(r"Requires-Dist:\s*torch\s*===?\s*([^\s;,]+)\s*$", line)
            if m:
                pins[name] = m.group(1)
    return pins


_WHEEL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+!-]*\.whl$")
_PROVIDED_LINE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(==[A-Za-z0-9.+!_-]+)?$")


def check_spec(spec: object) -> dict[str, Any]:
    """preflight.json as this checker reads it, or :class:`Unreadable` naming the first field of another shape::

    {"format": 3, "archs": [str], "provided": ["name==version" or "name"],
     "build": {"cuda", "torch", "torch_cuda", "glibc", "machine": str, "torch_cxx11_abi": bool or null},
     "wheels": [{"filename": a wheel's file name, "package": str, "cuda": bool, "origin": str,
                 "needs": [name with its version specifiers, "typing-extensions>=4.10.0"]}]}
    (format 2: "needs" holds names only; format 1: no "needs")
    """
    if not isinstance(spec, dict):
        raise Unreadable(f"not a JSON object but {type(spec).__name__}")
    fmt = spec.get("format")
    if isinstance(fmt, bool) or fmt not in READ_FORMATS:
        raise Unreadable(f"format {repr(fmt)[:40]}, this checker reads {', '.join(map(str, READ_FORMATS))}")

    def strings(value: object, where: str) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise Unreadable(f"{where} is not a list of strings")
        return list(value)

    build = spec.get("build", {})
    if not isinstance(build, dict):
        raise Unreadable("build is not an object")
    for key in ("cuda", "torch", "torch_cuda", "glibc", "machine"):
        if not isinstance(build.get(key, ""), str):
            raise Unreadable(f"build.{key} is not a string")
    if build.get("torch_cxx11_abi") is not None and not isinstance(build["torch_cxx11_abi"], bool):
        raise Unreadable("build.torch_cxx11_abi is neither true, false nor null")
    provided = strings(spec.get("provided", []), "provided")
    for line in provided:
        if not _PROVIDED_LINE.match(line):
            raise Unreadable(f"provided: {line[:80]!r} is not 'name==version' or 'name'")
    wheels = spec.get("wheels", [])
    if not isinstance(wheels, list):
        raise Unreadable("wheels is not a list")
    checked = []
    for i, wheel in enumerate(wheels):
        if not isinstance(wheel, dict):
            raise Unreadable(f"wheels[{i}] is not an object")
        filename = wheel.get("filename")
        if not isinstance(filename, str) or not _WHEEL_NAME.match(filename):
            raise Unreadable(f"wheels[{i}].filename {str(filename)[:80]!r} is not the file name of a wheel in the "
                             "wheelhouse")  # fmt: skip
        if not isinstance(wheel.get("package", ""), str) or not isinstance(wheel.get("origin", ""), str):
            raise Unreadable(f"wheels[{i}]: package and origin must be strings")
        if not isinstance(wheel.get("cuda", False), bool):
            raise Unreadable(f"wheels[{i}].cuda is neither true nor false")
        needs = strings(wheel.get("needs", []), f"wheels[{i}].needs")
        bad = [n for n in needs if not _is_need(n)]
        if bad:
            raise Unreadable(f"wheels[{i}].needs: {bad[0][:80]!r} is not a distribution's name with PEP 440 version "
                             "specifiers")  # fmt: skip
        checked.append({"filename": filename, "package": wheel.get("package", ""), "cuda": wheel.get("cuda", False),
                        "origin": wheel.get("origin", ""), "needs": needs})  # fmt: skip
    return {"format": int(fmt), "archs": strings(spec.get("archs", []), "archs"), "build": dict(build),
            "provided": provided, "wheels": checked}  # fmt: skip


def load_spec(wheel_dir: str) -> dict[str, Any]:
    """The wheelhouse's preflight.json, checked (:func:`check_spec`); :class:`Unreadable` (a ValueError) or
    OSError with one line otherwise."""
    path = os.path.join(wheel_dir, SPEC_FILE)
    data = read_regular(path, MAX_SPEC_BYTES)
    try:
        doc = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise Unreadable(f"{path} is nested too deeply") from None
    except ValueError as exc:  # UnicodeDecodeError, JSONDecodeError, an integer of too many digits
        raise Unreadable(f"{path} is not JSON ({str(exc)[:160]})") from None
    try:
        return check_spec(doc)
    except Unreadable as exc:
        raise Unreadable(f"{path}: {exc}") from None


def run(
    wheel_dir: str, *, python: str = "", gpu: str = "auto", library: str = "", strict: bool = False
) -> list[dict[str, Any]]:
    """Every check of the node against the wheelhouse ``wheel_dir`` (its preflight.json)."""
    spec = load_spec(wheel_dir)
    build = spec["build"]
    wheels = [w["filename"] for w in spec["wheels"]]
    cuda_wheels = [w["filename"] for w in spec["wheels"] if w["cuda"]]
    pins = torch_pins(wheel_dir, wheels)  # reads every wheel: an unreadable one stops here, before any check
    provided = spec["provided"]
    names = sorted({"torch", *(line.partition("==")[0] for line in provided)})
    node = probe_python(python or sys.executable, names, torch=bool(pins) or bool(build.get("torch")))
    driver = read_driver(library) if gpu != "off" and spec["archs"] else {}
    results = [
        driver_check(driver, build.get("cuda", ""), gpu),
        gpu_check(driver, spec["archs"], cuda_wheels, gpu),
        glibc_check(wheels, build.get("glibc", ""), glibc_version()),
    ]
    if "error" in node:
        for name in ("python", "torch", "provided"):
            results.append(check(name, "FAIL", node["error"], "an interpreter to install into"))
        return results
    results.append(python_check(wheels, node))
    results.append(torch_check(pins, build, node))
    results.append(provided_check(provided, node, None if spec["format"] < 2 else needed_provided(spec), strict))
    return results


def render(results: list[dict[str, Any]]) -> str:
    lines = []
    for r in results:
        text = "{:<4}  {:<8}  found: {}; needed: {}".format(r["status"], r["check"], r["found"], r["needed"])
        lines.append(text + (" -- " + r["detail"] if r["detail"] else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description="dict[str, Any] this node against what a wheelhouse needs.")
    parser.add_argument("--wheels", default=here, help="the wheelhouse (default: this file's directory)")
    parser.add_argument("--python", default="", help="the interpreter the wheels go into (default: this one)")
    parser.add_argument("--gpu", choices=("auto", "off"), default="auto", help="off: a node without GPUs")
    parser.add_argument("--json", default="", help="also write the report as JSON to this file")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="every provided distribution at its captured version, not only those the wheels need",
    )
    args = parser.parse_args(argv)
    try:
        results = run(args.wheels, python=args.python, gpu=args.gpu, strict=args.strict)
    except (OSError, ValueError) as exc:  # Unreadable is a ValueError
        text = exc.strerror + ": " + str(exc.filename) if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"preflight: cannot read the wheelhouse: {text} ({SPEC_FILE} and the wheels it names come with "
              "`doit wheels`)", file=sys.stderr)  # fmt: skip
        return EXIT_UNREADABLE
    failed = [r for r in results if r["status"] == "FAIL"]
    sys.stdout.write(render(results))
    summary = (
        f"preflight: {len(failed)} of {len(results)} checks failed"
        if failed
        else (f"preflight: this node can take the wheels in {args.wheels}")
    )
    print(summary)
    if args.json:
        report = {"wheels": os.path.abspath(args.wheels), "node": platform.node(), "ok": not failed,
                  "checks": results}  # fmt: skip
        tmp = args.json + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=2, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, args.json)
    return EXIT_FAILED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
