"""The docker command line, the way this project uses it.

Every call goes through :mod:`tasks.proc` (long commands, logged) or
:func:`tasks.proc.check_output` (short queries). Nothing here runs while
doit loads tasks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tasks import proc
from tasks.errors import ImageError

START_HINT = (
    "Start the daemon (`sudo systemctl start docker`, or `sudo dockerd &`), or install it "
    "(Debian/Ubuntu: `sudo apt-get install docker.io`); set DOCKER_HOST for a remote daemon."
)

#: The legacy builder needs no buildx plugin and runs on every daemon since 1.x; the
#: Dockerfile uses nothing BuildKit-only. REPRO_DOCKER_BUILDKIT=1 switches to BuildKit.
BUILDKIT_ENV = "REPRO_DOCKER_BUILDKIT"


def docker_bin() -> str:
    found = shutil.which("docker")
    if found is None:
        raise ImageError(f"docker: the docker command is not installed. {START_HINT}")
    return found


def client_env() -> dict[str, str]:
    """The environment of docker commands: ours, with the builder chosen explicitly."""
    env = dict(os.environ)
    env["DOCKER_BUILDKIT"] = "1" if os.environ.get(BUILDKIT_ENV, "") not in ("", "0") else "0"
    env.setdefault("DOCKER_CLI_HINTS", "false")
    return env


def query(args: Sequence[str], *, what: str) -> str:
    """A short docker command whose output we need."""
    out = proc.check_output([docker_bin(), *args], env=client_env(), error=ImageError, what=what)
    return out.decode("utf-8", "replace")


def check_daemon() -> str:
    """The daemon's version; a clear error when there is none to talk to."""
    docker = docker_bin()
    try:
        out = proc.check_output(
            [docker, "version", "--format", "{{.Server.Version}}"], env=client_env(), error=ImageError, what="docker"
        )
    except ImageError as exc:
        raise ImageError(f"docker: cannot reach the docker daemon ({_first_line(str(exc))}). {START_HINT}") from None
    return out.decode().strip()


def _first_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text


def inspect_image(ref: str) -> dict[str, Any] | None:
    """``docker image inspect`` of one image, or None when the daemon has no such image."""
    try:
        out = proc.check_output(
            [docker_bin(), "image", "inspect", ref],
            env=client_env(),
            error=ImageError,
            what=f"docker image inspect {ref}",
        )
    except ImageError as exc:
        if re.search(r"no such image|not found", exc.message, re.I):
            return None
        raise
    data = json.loads(out)
    return data[0] if isinstance(data, list) and data else None


#: Local alias of a base image, named by its ID: BuildKit reads ``FROM sha256:...`` as a Docker Hub
#: name and would try to pull it, while a local tag is used as it is, by both builders.
PIN_REPOSITORY = "reprostack-pinned-base"


def pin_tag(image_id: str) -> str:
    """Tag the local image ``image_id`` as ``reprostack-pinned-base:<its 64 hex digits>``; return that tag."""
    tag = f"{PIN_REPOSITORY}:{image_id.removeprefix('sha256:')}"
    query(["image", "tag", image_id, tag], what=f"docker image tag {image_id}")
    return tag


def image_labels(info: Mapping[str, Any]) -> dict[str, str]:
    return dict((info.get("Config") or {}).get("Labels") or {})


def images_with_label(label: str) -> list[str]:
    """IDs of the images carrying ``label`` (any value)."""
    out = query(["image", "ls", "--no-trunc", "--quiet", "--filter", f"label={label}"], what="docker image ls")
    return sorted(set(out.split()))


def runtimes() -> dict[str, Any]:
    out = query(["info", "--format", "{{json .Runtimes}}"], what="docker info")
    data = json.loads(out or "{}")
    return data if isinstance(data, dict) else {}


