"""Bit-for-bit builds: what every package's build gets so that its wheel depends on its inputs only.

Applied by the build stage to every package alike (no per-package cases);
everything here that can change a wheel's bytes is described by
:func:`key_section`, which enters the action key.

**A canonical build path.** Compilers record the directory they build in: in
DWARF and ``__FILE__`` of host code, and nvcc in device code compiled with
``-lineinfo`` and in the module ids of ``-rdc`` objects. The staged tree is
therefore bind-mounted at ``/tmp/reprostack-build/<package>`` inside a private
mount namespace (``unshare --mount``, with ``--user --map-root-user`` when not
root) and built there, whatever the checkout, cache or stage directory. Where
namespaces are not available (some containers) the build runs in place and
``-ffile-prefix-map`` maps the stage onto the same canonical path; that covers
host code only (device line info then keeps the real path, which
``doit repro`` reports).

**Flags**, appended to what the recipe sets:

- every link drops local symbols (``-Xlinker --discard-all`` in ``LDFLAGS`` for
  setuptools and CMake links, whether gcc or nvcc drives them, and
  ``-Xlinker=--discard-all`` in ``NVCC_APPEND_FLAGS`` for links nvcc drives
  on its own). nvcc compiles through temporary files named
  ``tmpxft_<process id>_...``; those names reach the linked object only as
  local symbols (the ``FILE`` symbol, static initialisers), so two builds of
  one source differ until they are dropped. Global and dynamic symbols stay,
  unlike with ``-s``.
- ``-ffile-prefix-map`` for the build's Python environments (the venv of its
  build closure, whose pybind11 headers extensions compile against, and the
  tool's own venv), in ``CFLAGS``, ``CXXFLAGS`` and nvcc's host compiler.
- ``-frandom-seed=reprostack`` in ``NVCC_APPEND_FLAGS``, where the build's
  nvcc has that option (CUDA 13's does; the toolchain probe records it).
  nvcc names internal-linkage entities
  ``_INTERNAL_<hash>_<length>_<file>_<module id>``; in a translation unit
  with no plain external function to take the module id from, cudafe++ makes
  one from the process id. FA3's kernels, which include CCCL's ``cuda::std``,
  then differ in PTX, SASS and symbol tables at every compile. A fixed seed is
  enough: the name also carries the file's name and a hash of its path.

**Environment**: ``PYTHONHASHSEED=0`` (set iteration order in build scripts,
which can reorder sources or flags), ``TZ=UTC``; ``SOURCE_DATE_EPOCH`` is set
by the build stage.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from tasks.core import proc
from tasks.core.errors import BuildError
from tasks.core.fsutil import write_atomic

#: Bump when anything below changes what a build produces.
REPRO_FORMAT = 2

#: Parent of every package's canonical build directory.
CANONICAL_ROOT = PurePosixPath("/tmp/reprostack-build")
#: Where the build's Python environment (a venv) appears in recorded paths.
CANONICAL_VENV = "/reprostack/venv"

FIXED_ENV = {"PYTHONHASHSEED": "0", "TZ": "UTC"}
#: nvcc's ``-frandom-seed``: replaces the process id in generated names (see above).
NVCC_SEED = "reprostack"
LINK_FLAGS = ("--discard-all",)
FLAG_VARIABLES = ("CFLAGS", "CXXFLAGS", "LDFLAGS", "NVCC_APPEND_FLAGS")

Method = Literal["mount-namespace", "prefix-map"]

# Runs inside the new mount namespace: mount the stage at the canonical path,
# enter the build directory there, run the build.
_ENTER = 'mount --bind "$1" "$2" && cd "$3" && shift 3 && exec "$@"'
#: On a cluster node (tasks/engine/cluster.py), where the mount point may not exist yet.
_ENTER_NODE = 'mkdir -p "$2" && ' + _ENTER
#: Where a build sees its stage at the canonical path: the stage and that path, in the build's environment,
#: so that a compile sent to a cluster node enters the same view there (:func:`on_node`).
ENV_STAGE = "REPRO_STAGE"
ENV_STAGE_SEEN = "REPRO_STAGE_SEEN"


def canonical_dir(package: str) -> PurePosixPath:
    return CANONICAL_ROOT / package


def _unshare_prefix() -> list[str]:
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *user, "--mount", "--propagation", "private", "--"]


def _mountpoint(path: PurePosixPath) -> bool:
    """Create the (empty) mount point ``path``; False when that is not possible."""
    try:
        root = Path(CANONICAL_ROOT)
        if not root.is_dir():
            root.mkdir(parents=True, exist_ok=True)
            os.chmod(root, 0o1777)  # shared by every user of the host, like /tmp
        Path(path).mkdir(exist_ok=True)
    except OSError:
        return False
    return True


def _probe_memo() -> Path | None:
    """Where this user, in these namespaces, keeps the last probe's answer (a no-op then starts no process)."""
    try:
        spaces = "-".join(str(os.stat(f"/proc/self/ns/{ns}").st_ino) for ns in ("user", "mnt"))
    except OSError:
        return None
    return Path(CANONICAL_ROOT, f".method-{os.geteuid()}-{spaces}")


