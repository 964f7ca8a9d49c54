"""Parse and validate ``sources.lock`` into frozen dataclasses.

Pure: no doit, no network, no subprocesses. Validation collects every
problem of the file before raising, and each message names the file, the
entry and the fix ("Perhaps you meant ...").
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name

from tasks.core.errors import LockError
from tasks.core.imageref import is_digest, parse_reference
from tasks.lock import kinds
from tasks.lock.kinds import Source as Source
from tasks.lock.kinds import Submodule as Submodule
from tasks.lock.schema import SHA256_RE
from tasks.lock.schema import Field as _Field
from tasks.lock.schema import Problems as _Problems
from tasks.lock.schema import is_bool as _is_bool
from tasks.lock.schema import is_int as _is_int
from tasks.lock.schema import is_number as _is_number
from tasks.lock.schema import is_sha256 as _is_sha256
from tasks.lock.schema import is_str as _is_str
from tasks.lock.schema import is_str_list as _is_str_list
from tasks.lock.schema import is_str_table as _is_str_table
from tasks.lock.schema import is_table as _is_table
from tasks.lock.schema import suggest as _suggest

LOCK_FORMAT = 1

ARCH_RE = re.compile(r"^sm_(\d+)([af]?)$")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PLACEHOLDER_RE = re.compile(r"\{([a-z_]+)\}")

#: Placeholders a package's ``env`` values may use; filled from the lock's
#: toolchain (archs) and the detected toolchain (cudnn_path).
ENV_PLACEHOLDERS = (
    "archs",
    "archs_semicolon",
    "torch_arch_list",
    "cmake_archs",
    "cuda_gencode",
    "cudnn_path",
    "cuda_home",
)
TOOLCHAIN_EXTRAS = ("cudnn",)
#: Placeholders that come from the CUDA install: a package using one needs nvcc to be found.
CUDA_PLACEHOLDERS = ("cuda_home",)
#: Placeholders filled from ``[toolchain] archs``: a package using one needs that list.
ARCH_PLACEHOLDERS = ("archs", "archs_semicolon", "torch_arch_list", "cmake_archs", "cuda_gencode")


# --------------------------------------------------------------------------- model


@dataclass(frozen=True, kw_only=True)
class WheelPin:
    """One wheel of the hermetic toolchain: an exact version and the sha256 of each acceptable file.

    ``hashes`` is empty only in a lock read with ``require_pins=False`` (`doit lock` fills it).
    """

    name: str
    version: str
    hashes: tuple[str, ...]

    def requirement(self) -> str:
        """The pin as a line of a pip requirements file (``--require-hashes`` form)."""
        return " ".join([f"{self.name}=={self.version}", *(f"--hash=sha256:{h}" for h in self.hashes)])


@dataclass(frozen=True, kw_only=True)
class PatchRef:
    """A patch taken from a pinned source, by path (``{source = "infir2", path = "docker/patch/x.patch"}``)."""

    source: str
    path: str
    strip: int = 1  # git apply -p<strip>: leading path components of the diff's names to drop

    @property
    def name(self) -> str:
        return f"{self.source}:{self.path}"


@dataclass(frozen=True, kw_only=True)
class Verify:
    imports: tuple[str, ...] = ()
    smoke: str = ""


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """``[runtime]``: the environment's runtime requirements, what the target provides, the resolved closure."""

    requirements: tuple[str, ...] = ()
    provided: tuple[tuple[str, str], ...] = ()  # (canonical name, exact version, or "" for whatever the target has)
    python: str = ""  # the target's CPython, "3.12"
    #: The base's interpreter (``[runtime] base_python``): `doit lock` captures ``provided`` from what it has
    #: installed, and the resolution keeps every requirement of those distributions ('' = provided by hand).
    base_python: str = ""
    #: ``base_image``: the base is this image (``base_python`` the interpreter in it, python3 if unset).
    base_image: str = ""
    #: ``base_capture``: a capture of the base made on the node by tasks/outside/capture_base.py (a path relative to
    #: the lock's folder), for a base this host cannot run (a cluster node without network).
    base_capture: str = ""
    platforms: tuple[str, ...] = ()  # pip --platform tags; empty: tasks/env/closure.py's default
    resolved: tuple[WheelPin, ...] = ()
    resolved_from: str = ""
    #: Checks of the environment as a whole (imports, a smoke script), run by `doit verify` after the wheels'.
    verify: Verify = field(default_factory=lambda: Verify())

    def digest(self) -> str:
        """What the closure was resolved from: requirements, provided set and target (``resolved_from``)."""
        provided = sorted(f"{n}=={v}" if v else n for n, v in self.provided)
        doc = {"requirements": sorted(self.requirements), "provided": provided, "python": self.python,
               "platforms": list(self.platforms)}  # fmt: skip
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    @property
    def provided_versions(self) -> dict[str, str]:
        return dict(self.provided)


