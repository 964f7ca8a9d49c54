"""Container image references and pins: parsing and Docker's naming defaults.

Pure: no docker, no network. A reference is ``[registry/]repository[:tag]``
as ``docker pull`` reads it; Docker Hub's short forms (``debian:12``,
``lmsysorg/sglang:latest``) expand to ``registry-1.docker.io`` and
``library/`` the way the docker CLI expands them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
#: A local image ID as ``docker images --no-trunc`` prints it, or a unique prefix of at least 12 hex digits.
IMAGE_ID_RE = re.compile(r"^(sha256:)?[0-9a-f]{12,64}$")
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_DOMAIN_RE = re.compile(r"^(?:localhost|[A-Za-z0-9.-]+\.[A-Za-z0-9.-]+|[A-Za-z0-9.-]+:\d+|\[[0-9a-fA-F:]+\](?::\d+)?)$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")

DOCKER_HUB = "docker.io"
DOCKER_HUB_API = "registry-1.docker.io"


@dataclass(frozen=True, kw_only=True)
class Reference:
    """``registry/repository:tag``, with Docker Hub's defaults filled in."""

    registry: str
    repository: str
    tag: str = ""
    text: str = ""  # as written, for messages

    @property
    def api_host(self) -> str:
        """The host serving the registry API (Docker Hub's differs from its name)."""
        return DOCKER_HUB_API if self.registry == DOCKER_HUB else self.registry

    @property
    def name(self) -> str:
        """The repository as docker names it locally (``lmsysorg/sglang``, ``nvcr.io/nvidia/pytorch``)."""
        if self.registry == DOCKER_HUB:
            return self.repository.removeprefix("library/")
        return f"{self.registry}/{self.repository}"

    def pinned(self, digest: str) -> str:
        """``name@sha256:...``: what ``docker pull`` and ``docker image inspect`` accept for a digest pin."""
        return f"{self.name}@{digest}"

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}" if self.tag else self.name


def parse_reference(text: str) -> Reference:
    """Parse ``[registry/]repository[:tag]``; raise ValueError saying what is wrong."""
    if not text or text != text.strip():
        raise ValueError(f"{text!r} is not an image reference (write e.g. 'nvcr.io/nvidia/pytorch:25.09-py3')")
    if "@" in text:
        raise ValueError(f"{text!r} carries a digest: write the tag here and the digest in the 'digest' key")
    head, slash, rest = text.partition("/")
    if slash and _DOMAIN_RE.match(head):
        registry, remainder = head, rest
    else:
        registry, remainder = DOCKER_HUB, text
    name, tag = remainder, ""
    colon = remainder.rfind(":")
    if colon > remainder.rfind("/"):
        name, tag = remainder[:colon], remainder[colon + 1 :]
        if not _TAG_RE.match(tag):
            raise ValueError(f"{text!r}: tag {tag!r} is not a valid tag")
    if not _REPOSITORY_RE.match(name):
        raise ValueError(
            f"{text!r}: repository {name!r} must be lowercase letters, digits and separators ('.', '_', '-', '/')"
        )
    if registry in (DOCKER_HUB, "index.docker.io", DOCKER_HUB_API):
        registry = DOCKER_HUB
        if "/" not in name:
            name = f"library/{name}"
    return Reference(registry=registry, repository=name, tag=tag, text=text)


def is_digest(value: str) -> bool:
    return bool(DIGEST_RE.match(value))


def is_image_id(value: str) -> bool:
    return bool(IMAGE_ID_RE.match(value))


def short_id(image_id: str) -> str:
    """The 12 hex digits docker shows for an image ID."""
    return image_id.removeprefix("sha256:")[:12]


def label_key(*parts: str) -> str:
    """A label key under ``org.reprostack.``: lowercase, only letters, digits, '.', '-' (others become '-')."""
    cleaned = [re.sub(r"[^a-z0-9.-]+", "-", p.lower()).strip("-.") for p in parts]
    return ".".join(["org.reprostack", *cleaned])
