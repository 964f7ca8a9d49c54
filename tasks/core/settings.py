"""User settings: doit command-line variables (``name=value``) over environment variables over the
workspace's ``reprostack.toml`` over defaults.

=========  ==================  ===============================================
variable   environment         meaning
=========  ==================  ===============================================
lock       REPRO_LOCK          lock file (default ``sources.lock``)
profile    REPRO_PROFILE       profile of the lock (default ``default``)
mirror     REPRO_MIRROR        read-only source mirror consulted before the network
cache      REPRO_CACHE         cache directory (default ``$XDG_CACHE_HOME/reprostack``)
jobs       REPRO_JOBS          compiler job budget for the whole run (default: cores, lowered for memory; at most 65536)
mem        REPRO_MEM_GB        memory budget in GB for compiler jobs (default: MemAvailable)
memory     REPRO_MEMORY        how jobs are admitted against it: ``unit`` (default: each compile by its own
                               recorded or estimated peak) or ``job`` (a fixed ``mem_per_job_gb`` per job)
objcache   REPRO_OBJCACHE      compile-object cache (ccache): ``on`` (default) or ``off``
objcache_size REPRO_OBJCACHE_SIZE  its size limit (default ``20G``)
wheels     REPRO_WHEELS        wheelhouse directory (default ``wheels``)
builddir   REPRO_BUILD_DIR     logs and staging trees (default ``build``)
gpu        REPRO_GPU           ``auto`` or ``off``: GPU smoke tests in ``doit verify``
isolated   REPRO_ISOLATED      ``on``: ``doit verify`` in a venv seeing only the base interpreter and the provided set
train      REPRO_TRAIN         ``on``: ``doit verify`` and ``doit verify_image`` also train a tiny FP8 MoE GPT on every
                               GPU (megatron_core, TE, FlashAttention 3, grouped_gemm, apex; tasks/verify/train.py)
update     REPRO_UPDATE        ``doit lock``: sources whose refs are re-resolved (``all`` or names)
pkgs       REPRO_PKGS          ``doit repro``: packages to rebuild and compare; ``doit hints``: packages whose hints
                               are written (default: all)
base       REPRO_BASE          ``doit image``: a local base image by ID, instead of the lock's digest
builder    REPRO_BUILDER       where wheels build: ``host``, ``lock`` ([builder]) or a local image ID
export     REPRO_EXPORT        ``doit export``: output directory (default ``<builddir>/export``)
bundle     REPRO_BUNDLE        ``doit bundle``: file to write; ``doit unbundle``: file to read
bundle_image REPRO_BUNDLE_IMAGE  ``doit bundle``: include the exported image (``on``/``off``, default off)
bundle_mirror REPRO_BUNDLE_MIRROR ``doit bundle``: include the source mirror (``on``/``off``, default off)
dest       REPRO_DEST          ``doit unbundle``: directory to create (default ``unbundled``)
remote     REPRO_REMOTE        remote wheel cache: an http(s) URL of a Bazel HTTP remote cache, or
                               ``s3://bucket[/prefix]`` (tasks/store/remote.py)
remote_write REPRO_REMOTE_WRITE  ``on``: upload wheels built in this run to the remote; ``off`` (default): read only
remote_timeout REPRO_REMOTE_TIMEOUT  seconds to connect and to read, per remote request (default 10); 3 tries each
shard      REPRO_SHARD         ``i/N``: ``doit wheels`` builds only shard i of N of the packages, assembles nothing
cluster    REPRO_CLUSTER       a Ray cluster that runs the compiles (docs/cluster.md): ``ray://HOST:PORT``,
                               ``HOST:PORT`` (the head's GCS port) or ``auto``; default ``RAY_ADDRESS``;
                               ``off``: none, whatever ``RAY_ADDRESS`` says
format     REPRO_FORMAT        ``doit plan``: ``text`` (default) or ``json`` (schema in docs/tasks.md)
tool_python REPRO_TOOL_PYTHON  ``doit mirror``, ``doit bundle``: the CPythons the tool's ``tool/`` wheels install
                               on besides this one (``3.12,3.13``; default: the lock's ``[runtime] python``)
=========  ==================  ===============================================

The workspace file ``reprostack.toml`` (in the directory doit runs in) holds defaults for this
workspace, the variables as keys (``lock = "examples/example.lock"``); the quickstart writes one so
that a newcomer who forgets ``lock=`` keeps building the example, not the real stack.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tasks.core.errors import ReproError
from tasks.core.imageref import is_image_id

VARIABLES = {
    "lock": ("REPRO_LOCK", "sources.lock"),
    "profile": ("REPRO_PROFILE", "default"),
    "mirror": ("REPRO_MIRROR", ""),
    "cache": ("REPRO_CACHE", ""),
    "jobs": ("REPRO_JOBS", ""),
    "mem": ("REPRO_MEM_GB", ""),
    "memory": ("REPRO_MEMORY", "unit"),
    "objcache": ("REPRO_OBJCACHE", "on"),
    "objcache_size": ("REPRO_OBJCACHE_SIZE", "20G"),
    "wheels": ("REPRO_WHEELS", "wheels"),
    "builddir": ("REPRO_BUILD_DIR", "build"),
    "gpu": ("REPRO_GPU", "auto"),
    "isolated": ("REPRO_ISOLATED", "off"),
    "train": ("REPRO_TRAIN", "off"),
    "update": ("REPRO_UPDATE", ""),
    "pkgs": ("REPRO_PKGS", ""),
    "base": ("REPRO_BASE", ""),
    "builder": ("REPRO_BUILDER", ""),
    "export": ("REPRO_EXPORT", ""),
    "bundle": ("REPRO_BUNDLE", ""),
    "bundle_image": ("REPRO_BUNDLE_IMAGE", "off"),
    "bundle_mirror": ("REPRO_BUNDLE_MIRROR", "off"),
    "dest": ("REPRO_DEST", "unbundled"),
    "remote": ("REPRO_REMOTE", ""),
    "remote_write": ("REPRO_REMOTE_WRITE", "off"),
    "remote_timeout": ("REPRO_REMOTE_TIMEOUT", "10"),
    "shard": ("REPRO_SHARD", ""),
    "cluster": ("REPRO_CLUSTER", ""),
    "format": ("REPRO_FORMAT", "text"),
    "tool_python": ("REPRO_TOOL_PYTHON", ""),
}


#: The most compiler jobs a run takes (``jobs=``; a Ray cluster's CPUs are capped at it too): the job server's
#: fifo holds one byte per token, and a pipe holds 64 KiB (tasks/engine/jobserver.py).
MAX_JOBS = 65536


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
    mem_gb: float | None
    objcache: bool
    objcache_size: str
    wheels: Path
    builddir: Path
    gpu: str
    update: tuple[str, ...]
    isolated: bool = False
    #: ``doit verify`` / ``verify_image``: the training check too (tasks/verify/train.py).
    train: bool = False
    pkgs: tuple[str, ...] = ()
    base: str = ""
    builder: str = ""
    export: Path | None = None
    bundle: Path | None = None
    bundle_image: bool = False
    bundle_mirror: bool = False
    dest: Path = Path("unbundled")
    remote: str = ""
    remote_write: bool = False
    remote_timeout: float = 10.0
    shard: tuple[int, int] | None = None
    #: The Ray cluster's address (``cluster=``, else ``RAY_ADDRESS``); "": none (tasks/engine/cluster.py).
    cluster: str = ""
    #: ``unit``: the gate admits each compile by its own memory; ``job``: a fixed mem_per_job_gb per job.
    memory: str = "unit"
    #: ``doit plan``'s output: ``text`` or ``json``.
    format: str = "text"
    #: ``tool_python=``: CPython versions (``3.12``) the tool's wheels are written for besides this one; () the default.
    tool_python: tuple[str, ...] = ()
    #: The variables the workspace's reprostack.toml supplied (see workspace_defaults).
    from_workspace: tuple[str, ...] = ()

    @property
    def logs(self) -> Path:
        return self.builddir / "logs"

    @property
    def export_dir(self) -> Path:
        return self.export if self.export is not None else self.builddir / "export"


#: The workspace's own defaults (see the module's docstring), in the directory doit runs in.
WORKSPACE_FILE = "reprostack.toml"


def workspace_defaults(directory: Path | None = None) -> dict[str, str]:
    """The variables ``reprostack.toml`` sets (none when there is no such file)."""
    path = (directory or Path.cwd()) / WORKSPACE_FILE
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ReproError(f"{path}: cannot read the workspace settings ({exc}); fix or delete it") from None
    except RecursionError:  # tomllib recurses per nesting level: a hostile file is one error, not a traceback
        raise ReproError(f"{path}: cannot read the workspace settings (a value is nested too deeply)") from None
    problems = [f"unknown variable {k!r}" for k in doc if k not in VARIABLES]
    problems += [
        f'{k} must be a string (write {k} = "...")' for k, v in doc.items() if k in VARIABLES and not isinstance(v, str)
    ]
    if problems:
        raise ReproError(f"{path}: {'; '.join(problems)}; the known variables: {', '.join(VARIABLES)}")
    return {k: str(v) for k, v in doc.items()}


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
    # The workspace file fills in what neither the command line nor the environment sets.
    from_workspace = {
        name: value
        for name, value in workspace_defaults().items()
        if name not in doit_vars and VARIABLES[name][0] not in os.environ
    }
    doit_vars = {**doit_vars, **from_workspace}
    jobs_raw = _get("jobs", doit_vars)
    jobs: int | None = None
    if jobs_raw:
        jobs = whole_number(jobs_raw)
        if jobs is None or jobs < 1:
            raise ReproError(f"jobs={jobs_raw!r}: give a positive whole number of compiler jobs")
        if jobs > MAX_JOBS:
            raise ReproError(f"jobs={jobs_raw!r}: at most {MAX_JOBS} compiler jobs (one job token each)")
    mem_gb = _positive("mem", doit_vars, "give the memory budget in GB as a positive number, e.g. mem=96")
    memory = _get("memory", doit_vars)
    if memory not in ("unit", "job"):
        raise ReproError(
            f"memory={memory!r}: use 'unit' (each compile admitted by its own recorded or estimated peak) "
            "or 'job' (a fixed mem_per_job_gb per job)"
        )
    objcache = _switch("objcache", doit_vars)
    objcache_size = _get("objcache_size", doit_vars)
    if not valid_size(objcache_size):
        raise ReproError(f"objcache_size={objcache_size!r}: give a size such as 20G or 500M")
    gpu = _get("gpu", doit_vars)
    if gpu not in ("auto", "off"):
        raise ReproError(f"gpu={gpu!r}: use 'auto' or 'off'")
    mirror = _get("mirror", doit_vars)
    cache = _get("cache", doit_vars)
    update = tuple(u for u in _get("update", doit_vars).replace(",", " ").split() if u)
    pkgs = tuple(p for p in _get("pkgs", doit_vars).replace(",", " ").split() if p)
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
    bundle = _get("bundle", doit_vars)
    remote, remote_write, remote_timeout = _remote(doit_vars)
    output = _get("format", doit_vars)
    if output not in ("text", "json"):
        raise ReproError(f"format={output!r}: use 'text' or 'json' (doit plan)")
    return Settings(
        lock=Path(_get("lock", doit_vars)),
        profile=_get("profile", doit_vars) or "default",
        mirror=Path(mirror).absolute() if mirror else None,
        cache=Path(cache).absolute() if cache else _default_cache(),
        jobs=jobs,
        mem_gb=mem_gb,
        objcache=objcache,
        objcache_size=objcache_size,
        wheels=Path(_get("wheels", doit_vars)),
        builddir=Path(_get("builddir", doit_vars)),
        gpu=gpu,
        update=update,
        isolated=_switch("isolated", doit_vars, "use 'on' (a venv without the system's packages) or 'off'"),
        train=_switch("train", doit_vars, "use 'on' (train a tiny FP8 MoE GPT on every GPU) or 'off'"),
        pkgs=pkgs,
        base=base,
        builder=builder,
        export=Path(export) if export else None,
        bundle=Path(bundle) if bundle else None,
        dest=Path(_get("dest", doit_vars) or "unbundled"),
        bundle_image=_switch("bundle_image", doit_vars),
        bundle_mirror=_switch("bundle_mirror", doit_vars),
        remote=remote,
        remote_write=remote_write,
        remote_timeout=remote_timeout,
        shard=parse_shard(_get("shard", doit_vars)),
        cluster=cluster_address(_get("cluster", doit_vars).strip()),
        memory=memory,
        format=output,
        tool_python=parse_pythons(_get("tool_python", doit_vars)),
        from_workspace=tuple(sorted(from_workspace)),
    )


def cluster_address(value: str, environ: Mapping[str, str] | None = None) -> str:
    """The Ray cluster a run sends its compiles to: ``value`` (``cluster=``; ``off``: none), else
    ``RAY_ADDRESS`` (what Ray's own tools read) where it is a cluster's address, else none ("").

    A ``RAY_ADDRESS`` that is not one (``http://HOST:8265``, the dashboard that ``ray job submit``
    reads it as) is left alone; a ``cluster=`` that is not one is an error."""
    environ = os.environ if environ is None else environ
    given = bool(value)
    if not given:
        value = environ.get("RAY_ADDRESS", "").strip()
    if value in ("", "off"):
        return ""
    m = re.fullmatch(r"(ray://)?([A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:]+\]):(\d{1,5})", value)
    if value != "auto" and (m is None or not 0 < int(m.group(3)) < 65536):
        if not given:
            return ""
        raise ReproError(
            f"cluster={value!r}: give a Ray address: ray://HOST:PORT (Ray Client), HOST:PORT (the head's GCS "
            "port) or auto; cluster=off builds here whatever RAY_ADDRESS says"
        )
    return value


def _remote(doit_vars: dict[str, str]) -> tuple[str, bool, float]:
    raw_remote = _get("remote", doit_vars).strip()
    problem = None
    if raw_remote:
        problem = check_url(raw_remote)
    if problem is not None:
        raise ReproError(f"remote={raw_remote!r}: {problem}")
    remote = raw_remote.rstrip("/")
    write = _switch("remote_write", doit_vars, "use 'on' (upload built wheels) or 'off' (read only)")
    if write and not remote:
        raise ReproError("remote_write=on needs remote=URL (or REPRO_REMOTE)")
    timeout = _positive("remote_timeout", doit_vars, "give seconds per request as a positive number, e.g. 10")
    if timeout is None:
        raise ReproError("remote_timeout='': give seconds per request as a positive number, e.g. 10")
    return remote, write, timeout


def _switch(name: str, doit_vars: dict[str, str], use: str = "use 'on' or 'off'") -> bool:
    """An on/off variable."""
    value = _get(name, doit_vars)
    if value not in ("on", "off"):
        raise ReproError(f"{name}={value!r}: {use}")
    return value == "on"


def _positive(name: str, doit_vars: dict[str, str], give: str) -> float | None:
    """A positive number, or None where the variable is empty."""
    raw = _get(name, doit_vars)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:  # NaN and infinity too ("inf", "1e999")
        raise ReproError(f"{name}={raw!r}: {give}")
    return value


def whole_number(raw: str) -> int | None:
    """``raw`` as a whole number written in ASCII digits (at most 18 of them), else None.

    ``str.isdigit`` is true of superscripts (``"²"``), which ``int`` refuses, and ``int`` accepts other
    scripts' digits and refuses more than 4300 of them: neither may pass a check and then fail.
    """
    return int(raw) if re.fullmatch(r"[0-9]{1,18}", raw) else None


def parse_pythons(raw: str) -> tuple[str, ...]:
    """``3.12,3.13`` (commas or spaces) as ``("3.12", "3.13")``: CPython versions, major.minor."""
    pythons = []
    for word in raw.replace(",", " ").split():
        m = re.fullmatch(r"3\.(\d{1,2})", word)
        if m is None:
            raise ReproError(
                f"tool_python={raw!r}: give CPython versions as 3.N, comma-separated, e.g. tool_python=3.12,3.13"
            )
        pythons.append(f"3.{int(m.group(1))}")
    return tuple(dict.fromkeys(pythons))


def parse_shard(raw: str) -> tuple[int, int] | None:
    """``i/N`` (1 <= i <= N) as ``(i, N)``; empty: no sharding."""
    raw = raw.strip()
    if not raw:
        return None
    i, sep, n = raw.partition("/")
    first, count = whole_number(i), whole_number(n)
    if sep and first is not None and count is not None and 1 <= first <= count:
        return first, count
    raise ReproError(f"shard={raw!r}: give i/N with 1 <= i <= N, e.g. shard=2/4 (the second of four shards)")


def _doit_vars() -> dict[str, str]:
    # doit keeps the command line's ``name=value`` pairs here; get_var() only
    # reads one name at a time, and unknown names must be reported.
    from doit import doit_cmd

    return dict(doit_cmd._CMDLINE_VARS or {})


# --------------------------------------------------------------------------- values checked here, used below


def valid_size(text: str) -> bool:
    """A ccache size: a number with an optional k/M/G/T (or Ki/Mi/Gi/Ti) suffix."""
    body = text.rstrip("iB").rstrip("kKMGT") if text else ""
    try:
        return float(body) >= 0
    except ValueError:
        return False


#: S3 bucket names: 3 to 63 lower-case letters, digits, dots and hyphens, a letter or digit at each end.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or a key prefix without leading or trailing "/"

    def key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_s3_url(url: str) -> S3Location | str:
    """``s3://bucket[/prefix]`` as a location, or what is wrong with it."""
    if not url.startswith("s3://"):
        return "not an s3:// URL"
    rest = url[len("s3://") :].rstrip("/")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        return "no bucket: give s3://bucket or s3://bucket/prefix"
    if not _BUCKET.match(bucket) or ".." in bucket:
        return (
            f"{bucket!r} is not an S3 bucket name (3 to 63 lower-case letters, digits, dots and hyphens, "
            "beginning and ending with a letter or digit)"
        )
    if any(c in rest for c in "?#") or any(part in ("", ".", "..") for part in prefix.split("/") if prefix):
        return f"prefix {prefix!r}: give plain path segments, e.g. s3://{bucket}/reprostack/wheels"
    return S3Location(bucket, prefix)


def check_url(url: str) -> str | None:
    """What is wrong with a ``remote=`` URL, or None."""
    if url.startswith("s3://"):
        location = parse_s3_url(url)
        return location if isinstance(location, str) else None
    if url.startswith(("http://", "https://")) and len(url.split("://", 1)[1]) > 0:
        return None
    return "give the http(s) URL of a Bazel HTTP remote cache (http://cache:8080) or an S3 bucket (s3://bucket/prefix)"