@dataclass(frozen=True, kw_only=True)
class Toolchain:
    """What the build environment must provide."""

    python: str = ""
    torch: str = ""
    torch_cuda: str = ""
    cuda: str = ""
    archs: tuple[str, ...] = ()
    #: ``[toolchain.hermetic]``: wheels installed into a build environment of
    #: their own (tasks/env/hermetic.py) instead of using the host's CUDA; empty: off.
    hermetic: tuple[WheelPin, ...] = ()
    #: ``[toolchain.hermetic] wheels``: sources of kind "wheel" installed there too (a pinned torch, say).
    hermetic_wheels: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Package:
    """How one wheel is built."""

    name: str
    source: str
    overlays: tuple[tuple[str, str], ...] = ()
    subdir: str = ""
    patches: tuple[str | PatchRef, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    build_requires: tuple[str, ...] = ()
    pip_args: tuple[str, ...] = ()
    jobs_env: tuple[str, ...] = ("MAX_JOBS",)
    mem_per_job_gb: float = 2.0
    cuda: bool = False
    toolchain_extras: tuple[str, ...] = ()
    enabled: bool = True
    #: The project name of the wheel it builds ('' = the package's name); two packages of one lock
    #: never build the same distribution.
    distribution: str = ""
    #: Its source is a wheel file (kind "wheel"): placed in the wheelhouse as is, not built.
    prebuilt: bool = False
    #: Whether its wheel's Requires-Dist enter the runtime closure (false: like pip --no-deps).
    deps: bool = True
    #: Skipped, with one line saying why, where the host lacks what it needs (nvcc, torch),
    #: instead of failing the run (the example lock's CUDA and torch fixtures); never for the real stack.
    optional: bool = False
    verify: Verify = field(default_factory=Verify)
    #: Why this package's wheel does not pin the torch it was built against ('' = it does: a package
    #: that builds against torch gets ``Requires-Dist: torch==<that torch's version>``, see tasks/stages/build.py).
    torch_unpinned: str = ""

    def source_names(self) -> tuple[str, ...]:
        return (self.source, *(name for _, name in self.overlays))

    def patch_sources(self) -> tuple[str, ...]:
        """Sources some of its patches come from (they must be fetched before it builds)."""
        return tuple(dict.fromkeys(p.source for p in self.patches if isinstance(p, PatchRef)))

    @property
    def distribution_name(self) -> str:
        """The canonical project name of the wheel this package builds."""
        return str(canonicalize_name(self.distribution or self.name))

    @property
    def needs_cuda(self) -> bool:
        """Whether the build compiles CUDA or reads the CUDA install (nvcc, its headers)."""
        return self.cuda or any(f"{{{ph}}}" in v for _, v in self.env for ph in CUDA_PLACEHOLDERS)

    @property
    def compiles_extension(self) -> bool:
        """Whether the build compiles a C/C++/CUDA extension against Python (so needs Python's C headers):
        a CUDA package, a torch extension, or one whose build requirements are an extension toolkit."""
        kits = {"pybind11", "cython", "nanobind", "scikit-build-core", "torch"}
        return self.cuda or any(canonicalize_name(Requirement(r).name) in kits for r in self.build_requires)

    @property
    def needs_torch(self) -> bool:
        """Whether the build imports torch (its build requirements name it)."""
        return any(canonicalize_name(Requirement(r).name) == "torch" for r in self.build_requires)

    @property
    def pins_torch(self) -> bool:
        """Whether its wheel records the exact torch it was compiled against (``Requires-Dist: torch==...``)."""
        return self.needs_torch and not self.prebuilt and not self.torch_unpinned


#: What every build closure holds besides a package's build requirements: the frontend that runs the build.
BUILD_FRONTEND = ("pip",)


def build_digest(pkg: Package, python: str) -> str:
    """What a package's build closure was resolved from (``[build.NAME] resolved_from``): its build requirements
    (torch is the base's, not the closure's), the frontend and the lock's Python range."""
    doc = {"requirements": sorted(pkg.build_requires), "frontend": list(BUILD_FRONTEND), "python": python}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class BuildClosure:
    """``[build.NAME]``: the exact, hash-pinned wheels a package's build runs with (`doit lock` writes it)."""

    resolved: tuple[WheelPin, ...] = ()
    resolved_from: str = ""


@dataclass(frozen=True, kw_only=True)
class Profile:
    name: str
    description: str = ""
    packages: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: ``[profiles.NAME.runtime]``: this profile's environment, in place of the lock's ``[runtime]``.
    runtime: Runtime | None = None


@dataclass(frozen=True, kw_only=True)
class ImageSpec:
    """``[image]``: the runtime image, on a base pinned by digest (see tasks/image/image.py)."""

    base: str
    digest: str = ""
    name: str = "reprostack"
    python: str = "python3"
    prefix: str = "/opt/reprostack"
    docker_dir: Path = Path("docker")
    #: Variables the image's config sets, over the base's (a cache path: ``TORCHINDUCTOR_CACHE_DIR``).
    env: Mapping[str, str] = field(default_factory=dict)
    #: Paths the image's config declares as volumes (``VOLUME``): where a directory is meant to be mounted.
    volumes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class BuilderSpec:
    """``[builder]``: the image whose toolchain builds the wheels (see tasks/env/build_container.py)."""

    image: str
    digest: str = ""
    python: str = "python3"


@dataclass(frozen=True, kw_only=True)
class Lock:
    path: Path
    sha256: str
    toolchain: Toolchain
    sources: Mapping[str, Source]
    packages: Mapping[str, Package]
    profiles: Mapping[str, Profile]
    patches_dir: Path
    unpinned: tuple[str, ...] = ()
    #: Where each of ``unpinned`` is (``sources.NAME``, ``runtime``, ``profiles.NAME.runtime``, ...).
    unpinned_where: tuple[str, ...] = ()
    image: ImageSpec | None = None
    builder: BuilderSpec | None = None
    runtime: Runtime | None = None
    #: ``[build.NAME]`` by package: each package's build closure.
    build: Mapping[str, BuildClosure] = field(default_factory=dict)

    def build_closure(self, pkg: Package) -> BuildClosure | None:
        """``pkg``'s build closure, if the lock has one resolved for its build requirements as they are now
        (a profile that changes them needs `doit lock` again)."""
        found = self.build.get(pkg.name)
        if found is None or found.resolved_from != build_digest(pkg, self.toolchain.python):
            return None
        return found

    def runtime_for(self, profile: str = "default") -> Runtime | None:
        """The environment of ``profile``: its own ``[profiles.NAME.runtime]``, else the lock's ``[runtime]``."""
        prof = self.profiles.get(profile)
        return prof.runtime if prof is not None and prof.runtime is not None else self.runtime

    def runtimes(self) -> list[tuple[str, Runtime]]:
        """Every runtime section, as (where, runtime): ``runtime`` and each ``profiles.NAME.runtime``."""
        found = [("runtime", self.runtime)] + [(f"profiles.{n}.runtime", p.runtime) for n, p in self.profiles.items()]
        return [(where, rt) for where, rt in found if rt is not None]

    def sources_for(self, profile: str = "default") -> tuple[str, ...]:
        """The sources a build of ``profile`` reads: its packages', their patches', the hermetic toolchain's."""
        needed = {s for pkg in self.resolve(profile) for s in (*pkg.source_names(), *pkg.patch_sources())}
        needed.update(self.toolchain.hermetic_wheels)
        return tuple(name for name in self.sources if name in needed)

    def unpinned_for(self, profile: str = "default") -> tuple[str, ...]:
        """The open pins a build of ``profile`` needs: its packages' sources, the hermetic toolchain, its runtime.

        A pin only another profile needs (a wheel source its packages leave out, another profile's
        runtime) does not stop this one.
        """
        sources = set(self.sources_for(profile))
        prof = self.profiles.get(profile)
        own = f"profiles.{profile}.runtime" if prof is not None and prof.runtime is not None else "runtime"

        def needed(where: str) -> bool:
            if where.startswith("sources."):
                return where.split(".")[1] in sources
            if where == "runtime" or where.startswith("profiles."):
                return where == own
            return True

        return tuple(msg for msg, where in zip(self.unpinned, self.unpinned_where, strict=True) if needed(where))

    def patch_path(self, package: str, patch: str) -> Path:
        return self.patches_dir / package / patch

    def resolve(self, profile: str = "default") -> tuple[Package, ...]:
        """The enabled packages of ``profile``, with its overrides applied."""
        if profile in ("", "default"):
            overrides: Mapping[str, Mapping[str, Any]] = {}
        elif profile in self.profiles:
            overrides = self.profiles[profile].packages
        else:
            known = ", ".join(["default", *self.profiles]) or "default"
            raise LockError(
                f"{self.path}: unknown profile {profile!r}{_suggest(profile, self.profiles)}; "
                f"profiles in this lock: {known}"
            )
        result = []
        for name, pkg in self.packages.items():
            over = overrides.get(name)
            if over:
                pkg = _apply_override(pkg, over)
            if pkg.enabled:
                result.append(pkg)
        return tuple(result)


def _apply_override(pkg: Package, over: Mapping[str, Any]) -> Package:
    changes: dict[str, Any] = {}
    for key, value in over.items():
        if key == "env":
            merged = dict(pkg.env)
            merged.update(value)
            changes["env"] = tuple(sorted(merged.items()))
        elif key == "verify":
            changes["verify"] = Verify(
                imports=tuple(value.get("imports", pkg.verify.imports)),
                smoke=value.get("smoke", pkg.verify.smoke),
            )
        elif key == "overlays":
            changes["overlays"] = tuple(sorted(value.items()))
        elif key == "patches":
            changes["patches"] = tuple(_patch_entry(v) for v in value)
        elif isinstance(value, list):
            changes[key] = tuple(value)
        else:
            changes[key] = value
    return replace(pkg, **changes)


# --------------------------------------------------------------------------- schema


PATCH_REF_FIELDS = ("source", "path", "strip")


def _is_patch_list(v: Any) -> str | None:
    ok = isinstance(v, list) and all(
        isinstance(x, str)
        or (
            isinstance(x, dict)
            and set(x) <= set(PATCH_REF_FIELDS)
            and isinstance(x.get("source"), str)
            and isinstance(x.get("path"), str)
            and isinstance(x.get("strip", 1), int)
        )
        for x in v
    )
    return (
        None
        if ok
        else ('must be a list of patch file names, or tables {source = "SOURCE", path = "path/in/it.patch", strip = 1}')
    )


def _patch_entry(raw: Any) -> str | PatchRef:
    if isinstance(raw, str):
        return raw
    return PatchRef(source=raw["source"], path=raw["path"], strip=int(raw.get("strip", 1)))


def _is_specifier(v: Any) -> str | None:
    if not isinstance(v, str):
        return "must be a version specifier string such as '>=3.11' or '==2.11.*'"
    try:
        SpecifierSet(v)
    except InvalidSpecifier:
        return f"is not a valid version specifier: {v!r} (write e.g. '==2.11.*' or '>=3.11')"
    return None


def _is_archs(v: Any) -> str | None:
    if not isinstance(v, list) or not v:
        return "must be a non-empty list such as ['sm_90a']"
    bad = [a for a in v if not isinstance(a, str) or not ARCH_RE.match(a)]
    return f"has invalid architectures {bad} (write e.g. 'sm_90a' or 'sm_80')" if bad else None


TOP_FIELDS = {
    "format": _Field(_is_int, required=True),
    "patches_dir": _Field(_is_str),
    "toolchain": _Field(_is_table),
    "sources": _Field(_is_table, required=True),
    "packages": _Field(_is_table, required=True),
    "profiles": _Field(_is_table),
    "image": _Field(_is_table),
    "builder": _Field(_is_table),
    "runtime": _Field(_is_table),
    "build": _Field(_is_table),
}
BUILD_FIELDS = {"resolved": _Field(_is_str_list), "resolved_from": _Field(_is_sha256)}
TOOLCHAIN_FIELDS = {
    "python": _Field(_is_specifier),
    "torch": _Field(_is_specifier),
    "torch_cuda": _Field(_is_specifier),
    "cuda": _Field(_is_specifier),
    "archs": _Field(_is_archs),  # required where a package compiles CUDA or uses an arch placeholder
    "hermetic": _Field(_is_table),
}
HERMETIC_FIELDS = {"requirements": _Field(_is_str_list), "wheels": _Field(_is_str_list)}
#: ``name==version --hash=sha256:<hex> [--hash=sha256:<hex> ...]``, as ``pip hash`` and ``pip-compile`` write them.
HASH_OPTION_RE = re.compile(r"^--hash[= ](\S*)$")
PACKAGE_FIELDS = {
    "source": _Field(_is_str, required=True),
    "overlays": _Field(_is_str_table),
    "subdir": _Field(_is_str),
    "patches": _Field(lambda v: _is_patch_list(v)),
    "env": _Field(_is_str_table),
    "build_requires": _Field(_is_str_list),
    "pip_args": _Field(_is_str_list),
    "jobs_env": _Field(_is_str_list),
    "mem_per_job_gb": _Field(_is_number),
    "cuda": _Field(_is_bool),
    "toolchain_extras": _Field(_is_str_list),
    "enabled": _Field(_is_bool),
    "optional": _Field(_is_bool),
    "distribution": _Field(_is_str),
    "deps": _Field(_is_bool),
    "verify": _Field(_is_table),
    "torch_unpinned": _Field(_is_str),
}
VERIFY_FIELDS = {"imports": _Field(_is_str_list), "smoke": _Field(_is_str)}
PROFILE_FIELDS = {"description": _Field(_is_str), "packages": _Field(_is_table), "runtime": _Field(_is_table)}


def _is_image_ref(v: Any) -> str | None:
    if not isinstance(v, str):
        return "must be an image reference with a tag, such as 'nvcr.io/nvidia/pytorch:25.09-py3'"
    try:
        ref = parse_reference(v)
    except ValueError as exc:
        return str(exc)
    return None if ref.tag else f"{v!r} needs a tag (such as ':25.09-py3'), which `doit lock` resolves to a digest"


def _is_digest(v: Any) -> str | None:
    ok = isinstance(v, str) and is_digest(v)
    return None if ok else f"must be 'sha256:' and 64 lowercase hex digits, got {v!r}"


def _is_abs_path(v: Any) -> str | None:
    ok = isinstance(v, str) and v.startswith("/") and ".." not in Path(v).parts
    return None if ok else f"must be an absolute path inside the image, got {v!r}"


def _is_repository(v: Any) -> str | None:
    try:
        ok = isinstance(v, str) and ":" not in v and parse_reference(v).tag == ""
    except ValueError:
        ok = False
    return None if ok else f"must be a repository name without tag, such as 'reprostack', got {v!r}"


#: What the image sets from ``[image] prefix`` itself (tasks/image/layer.py): ``[image] env`` may not set them.
IMAGE_OWN_ENV = ("PATH", "VIRTUAL_ENV")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _is_image_env(v: Any) -> str | None:
    if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
        return "must be a table of strings, such as { TORCHINDUCTOR_CACHE_DIR = '/var/cache/torch-compile' }"
    bad = [k for k in v if not ENV_NAME_RE.match(k)]
    if bad:
        return f"has invalid variable names {bad} (letters, digits and '_', not starting with a digit)"
    own = [k for k in v if k in IMAGE_OWN_ENV]
    return f"may not set {own}: the image sets them from [image] prefix" if own else None


def _is_volume_list(v: Any) -> str | None:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        return "must be a list of absolute paths, such as ['/var/cache/torch-compile']"
    bad = [x for x in v if _is_abs_path(x) or x == "/" or str(PurePosixPath(x)) != x]
    if bad:
        return (
            f"has paths {bad} that are not absolute paths in plain form "
            "(such as '/var/cache/x': no '..', '.', '//' or trailing '/')"
        )
    doubled = sorted({x for x in v if v.count(x) > 1})
    return f"names {doubled} more than once" if doubled else None


IMAGE_FIELDS = {
    "base": _Field(_is_image_ref, required=True),
    "digest": _Field(_is_digest),
    "name": _Field(_is_repository),
    "python": _Field(_is_str),
    "prefix": _Field(_is_abs_path),
    "docker_dir": _Field(_is_str),
    "env": _Field(_is_image_env),
    "volumes": _Field(_is_volume_list),
}
BUILDER_FIELDS = {
    "image": _Field(_is_image_ref, required=True),
    "digest": _Field(_is_digest),
    "python": _Field(_is_str),
}
# What a profile may override: everything but the identity of the sources.
PROFILE_PACKAGE_FIELDS = {k: v for k, v in PACKAGE_FIELDS.items() if k not in ("source", "distribution")}


# --------------------------------------------------------------------------- loading


def load_lock(path: Path, *, require_pins: bool = True) -> Lock:
    """Read and validate a lock file; raise :class:`LockError` listing every problem."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise LockError(f"{path}: lock file not found (set lock=PATH or REPRO_LOCK)") from None
    except OSError as exc:
        raise LockError(f"{path}: cannot read the lock file: {exc.strerror or exc}") from None
    try:
        doc = tomllib.loads(data.decode("utf-8"))
        return parse_lock(doc, path=path, sha256=hashlib.sha256(data).hexdigest(), require_pins=require_pins)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise LockError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively (about 490 levels overflow the stack), and
        # so would any check or message of ours that walks or prints such a value: no lock nests that deep.
        raise LockError(f"{path}: not a lock this tool reads: a value is nested too deeply") from None


def parse_lock(
    doc: Mapping[str, Any],
    *,
    path: Path,
    sha256: str = "",
    check_files: bool = True,
    require_pins: bool = True,
) -> Lock:
    """Validate a parsed lock document.

    With ``require_pins=False`` (for `doit lock`), pins that `doit lock` fills
    in may be missing; they are listed in :attr:`Lock.unpinned`.
    """
    p = _Problems(path)
    p.check_table("", doc, TOP_FIELDS)
    if isinstance(doc.get("format"), int) and doc["format"] != LOCK_FORMAT:
        p.add(
            "",
            f"format {doc['format']} is not supported; this tool reads format {LOCK_FORMAT}",
        )
    toolchain = _parse_toolchain(p, doc.get("toolchain"))
    sources = _parse_sources(p, doc.get("sources"))
    patches_dir = (
        path.parent / doc.get("patches_dir", "patches") if isinstance(doc.get("patches_dir", ""), str) else path.parent
    )
    # Cross-references are checked against every declared name, so one bad
    # entry does not cascade into errors about the entries that name it.
    raw_sources, raw_packages = doc.get("sources"), doc.get("packages")
    declared_sources: Mapping[str, Any] = raw_sources if isinstance(raw_sources, dict) else {}
    declared_packages: Mapping[str, Any] = raw_packages if isinstance(raw_packages, dict) else {}
    files_dir = patches_dir if check_files else None
    packages = _parse_packages(p, doc.get("packages"), declared_sources, files_dir)
    profiles = _parse_profiles(p, doc.get("profiles"), declared_packages, declared_sources, files_dir)
    image, builder = _parse_images(p, doc.get("image"), doc.get("builder"), path.parent)
    runtime = _parse_runtime(p, doc.get("runtime"))
    build = _parse_build(p, doc.get("build"), packages)
    _check_wheel_sources(p, sources, packages, toolchain, runtime)
    _check_archs(p, doc.get("toolchain"), packages)
    p.raise_if_any(require_pins)
    return Lock(
        unpinned=tuple(p.pins),
        unpinned_where=tuple(p.pin_wheres),
        path=path,
        sha256=sha256,
        toolchain=toolchain,
        sources=sources,
        packages=packages,
        profiles=profiles,
        patches_dir=patches_dir,
        image=image,
        builder=builder,
        runtime=runtime,
        build=build,
    )


def _parse_build(p: _Problems, raw: Any, packages: Mapping[str, Package]) -> dict[str, BuildClosure]:
    """``[build.NAME]`` of each package built from source. One missing, or resolved from other build requirements,
    is refused by the build that needs it (:meth:`Lock.build_closure`), naming `doit lock`."""
    raw = raw if isinstance(raw, dict) else {}
    found: dict[str, BuildClosure] = {}
    for name, entry in raw.items():
        where = f"build.{name}"
        if name not in packages:
            p.add(where, f"names no package of the lock{_suggest(name, packages)} (remove it, or run `doit lock`)")
            continue
        if not p.check_table(where, entry, BUILD_FIELDS):
            continue
        pins = _parse_pins(p, f"{where}.resolved", entry.get("resolved", []), hashed=True)
        found[name] = BuildClosure(resolved=pins, resolved_from=entry.get("resolved_from", ""))
    return found


RUNTIME_FIELDS = {
    "requirements": _Field(_is_str_list),
    "provided": _Field(_is_str_list),
    "python": _Field(_is_str),
    "platforms": _Field(_is_str_list),
    "resolved": _Field(_is_str_list),
    "resolved_from": _Field(_is_sha256),
    "verify": _Field(_is_table),
    "base_python": _Field(_is_str),
    "base_image": _Field(_is_str),
    "base_capture": _Field(_is_str),
}
PYTHON_TARGET_RE = re.compile(r"^3\.\d+$")


def _parse_runtime(p: _Problems, raw: Any, where: str = "runtime") -> Runtime | None:
    """``[runtime]`` or a profile's; a closure not resolved yet (or from other inputs) is left to `doit lock`."""
    if raw is None or not p.check_table(where, raw, RUNTIME_FIELDS):
        return None
    verify = raw.get("verify", {})
    if not p.check_table(f"{where}.verify", verify, VERIFY_FIELDS):
        verify = {}
    requirements = []
    for line in raw.get("requirements", []):
        try:
            Requirement(line)
        except InvalidRequirement as exc:
            p.add(where, f"requirement {line!r} is not valid: {exc}")
            continue
        requirements.append(line)
    provided: dict[str, str] = {}
    for line in raw.get("provided", []):
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            p.add(where, f"provided {line!r} is not valid: {exc}")
            continue
        specs = list(req.specifier)
        exact = len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version
        if (specs and not exact) or req.extras or req.url or req.marker:
            p.add(where, f"provided {line!r} must be 'name==version' (what the target has installed) or a bare "
                  "'name' (whatever version the target has)")  # fmt: skip
            continue
        provided[str(canonicalize_name(req.name))] = specs[0].version if specs else ""
    python = raw.get("python", "")
    if "python" not in raw:
        p.unpinned(where, "python (the target's CPython) is not set yet (run `doit lock`: it writes base_python's "
                   "version, else this interpreter's)")  # fmt: skip
    elif not PYTHON_TARGET_RE.match(python):
        p.add(where, f"python must be the target's CPython as '3.Y' (such as '3.12'), got {python!r}")
    resolved = _parse_pins(p, f"{where}.resolved", raw.get("resolved", []), hashed=True)
    owners: dict[str, str] = {}
    for pin in resolved:  # a file is a wheel of one project at one version: a sha256 under two pins is a repoint
        for sha in pin.hashes:
            other = owners.setdefault(sha, pin.name)
            if other != pin.name:
                p.add(f"{where}.resolved", f"{pin.name}=={pin.version} has the sha256 {sha[:12]}… of the pin of "
                      f"{other} (one file is one wheel): re-pin with `doit lock update=runtime`")  # fmt: skip
    runtime = Runtime(
        requirements=tuple(requirements),
        provided=tuple(sorted(provided.items())),
        python=python,
        platforms=tuple(raw.get("platforms", ())),
        resolved=resolved,
        resolved_from=raw.get("resolved_from", ""),
        verify=Verify(imports=tuple(verify.get("imports", ())), smoke=verify.get("smoke", "")),
        base_python=raw.get("base_python", ""),
        base_image=raw.get("base_image", ""),
        base_capture=raw.get("base_capture", ""),
    )
    if runtime.base_capture and (runtime.base_python or runtime.base_image):
        p.add(where, "base_capture is a capture of the base made elsewhere: it takes no base_python or base_image")
    if runtime.base_capture and leaves_folder(runtime.base_capture):
        p.add(where, f"base_capture {runtime.base_capture!r} must be a path inside the lock's folder")
    # Resolved even without requirements of its own: the wheels' Requires-Dist enter the resolution.
    if "python" in raw and runtime.resolved_from != runtime.digest():
        p.unpinned(where, "the closure is not resolved for these requirements, provided set and target yet "
                   "(run `doit lock` to resolve and pin it)")  # fmt: skip
    return runtime


def _check_wheel_sources(
    p: _Problems, sources: Mapping[str, Source], packages: Mapping[str, Package], toolchain: Toolchain,
    runtime: Runtime | None,
) -> None:  # fmt: skip
    """Prebuilt packages, patches and hermetic wheels against the kinds of the sources they name."""
    for name, pkg in packages.items():
        for ref in pkg.patches:
            if isinstance(ref, PatchRef):
                patch_src = sources.get(ref.source)
                if patch_src is None:
                    p.add(f"packages.{name}", f"patch source {ref.source!r} is not defined under [sources]"
                          f"{_suggest(ref.source, sources)}")  # fmt: skip
                elif kinds.of(patch_src.kind).wheel:
                    p.add(f"packages.{name}", f"patch source {ref.source!r} is a wheel; patches come from source trees")
                if leaves_folder(ref.path):
                    p.add(f"packages.{name}", f"patch path {ref.path!r} must be relative and inside its source")
    for wheel in toolchain.hermetic_wheels:
        if wheel not in sources:
            p.add("toolchain.hermetic", f"wheels names unknown source {wheel!r}{_suggest(wheel, sources)}")
        elif not kinds.of(sources[wheel].kind).wheel:
            p.add("toolchain.hermetic", f"wheels: source {wheel!r} is of kind {sources[wheel].kind!r}, not 'wheel'")
    del runtime  # a provided package rebuilt by us must build the provided version: checked when it is built


def _parse_images(
    p: _Problems, raw_image: Any, raw_builder: Any, lock_dir: Path
) -> tuple[ImageSpec | None, BuilderSpec | None]:
    """``[image]`` and ``[builder]``. A missing digest is not a problem here: `doit image` and
    container builds refuse to start without one, everything else works without it."""
    image = builder = None
    if isinstance(raw_image, dict) and p.check_table("image", raw_image, IMAGE_FIELDS):
        image = ImageSpec(
            base=raw_image["base"],
            digest=raw_image.get("digest", ""),
            name=raw_image.get("name", "reprostack"),
            python=raw_image.get("python", "python3"),
            prefix=raw_image.get("prefix", "/opt/reprostack"),
            docker_dir=lock_dir / raw_image.get("docker_dir", "docker"),
            env=dict(raw_image.get("env", {})),
            volumes=tuple(raw_image.get("volumes", [])),
        )
    if isinstance(raw_image, dict):
        prefix, volumes = raw_image.get("prefix", "/opt/reprostack"), raw_image.get("volumes", [])
        if _is_abs_path(prefix) is None and _is_volume_list(volumes) is None:
            for volume in volumes:  # a mount there would hide the venv, or part of it
                if PurePosixPath(volume).is_relative_to(prefix) or PurePosixPath(prefix).is_relative_to(volume):
                    p.add("image", f"volume {volume!r} overlaps the venv at prefix {prefix!r}: mount it elsewhere")
    if isinstance(raw_builder, dict) and p.check_table("builder", raw_builder, BUILDER_FIELDS):
        builder = BuilderSpec(
            image=raw_builder["image"],
            digest=raw_builder.get("digest", ""),
            python=raw_builder.get("python", "python3"),
        )
    return image, builder


def _parse_toolchain(p: _Problems, raw: Any) -> Toolchain:
    if not isinstance(raw, dict) or not p.check_table("toolchain", raw, TOOLCHAIN_FIELDS):
        return Toolchain()
    return Toolchain(
        python=raw.get("python", ""),
        torch=raw.get("torch", ""),
        torch_cuda=raw.get("torch_cuda", ""),
        cuda=raw.get("cuda", ""),
        archs=tuple(raw.get("archs", ())),
        hermetic=_parse_hermetic(p, raw.get("hermetic")),
        hermetic_wheels=tuple(raw.get("hermetic", {}).get("wheels", []))
        if isinstance(raw.get("hermetic"), dict)
        else (),
    )


def _check_archs(p: _Problems, raw: Any, packages: Mapping[str, Package]) -> None:
    """``[toolchain] archs`` is required only where a package compiles CUDA (``cuda = true``) or puts the archs in
    its ``env`` (an arch placeholder): a lock of pure-Python or C++ packages names no GPU."""
    if isinstance(raw, dict) and "archs" in raw:
        return
    needing = [
        name
        for name, pkg in packages.items()
        if pkg.cuda or any(f"{{{ph}}}" in v for _, v in pkg.env for ph in ARCH_PLACEHOLDERS)
    ]
    if needing:
        p.add(
            "toolchain",
            f"archs is required: {', '.join(sorted(needing))} compile CUDA (cuda = true) or use an arch placeholder "
            "in env; list the target GPUs, e.g. archs = ['sm_90a']",
        )


def _parse_hermetic(p: _Problems, raw: Any) -> tuple[WheelPin, ...]:
    """``[toolchain.hermetic] requirements``: each an exact ``==`` pin with at least one sha256.

    A pin without ``--hash`` is an unpinned entry, which `doit lock` fills in
    (tasks/env/hermetic.py); any other problem of a line is an error.
    """
    where = "toolchain.hermetic"
    if raw is None or not p.check_table(where, raw, HERMETIC_FIELDS):
        return ()
    if not raw.get("requirements") and not raw.get("wheels"):
        p.add(where, "requirements is empty; list the pinned wheels, or remove [toolchain.hermetic]")
    return _parse_pins(p, where, raw.get("requirements", []), hashed=False)


def _parse_pins(p: _Problems, where: str, lines: list[str], *, hashed: bool) -> tuple[WheelPin, ...]:
    """``name==version --hash=sha256:<hex> ...`` lines. ``hashed``: a line without hashes is an error
    (`doit lock` writes them all); otherwise it is an unpinned entry `doit lock` fills in."""
    pins: dict[str, WheelPin] = {}
    for line in lines:
        spec, *options = line.split(" --")
        options = [f"--{o.strip()}" for o in options]
        try:
            req = Requirement(spec)
        except InvalidRequirement as exc:
            p.add(where, f"requirement {line!r} is not valid: {exc}")
            continue
        specs = list(req.specifier)
        problems = []
        if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
            problems.append(f"needs one exact version, '{req.name}==<version>' (only == pins are hashed and installed)")
        if req.url or req.extras or req.marker:
            problems.append("takes no URL, extras or environment markers")
        hashes = []
        for opt in options:
            m = HASH_OPTION_RE.match(opt)
            if m is None:
                name = opt.split("=")[0].split()[0]
                problems.append(f"has unknown option {name!r}{_suggest(name, ['--hash'])}")
            elif not (m.group(1).startswith("sha256:") and SHA256_RE.match(m.group(1)[len("sha256:") :])):
                problems.append(f"hash {m.group(1)!r} must be 'sha256:' and 64 lowercase hex digits")
            else:
                hashes.append(m.group(1)[len("sha256:") :])
        key = canonicalize_name(req.name)
        if key in pins:
            problems.append(f"pins {req.name} a second time")
        if hashed and not options:
            problems.append("has no --hash=sha256:... (`doit lock` writes every resolved pin with its hashes)")
        if problems:
            if not options and not hashed:
                problems.append("has no --hash=sha256:... (`doit lock` fills them in for an exact pin)")
            p.add(where, f"requirement {line!r} " + "; ".join(problems))
            continue
        if not options:
            p.unpinned(
                where,
                f"requirement {line!r} has no --hash=sha256:... (run `doit lock` to fill in the sha256 of its wheels)",
            )
        pins[key] = WheelPin(name=key, version=specs[0].version, hashes=tuple(sorted(set(hashes))))
    return tuple(sorted(pins.values(), key=lambda w: w.name))


def _parse_sources(p: _Problems, raw: Any) -> dict[str, Source]:
    """``[sources.NAME]``, each checked by its kind (tasks/lock/kinds.py)."""
    out: dict[str, Source] = {}
    if not isinstance(raw, dict):
        return out
    known = kinds.registry()
    for name, entry in raw.items():
        where = f"sources.{name}"
        if not NAME_RE.match(name):
            p.add(where, "source names use letters, digits, '.', '_' and '-'")
        if not isinstance(entry, dict):
            p.add(where, "must be a table")
            continue
        kind = kinds.find(entry.get("kind"))
        if kind is None:
            given = entry.get("kind")
            hint = _suggest(given, known) if isinstance(given, str) else ""
            p.add(where, f"kind must be one of {', '.join(known)}, got {given!r}{hint}")
            continue
        if not p.check_table(where, entry, kind.fields):
            continue
        derived = kind.check(where, entry, p)
        if "tree_sha256" not in entry and not kind.wheel:
            p.unpinned(where, "missing 'tree_sha256' (run `doit lock` to compute it)")
        values: dict[str, Any] = {
            "url": entry.get("url", ""),
            "ref": entry.get("ref", ""),
            "commit": entry.get("commit", ""),
            "project": entry.get("project", ""),
            "version": entry.get("version", ""),
            "filename": entry.get("filename", ""),
            "sha256": entry.get("sha256", ""),
            "tree_sha256": entry.get("tree_sha256", ""),
            "strip": entry.get("strip"),
            "include": tuple(entry.get("include", ())),
            "exclude": tuple(entry.get("exclude", ())),
            "license": entry.get("license", ""),
        }
        out[name] = Source(name=name, kind=kind.name, **(values | derived))
    return out


def _check_package_values(
    p: _Problems,
    where: str,
    name: str,
    entry: Mapping[str, Any],
    sources: Mapping[str, Any],
    patches_dir: Path | None,
) -> None:
    """Cross-checks of one package entry (or profile override) against the lock."""
    if "source" in entry and entry["source"] not in sources:
        p.add(
            where,
            f"source {entry['source']!r} is not defined under [sources]{_suggest(entry['source'], sources)}",
        )
    for dest, src in entry.get("overlays", {}).items():
        if src not in sources:
            p.add(
                where,
                f"overlay {dest!r} names unknown source {src!r}{_suggest(src, sources)}",
            )
        if dest.startswith("/") or ".." in Path(dest).parts:
            p.add(where, f"overlay path {dest!r} must be relative and inside the tree")
    for key, value in entry.get("env", {}).items():
        if not ENV_NAME_RE.match(key):
            p.add(where, f"env name {key!r} is not a valid environment variable name")
        for ph in PLACEHOLDER_RE.findall(value):
            if ph not in ENV_PLACEHOLDERS:
                p.add(
                    where,
                    f"env {key} uses unknown placeholder {{{ph}}}{_suggest(ph, ENV_PLACEHOLDERS)}",
                )
    for req in entry.get("build_requires", ()):
        try:
            Requirement(req)
        except InvalidRequirement as exc:
            p.add(where, f"build_requires entry {req!r} is not a valid requirement: {exc}")
    for extra in entry.get("toolchain_extras", ()):
        if extra not in TOOLCHAIN_EXTRAS:
            p.add(
                where,
                f"toolchain_extras entry {extra!r} is unknown{_suggest(extra, TOOLCHAIN_EXTRAS)}",
            )
    for patch in entry.get("patches", ()):
        if not isinstance(patch, str):
            continue
        if leaves_folder(patch):
            p.add(where, f"patch {patch!r} must be a path inside patches/{name}/ (relative, without '..'), as a "
                  "{ source, path } patch's must be inside its source")  # fmt: skip
        elif patches_dir is not None:
            _check_patch_file(p, where, patches_dir / name, patch)
    verify = entry.get("verify")
    if isinstance(verify, dict):
        p.check_table(f"{where}.verify", verify, VERIFY_FIELDS)
    reason = entry.get("torch_unpinned")
    if isinstance(reason, str) and len(reason.strip()) < 10:
        p.add(
            where,
            "torch_unpinned must say why the wheel may go beside another torch than the one it was built against "
            f"(a sentence, such as 'loads libtorch through its own stable C ABI'), got {reason!r}",
        )
    subdir = entry.get("subdir", "")
    if subdir.startswith("/") or ".." in Path(subdir).parts:
        p.add(where, f"subdir {subdir!r} must be relative and inside the tree")


def leaves_folder(rel: str) -> bool:
    """Whether ``rel``, a path the lock names inside a folder, may lead out of it as written: empty or the
    folder itself, absolute, or with a '..' component (a link in the folder is checked on the file system)."""
    parts = PurePosixPath(rel).parts
    return not parts or rel.startswith("/") or ".." in parts or "\0" in rel


def _check_patch_file(p: _Problems, where: str, folder: Path, patch: str) -> None:
    """A patch of ours is a file in its package's folder, also once symbolic links are followed."""
    path = folder / patch
    if not path.is_file():
        p.add(where, f"patch {patch!r} not found at {path}")
        return
    real, inside = path.resolve(), folder.parent.resolve() / folder.name
    if not real.is_relative_to(inside):
        p.add(where, f"patch {patch!r} at {path} is a symbolic link out of {folder}, to {real}; a patch lies in "
              "its package's folder (copy it there)")  # fmt: skip


#: What a prebuilt package (its source a wheel file) may set: nothing about a build.
PREBUILT_FIELDS = ("source", "enabled", "optional", "distribution", "deps", "verify")


def _package_from(name: str, entry: Mapping[str, Any], prebuilt: bool = False) -> Package:
    verify = entry.get("verify", {})
    return Package(
        name=name,
        source=entry["source"],
        overlays=tuple(sorted(entry.get("overlays", {}).items())),
        subdir=entry.get("subdir", ""),
        patches=tuple(_patch_entry(x) for x in entry.get("patches", ())),
        env=tuple(sorted(entry.get("env", {}).items())),
        build_requires=tuple(entry.get("build_requires", ())),
        pip_args=tuple(entry.get("pip_args", ())),
        jobs_env=tuple(entry.get("jobs_env", ("MAX_JOBS",))),
        mem_per_job_gb=float(entry.get("mem_per_job_gb", 2.0)),
        cuda=bool(entry.get("cuda", False)),
        toolchain_extras=tuple(entry.get("toolchain_extras", ())),
        enabled=bool(entry.get("enabled", True)),
        optional=bool(entry.get("optional", False)),
        distribution=entry.get("distribution", ""),
        prebuilt=prebuilt,
        deps=bool(entry.get("deps", True)),
        verify=Verify(imports=tuple(verify.get("imports", ())), smoke=verify.get("smoke", "")),
        torch_unpinned=entry.get("torch_unpinned", "").strip(),
    )


def _parse_packages(p: _Problems, raw: Any, sources: Mapping[str, Any], patches_dir: Path | None) -> dict[str, Package]:
    out: dict[str, Package] = {}
    if not isinstance(raw, dict):
        return out
    for name, entry in raw.items():
        where = f"packages.{name}"
        if not NAME_RE.match(name):
            p.add(where, "package names use letters, digits, '.', '_' and '-'")
        if not isinstance(entry, dict):
            p.add(where, "must be a table")
            continue
        if not p.check_table(where, entry, PACKAGE_FIELDS):
            continue
        _check_package_values(p, where, name, entry, sources, patches_dir)
        raw_source = sources.get(entry["source"])
        kind = kinds.find(raw_source.get("kind")) if isinstance(raw_source, dict) else None
        prebuilt = kind is not None and kind.wheel
        if prebuilt:
            extra = [k for k in entry if k not in PREBUILT_FIELDS]
            if extra:
                p.add(where, f"source {entry['source']!r} is a wheel, placed as is: {', '.join(extra)} "
                      f"do(es) not apply (a prebuilt package takes {', '.join(PREBUILT_FIELDS)})")  # fmt: skip
        out[name] = _package_from(name, entry, prebuilt)
        if out[name].torch_unpinned and not out[name].needs_torch:
            p.add(where, "torch_unpinned applies only to a package whose build_requires name torch (its wheel "
                  "is compiled against one); remove it")  # fmt: skip
    builds: dict[str, str] = {}
    for name, pkg in out.items():
        first = builds.setdefault(pkg.distribution_name, name)
        if first != name:
            p.add(
                f"packages.{name}",
                f"builds the distribution {pkg.distribution_name!r}, as packages.{first} does; a wheelhouse holds "
                "one wheel per distribution: remove one of them, or set `distribution` to the wheel's project name",
            )
    return out


def _parse_profiles(
    p: _Problems,
    raw: Any,
    packages: Mapping[str, Any],
    sources: Mapping[str, Any],
    patches_dir: Path | None,
) -> dict[str, Profile]:
    out: dict[str, Profile] = {}
    if not isinstance(raw, dict):
        return out
    for name, entry in raw.items():
        where = f"profiles.{name}"
        if name == "default":
            p.add(
                where,
                "'default' is the lock without overrides; choose another profile name",
            )
        if not isinstance(entry, dict) or not p.check_table(where, entry, PROFILE_FIELDS):
            continue
        for pkg_name, over in entry.get("packages", {}).items():
            pw = f"{where}.packages.{pkg_name}"
            if pkg_name not in packages:
                p.add(
                    pw,
                    f"overrides unknown package {pkg_name!r}{_suggest(pkg_name, packages)}",
                )
                continue
            if not isinstance(over, dict) or not p.check_table(pw, over, PROFILE_PACKAGE_FIELDS):
                continue
            _check_package_values(p, pw, pkg_name, over, sources, patches_dir)
        out[name] = Profile(
            name=name,
            description=entry.get("description", ""),
            packages=dict(entry.get("packages", {})),
            runtime=_parse_runtime(p, entry.get("runtime"), f"{where}.runtime"),
        )
    return out


# --------------------------------------------------------------------------- arch helpers


def arch_env(archs: tuple[str, ...]) -> dict[str, str]:
    """Spellings of the target architectures that upstream build scripts expect."""
    torch_list, cmake, gencode = [], [], []
    for arch in archs:
        m = ARCH_RE.match(arch)
        assert m, arch
        digits, suffix = m.group(1), m.group(2)
        torch_list.append(f"{digits[:-1]}.{digits[-1]}{suffix}")
        cmake.append(f"{digits}{suffix}")
        gencode.append(f"-gencode=arch=compute_{digits}{suffix},code=sm_{digits}{suffix}")
    return {
        "archs": " ".join(archs),
        "archs_semicolon": ";".join(archs),
        "torch_arch_list": ";".join(torch_list),
        "cmake_archs": ";".join(cmake),
        "cuda_gencode": " ".join(gencode),
    }


def expand_env(env: Mapping[str, str], values: Mapping[str, str]) -> dict[str, str]:
    """Fill ``{placeholder}`` fields of a package's env from ``values``."""
    return {k: PLACEHOLDER_RE.sub(lambda m: values.get(m.group(1), m.group(0)), v) for k, v in env.items()}
