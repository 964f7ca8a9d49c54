"""The remote wheel cache: a Bazel HTTP remote cache shared by machines and shards.

Layout on the server (Bazel's, so any server for ``--remote_cache=http://…``
serves it: nginx with WebDAV PUT, bazel-remote, ...)::

    ac/<action key>    a small JSON record: filename, sha256, size, key, key_document, package
    cas/<sha256>       the wheel's bytes

Trust: the server is trusted for the mapping action key -> sha256 (whoever
can write ``ac/`` decides which wheel a key gets, so give write access to
trusted builders only). Everything else is checked before use: the record
must name this key (its key document hashes to it), a plain wheel file name
and a size; the blob must have exactly that size and sha256. Anything else
is a loud warning and a local build. A network error, a timeout or a server
error is a warning too: the remote is then not consulted again in this run,
and the package builds locally. A remote never fails a build that could be
done locally.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.cache import Cache, WheelEntry, warn
from tasks.keys import action_key, canonical_json

if TYPE_CHECKING:
    import requests

#: Tries per request (connection errors, timeouts, 5xx), with this backoff between them.
TRIES = 3
BACKOFF_S = (0.5, 1.0)

_WHEEL_NAME = re.compile(r"^[A-Za-z0-9_.+!-]+\.whl$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class RemoteUnavailable(Exception):
    """The remote did not answer usefully (network error, timeout, server error)."""


class Remote:
    """One run's client of the remote cache; after a network failure it stays off for the run."""

    def __init__(self, url: str, *, write: bool, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.write = write
        self.timeout = timeout
        self._off = False
        self._lock = threading.Lock()
        self._session: requests.Session | None = None

    def __repr__(self) -> str:
        return f"Remote({self.url!r}, write={self.write})"

    # -- reading

    def restore(self, cache: Cache, package: str, key: str) -> WheelEntry | None:
        """The wheel for ``key`` from the remote, verified and put into ``cache``; None: build locally."""
        if self._off:
            return None
        try:
            raw = self._request("GET", f"ac/{key}")
            if raw is None:
                print(f"remote: no entry for {package} (key {key[:12]}) on {self.url}", flush=True)
                return None
            record = check_record(raw, key)
            if isinstance(record, str):
                warn(f"remote entry {self.url}/ac/{key} for {package} rejected: {record}; building locally")
                return None
            with cache.staging(f"remote-{package}") as tmp:
                path = tmp / record["filename"]
                problem = self._download(f"cas/{record['sha256']}", path, record["size"], record["sha256"])
                if problem is not None:
                    warn(
                        f"remote blob {self.url}/cas/{record['sha256']} for {package} rejected: {problem}; "
                        "it is not used, the package builds locally"
                    )
                    return None
                entry = cache.put_wheel(
                    key,
                    path,
                    {
                        "package": package,
                        "key_document": record["key_document"],
                        "restored_from": f"{self.url}/ac/{key}",
                        "note": "restored from remote",
                    },
                )
        except RemoteUnavailable as exc:
            self._give_up(str(exc))
            return None
        if entry.sha256 != record["sha256"]:  # pragma: no cover - put_wheel hashes what it stored
            warn(f"wheel of {package} changed while stored from the remote; building locally")
            return None
        print(f"restored {package} from remote {self.url} (sha256:{entry.sha256[:16]}…): {entry.path.name}", flush=True)
        return entry

    def _download(self, path: str, dest: Path, size: int, sha256: str) -> str | None:
        """Stream a blob into ``dest``; the problem with it, or None when it has the size and sha256 expected."""
        digest = hashlib.sha256()
        got = 0
        retryable: tuple[type[Exception], ...] = (_Retry, *_network_errors())
        for attempt in range(TRIES):
            digest, got = hashlib.sha256(), 0
            try:
                with self._http().get(f"{self.url}/{path}", timeout=self.timeout, stream=True) as resp:
                    if resp.status_code == 404:
                        return "missing on the server"
                    if resp.status_code >= 500:
                        raise _Retry(f"HTTP {resp.status_code}")
                    if resp.status_code != 200:
                        return f"HTTP {resp.status_code}"
                    with open(dest, "wb") as fh:
                        for chunk in resp.iter_content(1 << 20):
                            got += len(chunk)
                            if got > size:
                                return f"larger than the {size} bytes the record states"
                            digest.update(chunk)
                            fh.write(chunk)
                break
            except retryable as exc:
                if attempt == TRIES - 1:
                    raise RemoteUnavailable(f"GET {self.url}/{path}: {exc}") from None
                time.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
        if got != size:
            return f"{got} bytes, but the record states {size}"
        if digest.hexdigest() != sha256:
            return f"sha256 {digest.hexdigest()}, but the record states {sha256}"
        return None

    # -- writing

    def upload(self, entry: WheelEntry, package: str, key_document: dict[str, Any]) -> None:
        """Put a locally built wheel on the remote: the blob first, then the record that points at it."""
        if not self.write or self._off:
            return
        record = {
            "filename": entry.path.name,
            "sha256": entry.sha256,
            "size": entry.size,
            "key": entry.key,
            "key_document": key_document,
            "package": package,
        }
        try:
            self._put(f"cas/{entry.sha256}", entry.path.read_bytes())
            self._put(f"ac/{entry.key}", canonical_json(record))
        except RemoteUnavailable as exc:
            self._give_up(str(exc))
            return
        print(f"uploaded {package} to remote {self.url} (key {entry.key[:12]})", flush=True)

    def _put(self, path: str, data: bytes) -> None:
        resp = self._retrying("PUT", path, data)
        if resp.status_code not in (200, 201, 204):
            raise RemoteUnavailable(f"PUT {self.url}/{path}: HTTP {resp.status_code}")

    # -- plumbing

    def _request(self, method: str, path: str) -> bytes | None:
        """The body of a small GET; None for 404."""
        resp = self._retrying(method, path)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise RemoteUnavailable(f"{method} {self.url}/{path}: HTTP {resp.status_code}")
        return resp.content

    def _retrying(self, method: str, path: str, data: bytes | None = None) -> requests.Response:
        for attempt in range(TRIES):
            try:
                resp = self._http().request(method, f"{self.url}/{path}", data=data, timeout=self.timeout)
                if resp.status_code < 500:
                    return resp
                problem = f"HTTP {resp.status_code}"
            except _network_errors() as exc:
                problem = str(exc)
            if attempt == TRIES - 1:
                raise RemoteUnavailable(f"{method} {self.url}/{path}: {problem}")
            time.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
        raise AssertionError("unreachable")  # pragma: no cover

    def _http(self) -> requests.Session:
        import requests  # imported on use: keeps `doit list` fast

        with self._lock:
            if self._session is None:
                self._session = requests.Session()
                self._session.trust_env = False  # the remote is named explicitly; no proxies from the environment
            return self._session

    def _give_up(self, problem: str) -> None:
        with self._lock:
            first = not self._off
            self._off = True
        if first:
            warn(f"remote cache {self.url} unavailable ({problem}); not consulted again in this run, building locally")


class _Retry(Exception):
    pass


def _network_errors() -> tuple[type[Exception], ...]:
    import requests

    return (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError, OSError)


def check_record(raw: bytes, key: str) -> dict[str, Any] | str:
    """The ``ac/`` record for ``key`` if it is well formed and names this key; else what is wrong with it."""
    try:
        record = json.loads(raw)
    except ValueError as exc:
        return f"not JSON ({exc})"
    if not isinstance(record, dict):
        return "not a JSON object"
    filename, sha256, size = record.get("filename"), record.get("sha256"), record.get("size")
    if not isinstance(filename, str) or not _WHEEL_NAME.match(filename):
        return f"filename {filename!r} is not a wheel file name"
    if not isinstance(sha256, str) or not _SHA256.match(sha256):
        return f"sha256 {sha256!r} is not a sha256"
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        return f"size {size!r} is not a positive number of bytes"
    if record.get("key") != key:
        return f"it is the record of key {record.get('key')!r}"
    doc = record.get("key_document")
    if not isinstance(doc, dict) or action_key(doc) != key:
        return "its key document does not hash to the action key"
    return record


def shard_packages(names: Sequence[str], shard: tuple[int, int]) -> list[str]:
    """The packages of shard ``i`` of ``n``: round robin over the sorted names (stable for a lock and profile)."""
    i, n = shard
    return sorted(names)[i - 1 :: n]
