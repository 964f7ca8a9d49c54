"""Builder containers: build each wheel inside an image, so that the toolchain is the image.

Which builder (``builder=`` / ``REPRO_BUILDER``, else the lock's ``[builder]``):

- ``host`` (the default where the lock has no ``[builder]``): builds on this host, as before;
- ``lock``, or nothing with a ``[builder]`` in the lock: the lock's image, pinned by digest
  (``doit lock`` records it; `docker pull name@digest` makes it local);
- an image ID: that local image.

With a builder, the toolchain fingerprint is probed inside the image (once
per image ID, memoised in the cache) and the image's pin enters every action
key, so wheels built on the host and in a builder never share a cache entry.
The build itself is `pip wheel` run by the image's Python in ``docker run
--rm --network none``, as the calling user, with the staged tree and the
output directory mounted at fixed paths (``/reprostack/src``,
``/reprostack/out``): the same sources build at the same path on every host.
Only the recipe's environment goes in, nothing of the host's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.core import proc
from tasks.core.errors import ImageError, ToolchainError
from tasks.core.fsutil import write_atomic
from tasks.core.imageref import parse_reference
from tasks.core.settings import Settings
from tasks.env import docker, toolchain
from tasks.lock.lockfile import BuilderSpec
from tasks.store.cache import Cache
from tasks.store.wheelnorm import DEFAULT_EPOCH

SRC_MOUNT = "/reprostack/src"
OUT_MOUNT = "/reprostack/out"
PROBE_VERSION = 1

#: Fixed environment of every build in a builder (the recipe's and the job variables come on top).
BUILD_ENV = {
    "SOURCE_DATE_EPOCH": str(DEFAULT_EPOCH),
    "PIP_NO_INDEX": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_NO_INPUT": "1",
    "PIP_CONFIG_FILE": "/dev/null",
    "PYTHONNOUSERSITE": "1",
    "HOME": "/tmp",
}


@dataclass(frozen=True, kw_only=True)
class Builder:
    """A resolved builder image."""

    image_id: str
    python: str
    pin: Mapping[str, str] = field(default_factory=dict)  # what enters the action key
    description: str = ""


def resolve(settings: Settings, spec: BuilderSpec | None, *, lock: Path) -> Builder | None:
    """The builder in effect, or None for host builds. Talks to docker only when a builder is asked for."""
    choice = settings.builder or ("lock" if spec is not None else "host")
    if choice == "host":
        return None
    docker.check_daemon()
    if choice == "lock":
        if spec is None:
            raise ImageError(f"builder=lock, but {lock} has no [builder] table (image, digest)")
        ref = parse_reference(spec.image)
        if not spec.digest:
            raise ImageError(
                f"{lock}: [builder] image {spec.image!r} has no digest: run `doit lock` where the registry is "
                "reachable, name a local image with builder=<image ID>, or build on this host with builder=host"
            )
        info = docker.inspect_image(ref.pinned(spec.digest))
        if info is None:
            raise ImageError(
                f"the builder {spec.image} at {spec.digest} is not in the local docker daemon: "
                f"`docker pull {ref.pinned(spec.digest)}`, or builder=<image ID>, or builder=host"
            )
        return Builder(
            image_id=str(info["Id"]),
            python=spec.python,
            pin={"image": spec.image, "digest": spec.digest},
            description=f"{spec.image}@{spec.digest[:19]}…",
        )
    info = docker.inspect_image(choice.removeprefix("sha256:"))
    if info is None:
        raise ImageError(f"builder={choice}: no such image in the local docker daemon (`docker images`)")
    full = str(info["Id"])
    python = spec.python if spec is not None else "python3"
    return Builder(image_id=full, python=python, pin={"id": full}, description=f"local image {full[7:19]}")


# Runs in the builder's interpreter (standard library only): the same description
# as tasks/toolchain.probe gives of the host, from inside the image.
_BUILDER_PROBE = r"""
import glob, json, os, re, shutil, subprocess, sys
res = subprocess.run([sys.executable, "-c", os.environ["REPRO_PYTHON_PROBE"]], capture_output=True, text=True)
if res.returncode != 0:
    sys.stderr.write(res.stderr)
    sys.exit(1)
info = json.loads(res.stdout)
dists = info.pop("dists")
def first_line(cmd, pattern=""):
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    lines = [l.strip() for l in (r.stdout or r.stderr).decode("utf-8", "replace").splitlines() if l.strip()]
    if pattern:
        lines = [l for l in lines if re.search(pattern, l)] or lines
    return lines[0] if lines else ""
