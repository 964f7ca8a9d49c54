"""Device code in shared objects: which SASS and PTX an object carries (``cuobjdump``'s listing), whether
it covers the target architectures, and where ``cuobjdump`` is."""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tasks.store.manifest import ARCH_PATTERN

CUOBJDUMP_HINT = (
    "install it with `pip install nvidia-cuda-cuobjdump` (or put the CUDA toolkit's bin/ on PATH, or set CUDA_HOME)"
)


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
