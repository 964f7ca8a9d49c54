"""User settings: doit command-line variables (``name=value``) over environment variables over defaults.

=========  ==================  ===============================================
variable   environment         meaning
=========  ==================  ===============================================
lock       REPRO_LOCK          lock file (default ``sources.lock``)
profile    REPRO_PROFILE       profile of the lock (default ``default``)
mirror     REPRO_MIRROR        read-only source mirror consulted before the network
cache      REPRO_CACHE         cache directory (default ``$XDG_CACHE_HOME/reprostack``)
jobs       REPRO_JOBS          compiler job budget (default: from cores and memory)
wheels     REPRO_WHEELS        wheelhouse directory (default ``wheels``)
builddir   REPRO_BUILD_DIR     logs and staging trees (default ``build``)
gpu        REPRO_GPU           ``auto`` or ``off``: GPU smoke tests in ``doit verify``
update     REPRO_UPDATE        ``doit lock``: sources whose refs are re-resolved (``all`` or names)
base       REPRO_BASE          ``doit image``: a local base image by ID, instead of the lock's digest
builder    REPRO_BUILDER       where wheels build: ``host``, ``lock`` ([builder]) or a local image ID
export     REPRO_EXPORT        ``doit export``: output directory (default ``<builddir>/export``)
=========  ==================  ===============================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import ReproError
from tasks.imageref import is_image_id

VARIABLES = {
    "lock": ("REPRO_LOCK", "sources.lock"),
    "profile": ("REPRO_PROFILE", "default"),
    "mirror": ("REPRO_MIRROR", ""),
    "cache": ("REPRO_CACHE", ""),
    "jobs": ("REPRO_JOBS", ""),
    "wheels": ("REPRO_WHEELS", "wheels"),
    "builddir": ("REPRO_BUILD_DIR", "build"),
    "gpu": ("REPRO_GPU", "auto"),
    "update": ("REPRO_UPDATE", ""),
    "base": ("REPRO_BASE", ""),
    "builder": ("REPRO_BUILDER", ""),
    "export": ("REPRO_EXPORT", ""),
}


def _default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "reprostack"


@dataclass(frozen=True, kw_only=True)
class Settings:
    lock: Path
    profile: str
    mirror: Path | None
    cache: Path
    jobs: int | None
    wheels: Path
    builddir: Path
    gpu: str
    update: tuple[str, ...]
    base: str = ""
    builder: str = ""
    export: Path | None = None

    @property
    def logs(self) -> Path:
        return self.builddir / "logs"

    @property
    def export_dir(self) -> Path:
        return self.export if self.export is not None else self.builddir / "export"


def _get(name: str, doit_vars: dict[str, str]) -> str:
    env_name, default = VARIABLES[name]
    if name in doit_vars:
        return doit_vars[name]
    return os.environ.get(env_name, default)


def load_settings(doit_vars: dict[str, str] | None = None) -> Settings:
    """Settings from doit's ``name=value`` variables and the environment."""
    if doit_vars is None:
        doit_vars = _doit_vars()
    unknown = sorted(set(doit_vars) - set(VARIABLES))
    if unknown:
        raise ReproError(f"unknown variable(s) {', '.join(unknown)}; known: {', '.join(VARIABLES)}")
    jobs_raw = _get("jobs", doit_vars)
    jobs: int | None = None
    if jobs_raw:
        if not jobs_raw.isdigit() or int(jobs_raw) < 1:
            raise ReproError(f"jobs={jobs_raw!r}: give a positive whole number of compiler jobs")
        jobs = int(jobs_raw)
    gpu = _get("gpu", doit_vars)
    if gpu not in ("auto", "off"):
        raise ReproError(f"gpu={gpu!r}: use 'auto' or 'off'")
    mirror = _get("mirror", doit_vars)
    cache = _get("cache", doit_vars)
    update = tuple(u for u in _get("update", doit_vars).replace(",", " ").split() if u)
    base = _get("base", doit_vars).strip()
    if base and not is_image_id(base):
        raise ReproError(
            f"base={base!r}: give a local image by ID (sha256:<64 hex> or at least 12 hex digits), "
            "as `docker image inspect --format '{{.Id}}' IMAGE` prints it; tags move, IDs do not"
        )
    builder = _get("builder", doit_vars).strip()
    if builder not in ("", "host", "lock") and not is_image_id(builder):
        raise ReproError(
            f"builder={builder!r}: use 'host', 'lock' (the lock's [builder] image) or a local image ID "
            "(`docker image inspect --format '{{.Id}}' IMAGE`)"
        )
    export = _get("export", doit_vars)
    return Settings(
        lock=Path(_get("lock", doit_vars)),
        profile=_get("profile", doit_vars) or "default",
        mirror=Path(mirror).absolute() if mirror else None,
        cache=Path(cache).absolute() if cache else _default_cache(),
        jobs=jobs,
        wheels=Path(_get("wheels", doit_vars)),
        builddir=Path(_get("builddir", doit_vars)),
        gpu=gpu,
        update=update,
        base=base,
        builder=builder,
        export=Path(export) if export else None,
    )


def _doit_vars() -> dict[str, str]:
    # doit keeps the command line's ``name=value`` pairs here; get_var() only
    # reads one name at a time, and unknown names must be reported.
    from doit import doit_cmd

    return dict(doit_cmd._CMDLINE_VARS or {})
