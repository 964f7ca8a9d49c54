"""Resolve an image tag to its digest through the registry's HTTP API, and pin it in the lock.

`doit lock` asks the registry named by ``[image].base`` (and ``[builder].image``)
for the manifest of the tag (the distribution spec's ``HEAD
/v2/<repository>/manifests/<tag>``, with an anonymous bearer token where the
registry asks for one, as Docker Hub and nvcr.io do) and records the
``Docker-Content-Digest`` it answers: the digest of the multi-platform index
where there is one, which is what ``docker pull name@digest`` takes.

Where no registry is reachable the lock keeps no digest and `doit lock` says
so; `doit image` then refuses the base until a digest is written or a local
image is named with ``base=<image ID>``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import requests
import tomlkit

from tasks.cli.lockcmd import set_key
from tasks.core import net
from tasks.core.errors import ImageError
from tasks.core.fsutil import write_atomic
from tasks.core.imageref import Reference, is_digest, parse_reference
from tasks.lock.lockfile import load_lock

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
#: Lock tables holding an image reference, and the key naming it.
IMAGE_TABLES = {"image": "base", "builder": "image"}


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="...",service="...",scope="..."`` -> ("bearer", {realm, service, scope})."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    return scheme.lower(), params


def is_loopback(host: str) -> bool:
    """Registries on this machine speak plain HTTP (docker treats 127.0.0.0/8 as insecure too)."""
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:].split("]", 1)[0]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def manifest_url(ref: Reference) -> str:
    scheme = "http" if is_loopback(ref.api_host) else "https"
    return f"{scheme}://{ref.api_host}/v2/{ref.repository}/manifests/{ref.tag}"


def resolve_digest(ref: Reference, *, timeout: float | None = None) -> str:
    """The digest the registry serves for ``ref``'s tag; ImageError saying why not.

    Each request gives up after ``timeout`` seconds (default: ``REPRO_NET_TIMEOUT``, tasks/core/net.py).
    """
    if timeout is None:
        timeout = net.timeout()
    url = manifest_url(ref)
    headers = {"Accept": ", ".join(MANIFEST_TYPES)}
    try:
        with net.session(trust_env=True) as session:  # proxies from the environment, as docker would use them
            res = session.head(url, headers=headers, timeout=timeout, allow_redirects=True)
            if res.status_code == 401:
                headers["Authorization"] = f"Bearer {_anonymous_token(session, ref, res.headers, timeout)}"
                res = session.head(url, headers=headers, timeout=timeout, allow_redirects=True)
            digest = res.headers.get("Docker-Content-Digest", "")
            if res.ok and not digest:
                body = session.get(url, headers=headers, timeout=timeout)
                body.raise_for_status()
                digest = "sha256:" + hashlib.sha256(body.content).hexdigest()
    except requests.RequestException as exc:
        raise ImageError(f"cannot reach registry {ref.api_host} for {ref}: {_reason(exc)}") from None
    if res.status_code in (401, 403):
        raise ImageError(f"registry {ref.api_host} refuses anonymous access to {ref} (HTTP {res.status_code})")
    if res.status_code == 404:
        raise ImageError(f"registry {ref.api_host} has no tag {ref.tag!r} in {ref.repository}")
    if not res.ok:
        raise ImageError(f"registry {ref.api_host} answered HTTP {res.status_code} for {ref}")
    if not is_digest(digest):
        raise ImageError(f"registry {ref.api_host} gave no usable digest for {ref} (got {digest!r})")
    return digest


def _anonymous_token(session: requests.Session, ref: Reference, headers: Mapping[str, str], timeout: float) -> str:
    scheme, params = parse_challenge(headers.get("WWW-Authenticate", ""))
    if scheme != "bearer" or "realm" not in params:
        raise ImageError(f"registry {ref.api_host} asks for credentials ({scheme or 'no challenge'}) for {ref}")
    query = {"scope": params.get("scope") or f"repository:{ref.repository}:pull"}
    if "service" in params:
        query["service"] = params["service"]
    res = session.get(params["realm"], params=query, timeout=timeout)
    if not res.ok:
        raise ImageError(f"registry {ref.api_host}: no anonymous token for {ref} (HTTP {res.status_code})")
    doc: dict[str, Any] = res.json()
    token = doc.get("token") or doc.get("access_token")
    if not isinstance(token, str) or not token:
        raise ImageError(f"registry {ref.api_host}: the token service answered without a token for {ref}")
    return token


def _reason(exc: requests.RequestException) -> str:
    text = str(exc)
    if m := re.search(r"\[Errno -?\d+\] ([^'\")]+)", text):
        return m.group(1).strip()
    return text[-300:]


def lock_image_digests(lock_path: Path, update: tuple[str, ...]) -> list[str]:
    """Fill in ``digest`` of ``[image]`` and ``[builder]`` where missing (or named in update=).

    A registry that cannot be reached leaves the lock as it was and returns a
    line saying so and what to do instead; it is an error only when the table
    was named in ``update=`` explicitly.
    """
    lock = load_lock(lock_path, require_pins=False)
    specs = {"image": lock.image, "builder": lock.builder}
    doc = tomlkit.parse(lock_path.read_text())
    lines: list[str] = []
    changed = False
    failures: list[str] = []
    for table, spec in specs.items():
        if spec is None:
            continue
        key = IMAGE_TABLES[table]
        text = doc[table][key]
        ref = parse_reference(str(text))
        asked = table in update or "all" in update
        if spec.digest and not asked:
            lines.append(f"[{table}] {ref}: pinned {spec.digest[:19]}")
            continue
        try:
            digest = resolve_digest(ref)
        except ImageError as exc:
            message = (
                f"[{table}] {ref}: left {'at ' + spec.digest[:19] if spec.digest else 'without a digest'}: "
                f"{exc.message}. Run `doit lock` where the registry is reachable, or write the digest by hand "
                f"(`docker image inspect --format '{{{{index .RepoDigests 0}}}}' {ref}` on a host that pulled it)"
            )
            if table == "image":
                message += ", or build on a local image with `doit image base=<image ID>`"
            (failures if asked else lines).append(message)
            continue
        set_key(doc[table], "digest", digest)
        changed = changed or digest != spec.digest
        lines.append(f"[{table}] {ref}: {digest}")
    if changed:
        write_atomic(lock_path, tomlkit.dumps(doc))
        load_lock(lock_path, require_pins=False)  # what we wrote must validate (some pins may stay open)
    if failures:
        raise ImageError("\n".join(failures))
    return lines


def split_update(update: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``update=`` names for sources, and for the image tables (``image``, ``builder``)."""
    tables = tuple(u for u in update if u in IMAGE_TABLES)
    rest = tuple(u for u in update if u not in IMAGE_TABLES)
    return rest, tables + (("all",) if "all" in update else ())