nvcc = shutil.which("nvcc") or next((os.path.join(h, "bin", "nvcc") for h in (os.environ.get("CUDA_HOME"),
       "/usr/local/cuda") if h and os.path.exists(os.path.join(h, "bin", "nvcc"))), "")
tools = {"nvcc": first_line([nvcc, "--version"], "release") if nvcc else "", "nvcc_path": nvcc,
         "cc": first_line([shutil.which("cc") or "cc", "--version"]),
         "cxx": first_line([shutil.which("c++") or "c++", "--version"]),
         "cmake": first_line(["cmake", "--version"]) if shutil.which("cmake") else "",
         "ninja": first_line(["ninja", "--version"]) if shutil.which("ninja") else ""}
cudnn_version, cudnn_path = "", ""
for base in [os.environ.get("CUDNN_PATH", ""), info.pop("cudnn_pip", ""), "/usr"]:
    for header in glob.glob(os.path.join(base, "include", "**", "cudnn_version.h"), recursive=True) if base else []:
        text = open(header).read()
        nums = [re.search(r"#define CUDNN_%s\s+(\d+)" % k, text) for k in ("MAJOR", "MINOR", "PATCHLEVEL")]
        if all(nums):
            cudnn_version, cudnn_path = ".".join(m.group(1) for m in nums), base
            break
    if cudnn_version:
        break
cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else ""
print(json.dumps({"python": info, "tools": tools, "cudnn": {"version": cudnn_version, "path": cudnn_path},
                  "cuda_home": cuda_home, "dists": dists}))
"""


def detect(cache: Cache, builder: Builder) -> dict[str, Any]:
    """The builder's toolchain description, probed once per image ID."""
    memo = cache.root / "toolchain" / f"builder-v{PROBE_VERSION}-{builder.image_id.removeprefix('sha256:')}.json"
    try:
        return dict(json.loads(memo.read_text()))
    except (FileNotFoundError, ValueError):
        pass
    try:
        out = proc.query(
            [docker.docker_bin(), "run", "--rm", "--network", "none", "--env", "REPRO_PYTHON_PROBE",
             builder.image_id, builder.python, "-c", _BUILDER_PROBE],
            env={**docker.client_env(), "REPRO_PYTHON_PROBE": toolchain._PROBE},
            error=ToolchainError,
            what=f"probing the toolchain of builder {builder.description}",
        ).stdout  # fmt: skip
        info: dict[str, Any] = json.loads(out)
    except ValueError as exc:
        raise ToolchainError(f"builder {builder.description}: the toolchain probe printed no JSON ({exc})") from None
    cache.ensure()
    write_atomic(memo, json.dumps(info, indent=2, sort_keys=True) + "\n")
    return info


def container_command(
    builder: Builder,
    cmd: Sequence[str],
    *,
    mounts: Mapping[Path, str],
    workdir: Path,
    env: Mapping[str, str],
) -> list[str]:
    """``cmd`` (a host `python -m pip wheel ...`) as a ``docker run`` in the builder."""
    return [docker.docker_bin(), *run_arguments(builder, cmd, mounts=mounts, workdir=workdir, env=env)]


def run_arguments(
    builder: Builder,
    cmd: Sequence[str],
    *,
    mounts: Mapping[Path, str],
    workdir: Path,
    env: Mapping[str, str],
    user: str | None = None,
) -> list[str]:
    """The arguments of ``docker`` that run ``cmd`` in the builder (pure).

    Host paths under a mount are rewritten to the mount's fixed path; the
    interpreter becomes the builder's.
    """

    def inside(arg: str) -> str:
        for host, target in mounts.items():
            prefix = str(host)
            if arg == prefix or arg.startswith(prefix + "/"):
                return target + arg[len(prefix) :]
        return arg

    run = ["run", "--rm", "--network", "none", "--user", user or docker.current_user()]
    for host, target in mounts.items():
        run += ["--mount", f"type=bind,source={host},target={target}"]
    run += ["--workdir", inside(str(workdir))]
    for key in sorted(env):
        run += ["--env", f"{key}={env[key]}"]
    return [*run, builder.image_id, builder.python, *(inside(a) for a in cmd[1:])]


def build_env(recipe_env: Mapping[str, str], jobs_env: Sequence[str], jobs: int) -> dict[str, str]:
    """The environment inside the builder: fixed variables, the recipe's, the job counts. Nothing of the host's."""
    env = dict(BUILD_ENV)
    env.update(recipe_env)
    env.update({name: str(jobs) for name in jobs_env})
    return env
