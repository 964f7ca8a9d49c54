"""The docker command line, the way this project uses it.

Every call goes through :mod:`tasks.core.proc` (long commands, logged) or
:func:`tasks.core.proc.query` (short queries). Nothing here runs while
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

from tasks.core import proc
from tasks.core.errors import ImageError

START_HINT = (
    "Start the daemon (`sudo systemctl start docker`, or `sudo dockerd &`), or install it "
    "(Debian/Ubuntu: `sudo apt-get install docker.io`); set DOCKER_HOST for a remote daemon."
)


def docker_bin() -> str:
    found = shutil.which("docker")
    if found is None:
        raise ImageError(f"docker: the docker command is not installed. {START_HINT}")
    return found


def client_env() -> dict[str, str]:
    """The environment of docker commands: ours, without the CLI's hints."""
    env = dict(os.environ)
    env.setdefault("DOCKER_CLI_HINTS", "false")
    return env


def query(args: Sequence[str], *, what: str) -> str:
    """A short docker command whose output we need."""
    out = proc.query([docker_bin(), *args], env=client_env(), error=ImageError, what=what).stdout
    return out.decode("utf-8", "replace")


def check_daemon() -> str:
    """The daemon's version; a clear error when there is none to talk to."""
    docker = docker_bin()
    try:
        out = proc.query(
            [docker, "version", "--format", "{{.Server.Version}}"], env=client_env(), error=ImageError, what="docker"
        ).stdout
    except ImageError as exc:
        raise ImageError(f"docker: cannot reach the docker daemon ({_first_line(str(exc))}). {START_HINT}") from None
    return out.decode().strip()


def _first_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text


def inspect_image(ref: str) -> dict[str, Any] | None:
    """``docker image inspect`` of one image, or None when the daemon has no such image."""
    try:
        out = proc.query(
            [docker_bin(), "image", "inspect", ref],
            env=client_env(),
            error=ImageError,
            what=f"docker image inspect {ref}",
        ).stdout
    except ImageError as exc:
        if re.search(r"no such image|not found", exc.message, re.I):
            return None
        raise
    data = json.loads(out)
    return data[0] if isinstance(data, list) and data else None


def image_labels(info: Mapping[str, Any]) -> dict[str, str]:
    return dict((info.get("Config") or {}).get("Labels") or {})


def image_history(ref: str) -> list[dict[str, Any]]:
    """``docker image history`` of one image, newest entry first: CreatedAt, CreatedBy, Comment, Size (bytes)."""
    out = query(
        ["image", "history", "--no-trunc", "--human=false", "--format", "{{json .}}", ref],
        what=f"docker image history {ref}",
    )
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def images_with_label(label: str) -> list[str]:
    """IDs of the images carrying ``label`` (any value)."""
    out = query(["image", "ls", "--no-trunc", "--quiet", "--filter", f"label={label}"], what="docker image ls")
    return sorted(set(out.split()))


def runtimes() -> dict[str, Any]:
    out = query(["info", "--format", "{{json .Runtimes}}"], what="docker info")
    data = json.loads(out or "{}")
    return data if isinstance(data, dict) else {}


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


def create_container(
    image: str,
    command: Sequence[str],
    *,
    name: str,
    entrypoint: str,
    env: Mapping[str, str],
    user: str = "0:0",
    network: str = "none",
) -> None:
    """``docker create`` a container named ``name`` (started later by :func:`start_attached`)."""
    cmd = ["create", "--name", name, "--network", network, "--user", user, "--entrypoint", entrypoint]
    for key, value in sorted(env.items()):
        cmd += ["--env", f"{key}={value}"]
    query([*cmd, image, *command], what=f"docker create {name}")


def copy_into(container: str, src: Path, dest: str) -> None:
    """``docker cp SRC CONTAINER:DEST`` of a directory: DEST becomes a copy of it (through the API, no mount)."""
    query(["cp", f"{src}/.", f"{container}:{dest}"], what=f"docker cp {src} {container}:{dest}")


def start_attached(container: str, *, log: Path, what: str) -> None:
    """``docker start --attach``: run the created container to its end, its output in ``log``."""
    proc.run([docker_bin(), "start", "--attach", container], env=client_env(), log=log, error=ImageError, what=what)


def copy_out(container: str, path: str, dest: Path, *, log: Path) -> None:
    """``docker cp CONTAINER:PATH -``: ``path`` as a tar (its last component first in every name) in ``dest``."""
    proc.run(
        [docker_bin(), "cp", f"{container}:{path}", "-"],
        env=client_env(),
        log=log,
        error=ImageError,
        what=f"docker cp {container}:{path}",
        stdout=dest,
    )


def remove_container(container: str) -> None:
    """``docker rm --force``, quietly: a container that is not there is already removed."""
    proc.query([docker_bin(), "rm", "--force", container], env=client_env(), timeout=120, tolerant=True)


def load(archive: Path, *, log: Path) -> None:
    """``docker load --input``."""
    proc.run(
        [docker_bin(), "load", "--input", str(archive)],
        env=client_env(),
        log=log,
        error=ImageError,
        what=f"docker load of {archive.name}",
    )