#: The kernel's switches for unprivileged user namespaces: a "prefix-map" answer on record holds while they
#: read as they did when it was probed (an administrator may turn them on; the namespaces stay the same).
_USERNS_SWITCHES = ("/proc/sys/kernel/unprivileged_userns_clone", "/proc/sys/user/max_user_namespaces",
                    "/proc/sys/kernel/apparmor_restrict_unprivileged_userns")  # fmt: skip


def _userns_switches() -> str:
    values = []
    for path in _USERNS_SWITCHES:
        try:
            values.append(Path(path).read_text().strip())
        except OSError:
            values.append("-")
    return ",".join(values)


@functools.cache
def method() -> Method:
    """How builds reach the canonical path on this host (probed once per user and namespace).

    Both answers are kept (:func:`_probe_memo`): a no-op run starts no process and, where the mount is not
    permitted (a container without privileges), says so once, when it probes, not on every run.
    """
    if sys.platform != "linux" or not _mountpoint(CANONICAL_ROOT):
        return "prefix-map"
    memo = _probe_memo()
    try:
        if memo is not None and memo.stat().st_uid == os.geteuid():
            said = memo.read_text()
            if said == "mount-namespace":
                return "mount-namespace"  # the common case reads no switch
            if said == f"prefix-map {_userns_switches()}":
                return "prefix-map"
    except OSError:
        pass
    probe = [*_unshare_prefix(), "sh", "-c", 'mount --bind "$1" "$1" && echo ok', "sh", str(CANONICAL_ROOT)]
    done = proc.query(probe, timeout=120, text=True, tolerant=True)
    found: Method = "mount-namespace" if done.returncode == 0 and done.stdout.strip() == "ok" else "prefix-map"
    if memo is not None:
        with contextlib.suppress(OSError):
            write_atomic(memo, "mount-namespace" if found == "mount-namespace" else f"prefix-map {_userns_switches()}")
    if found == "prefix-map":
        # The ordinary unprivileged case (a container), not a fault: host code gets the canonical paths through
        # -ffile-prefix-map and pure-Python wheels hold none; only nvcc's device code keeps the build directory.
        print(
            "note: building in place with -ffile-prefix-map (unshare --mount is not permitted here): host code "
            "records the canonical path; nvcc's device line info keeps the build directory",
            flush=True,
        )
    return found


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one build's staged tree is, and where the build sees it."""

    stage: Path  # the staged tree on disk
    seen: PurePosixPath  # the path the build uses for it
    method: Method

    def path(self, real: Path) -> str:
        """The path the build uses for ``real``, a path inside the stage."""
        if self.method == "prefix-map":
            return str(real)
        return str(self.seen / real.relative_to(self.stage))

    def command(self, argv: Sequence[str], build_dir: Path) -> list[str]:
        """``argv`` run in ``build_dir`` (inside the stage) as the build sees it."""
        if self.method == "prefix-map":
            return list(argv)
        if not _mountpoint(self.seen):
            raise BuildError(f"cannot create the mount point {self.seen}: check the permissions of {CANONICAL_ROOT}")
        return [*_unshare_prefix(), "sh", "-c", _ENTER, "reprostack-build", str(self.stage), str(self.seen),
                self.path(build_dir), *argv]  # fmt: skip