def build(
    context: Path,
    *,
    tag: str,
    build_args: Mapping[str, str],
    labels: Mapping[str, str],
    log: Path,
    network: str = "none",
) -> None:
    """``docker build`` with its output in ``log``; ImageError naming the failing step."""
    cmd = [docker_bin(), "build", "--rm", "--force-rm", "--network", network, "--tag", tag]
    if client_env()["DOCKER_BUILDKIT"] == "1":
        cmd += ["--progress", "plain"]
    for key, value in sorted(build_args.items()):
        cmd += ["--build-arg", f"{key}={value}"]
    for key, value in sorted(labels.items()):
        cmd += ["--label", f"{key}={value}"]
    cmd.append(str(context))
    start = log.stat().st_size if log.exists() else 0
    try:
        proc.run(cmd, env=client_env(), log=log, error=ImageError, what=f"docker build of {tag}")
    except ImageError as exc:
        with log.open("rb") as fh:
            fh.seek(start)
            step = failing_step(fh.read().decode("utf-8", "replace"))
        head, _, rest = exc.message.partition("\n")
        where = f" at {step}" if step else ""
        raise ImageError(f"{head.rstrip('.')}{where}.\n{rest}\nNo image was tagged.") from None


_LEGACY_STEP = re.compile(r"^Step (\d+/\d+) : (.*)$")
_VERTEX = re.compile(r"^#(\d+) (.*)$")
_VERTEX_HEADER = re.compile(r"^\[([^\]]+)\] (.*)$")
_VERTEX_TIME = re.compile(r"^\d+\.\d+ ")
_OWN_STEP = re.compile(r"^reprostack: step (.*)$")


def failing_step(output: str) -> str:
    """Name the Dockerfile step, and our install script's own step, that a failed build stopped in.

    Legacy builder: the last ``Step N/M : INSTRUCTION`` line. BuildKit
    (``--progress plain``): the ``#N [stage k/m] INSTRUCTION`` header of the
    vertex that printed ``#N ERROR``. The install script prints
    ``reprostack: step ...`` before each of its own steps.
    """
    headers: dict[str, str] = {}
    own_by_vertex: dict[str, str] = {}
    legacy = legacy_own = failed = ""
    for raw in output.splitlines():
        line = raw.strip()
        if m := _LEGACY_STEP.match(line):
            legacy, legacy_own = f"Dockerfile step {m.group(1)} ({_clip(m.group(2))})", ""
        elif m := _VERTEX.match(line):
            vertex, rest = m.group(1), m.group(2)
            if h := _VERTEX_HEADER.match(rest):
                headers[vertex] = f"Dockerfile step [{h.group(1)}] ({_clip(h.group(2))})"
            elif rest.startswith("ERROR"):
                failed = vertex
            elif o := _OWN_STEP.match(_VERTEX_TIME.sub("", rest, count=1)):
                own_by_vertex[vertex] = o.group(1)
        elif o := _OWN_STEP.match(line):
            legacy_own = o.group(1)
    step, own = (headers.get(failed, ""), own_by_vertex.get(failed, "")) if failed else (legacy, legacy_own)
    if own:
        return f"{step}, install step '{_clip(own)}'" if step else f"install step '{_clip(own)}'"
    return step


def _clip(text: str, width: int = 100) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def run_container(
    image: str,
    command: Sequence[str],
    *,
    log: Path,
    what: str,
    mounts: Sequence[tuple[Path, str, bool]] = (),
    env: Mapping[str, str] | None = None,
    network: str = "none",
    gpus: bool = False,
    user: str | None = None,
    workdir: str | None = None,
    extra: Sequence[str] = (),
) -> None:
    """``docker run --rm`` of ``command``; mounts are (host path, container path, read-only)."""
    cmd = [docker_bin(), "run", "--rm", "--network", network, *extra]
    if gpus:
        cmd += ["--gpus", "all"]
    if user:
        cmd += ["--user", user]
    if workdir:
        cmd += ["--workdir", workdir]
    for host, inside, read_only in mounts:
        cmd += ["--mount", f"type=bind,source={host.resolve()},target={inside}{',readonly' if read_only else ''}"]
    for key, value in sorted((env or {}).items()):
        cmd += ["--env", f"{key}={value}"]
    cmd += [image, *command]
    proc.run(cmd, env=client_env(), log=log, error=ImageError, what=what)


def current_user() -> str:
    return f"{os.getuid()}:{os.getgid()}"