def on_node(argv: Sequence[str], cwd: str, env: Mapping[str, str]) -> tuple[list[str], str]:
    """A compile of a build at the canonical path (``argv`` run in ``cwd``, with the build's ``env``) as a
    cluster node runs it: in a mount namespace of its own with the stage (on the shared filesystem) at
    the same canonical path, so that it compiles the same object there. Other compiles as they are."""
    stage, seen = env.get(ENV_STAGE, ""), env.get(ENV_STAGE_SEEN, "")
    if not stage or not seen or not (cwd == seen or cwd.startswith(seen + "/")):
        return list(argv), cwd
    return [*_unshare_prefix(), "sh", "-c", _ENTER_NODE, "reprostack-build", stage, seen, cwd, *argv], "/"


def placement(package: str, stage: Path) -> Placement:
    return Placement(stage=stage, seen=canonical_dir(package), method=method())


def prefix_maps(
    place: Placement, prefix: str = sys.prefix, base_prefix: str = sys.base_prefix, build_env: str = ""
) -> list[tuple[str, str]]:
    """``-ffile-prefix-map`` pairs, most general first (gcc applies the last one that matches). ``build_env``: the
    venv of the build closure (tasks/env/buildenv.py), whose headers (pybind11's) the build compiles against."""
    maps = []
    if prefix != base_prefix:
        maps.append((prefix, CANONICAL_VENV))
    if build_env:
        maps.append((build_env, CANONICAL_VENV))
    if place.method == "prefix-map":
        maps.append((str(place.stage), str(place.seen)))
    usable = [(old, new) for old, new in maps if not any(c.isspace() or c == "," for c in old)]
    return sorted(usable, key=lambda m: len(m[0]))


def flags(maps: Sequence[tuple[str, str]], *, nvcc_seed: bool = False) -> dict[str, list[str]]:
    """Flags appended to each of :data:`FLAG_VARIABLES`."""
    cflags = [f"-ffile-prefix-map={old}={new}" for old, new in maps]
    seed = [f"-frandom-seed={NVCC_SEED}"] if nvcc_seed else []
    return {
        "CFLAGS": cflags,
        "CXXFLAGS": cflags,
        # -Xlinker, not -Wl,: nvcc understands it too, where CMake or a script links with nvcc.
        "LDFLAGS": [arg for f in LINK_FLAGS for arg in ("-Xlinker", f)],
        "NVCC_APPEND_FLAGS": [f"-Xcompiler={f}" for f in cflags] + [f"-Xlinker={f}" for f in LINK_FLAGS] + seed,
    }


def apply(env: Mapping[str, str], place: Placement, *, nvcc_seed: bool = False, build_env: str = "") -> dict[str, str]:
    """``env`` with the reproducibility environment and flags added (after the recipe's own flags)."""
    out = dict(env)
    out.update(FIXED_ENV)
    if place.method == "mount-namespace":
        out.update({ENV_STAGE: str(place.stage), ENV_STAGE_SEEN: str(place.seen)})
    for name, extra in flags(prefix_maps(place, build_env=build_env), nvcc_seed=nvcc_seed).items():
        value = " ".join([env.get(name, ""), *extra]).strip()
        if value:
            out[name] = value
    return out


def key_section(build_method: Method, *, nvcc_seed: bool = False) -> dict[str, Any]:
    """What this module does to a build, without machine-specific paths: part of the action key."""
    symbolic = [("<python environment>", CANONICAL_VENV)]
    if build_method == "prefix-map":
        symbolic.append(("<stage>", f"{CANONICAL_ROOT}/<package>"))
    return {
        "format": REPRO_FORMAT,
        "build_path": {"root": str(CANONICAL_ROOT), "method": build_method},
        "env": dict(FIXED_ENV),
        "flags": flags(symbolic, nvcc_seed=nvcc_seed),
    }
