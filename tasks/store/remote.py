"""The remote wheel cache: Bazel's HTTP remote-cache layout, on an HTTP server or in an S3 bucket.

Layout (Bazel's, so any server for ``--remote_cache=http://…`` serves it:
nginx with WebDAV PUT, bazel-remote, ...; or the same keys under an S3
bucket and prefix, ``remote=s3://bucket/prefix``)::

    ac/<action key>    a small JSON record: filename, sha256, size, key, key_document, package
    cas/<sha256>       the wheel's bytes
    ac/<history key>   per package, the key documents of its last builds uploaded (for `doit plan`'s
                       diff against the nearest earlier build): the sha256 of "reprostack-history:<package>"

Trust: the server is trusted for the mapping action key -> sha256 (whoever
can write ``ac/`` decides which wheel a key gets, so give write access to
trusted builders only). Everything else is checked before use: the record
must name this key (its key document hashes to it), a plain wheel file name
of the package's distribution and a size; the blob must have exactly that size
and sha256, and its own ``*.dist-info/METADATA`` must name that distribution
(a record may keep the right file name and point at another project's valid
blob). Anything else
is a loud warning and a local build. A network error, a timeout or a server
error is a warning too: the remote is then not consulted again in this run,
and the package builds locally. A remote never fails a build that could be
done locally.

The trust logic lives in :class:`Remote`, once; a store (:class:`HttpStore`,
:class:`S3Store`) only moves bytes: ``get`` a small object, ``size`` of one
(its existence), ``put`` one, ``download`` a blob into a file. Stores retry
what is worth retrying, with a bounded number of tries and timeouts, and
raise :class:`RemoteUnavailable` when the remote does not answer usefully.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from packaging.utils import canonicalize_name

from tasks.core import net
from tasks.core.console import warn
from tasks.core.digest import action_key, canonical_json
from tasks.core.settings import S3Location, parse_s3_url
from tasks.store.cache import Cache, WheelEntry
from tasks.store.simple_index import wheel_problem, wheel_project

if TYPE_CHECKING:
    import requests

    from tasks.store.history import Earlier

#: Tries per request (connection errors, timeouts, 5xx), with this backoff between them (HTTP, through
#: tasks/core/net.py's session). An S3 request gets the same number of tries from botocore's "standard" retry mode.
TRIES = 3
BACKOFF_S = (0.5, 1.0)
CHUNK = 1 << 20

_WHEEL_NAME = re.compile(r"^[A-Za-z0-9_.+!-]+\.whl$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: Builds a package's history record on the remote keeps (the newest first).
HISTORY = 16


class RemoteUnavailable(Exception):
    """The remote did not answer usefully (network error, timeout, server error, refused credentials)."""


class Store(Protocol):
    """Where the remote's objects live; paths are ``ac/<key>`` and ``cas/<sha256>``."""

    url: str

    def get(self, path: str) -> bytes | None:
        """A small object's bytes; None when it does not exist."""

    def size(self, path: str) -> int | None:
        """An object's size in bytes; None when it does not exist."""

    def put(self, path: str, source: Path | bytes) -> None:
        """Store ``source`` (a file's contents, or bytes) as ``path``."""

    def download(self, path: str, dest: Path, limit: int) -> str | None:
        """Write the object into ``dest``, giving up past ``limit`` bytes; what was wrong, or None."""


# --------------------------------------------------------------------------- the client


class Remote:
    """One run's client of the remote cache; after a network failure it stays off for the run."""

    def __init__(self, url: str, *, write: bool, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.write = write
        self.timeout = timeout
        self.store: Store = open_store(self.url, timeout=timeout)
        self._off = False
        self._lock = threading.Lock()
        self._present: set[str] = set()  # action keys known to be on the remote in this run

    def __repr__(self) -> str:
        return f"Remote({self.url!r}, write={self.write})"

    # -- reading

    def restore(self, cache: Cache, package: str, key: str, distribution: str = "") -> WheelEntry | None:
        """The wheel for ``key`` from the remote, verified and put into ``cache``; None: build locally.

        ``distribution`` (the package's wheel project name) must be the restored wheel's, by the record's
        file name and by the wheel's own METADATA: a record pointing at another package's valid blob is refused.
        """
        if self._off:
            return None
        try:
            raw = self.store.get(f"ac/{key}")
            if raw is None:
                print(f"remote: no entry for {package} (key {key[:12]}) on {self.url}", flush=True)
                return None
            record = check_record(raw, key)
            if isinstance(record, str):
                warn(f"remote entry {self.url}/ac/{key} for {package} rejected: {record}; building locally")
                return None
            found = wheel_project(record["filename"])
            if distribution and found != canonicalize_name(distribution):
                warn(
                    f"remote entry {self.url}/ac/{key} for {package} rejected: its wheel {record['filename']} is "
                    f"of {found!r}, not {distribution!r}; building locally"
                )
                return None
            with cache.staging(f"remote-{package}") as tmp:
                path = tmp / record["filename"]
                problem = self._download(f"cas/{record['sha256']}", path, record["size"], record["sha256"])
                if problem is None:
                    # The record's file name is the server's word; the wheel's own METADATA says what it is.
                    problem = wheel_problem(path, distribution or found)
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
        with self._lock:
            self._present.add(key)
        print(f"restored {package} from remote {self.url} (sha256:{entry.sha256[:16]}…): {entry.path.name}", flush=True)
        return entry

    def _download(self, path: str, dest: Path, size: int, sha256: str) -> str | None:
        """Fetch a blob into ``dest``; the problem with it, or None when it has the size and sha256 expected."""
        problem = self.store.download(path, dest, size)
        if problem is not None:
            return problem
        got, digest = _measure(dest)
        if got != size:
            return f"{got} bytes, but the record states {size}"
        if digest != sha256:
            return f"sha256 {digest}, but the record states {sha256}"
        return None

    def lookup(self, key: str) -> int | None:
        """The size in bytes of the wheel the remote holds for ``key`` by a well-formed record of that key;
        None when it holds none (or does not answer: then it stays off for the run). Downloads nothing else."""
        if self._off:
            return None
        try:
            raw = self.store.get(f"ac/{key}")
        except RemoteUnavailable as exc:
            self._give_up(str(exc))
            return None
        record = check_record(raw, key) if raw is not None else None
        return record["size"] if isinstance(record, dict) else None

    def size_of(self, path: str) -> int | None:
        """The size of the object ``path`` on the remote (``ccache/…``: the object cache's entries, which
        `doit plan` counts); None when it holds none or does not answer (then it stays off for the run)."""
        if self._off:
            return None
        try:
            return self.store.size(path)
        except RemoteUnavailable as exc:
            self._give_up(str(exc))
            return None

    def history(self, package: str) -> list[Earlier]:
        """The builds of ``package`` whose records this remote's history of it names (each key document
        checked against its key); empty when it has none or does not answer."""
        from tasks.store.history import Earlier

        if self._off:
            return []
        try:
            raw = self.store.get(f"ac/{history_key(package)}")
        except RemoteUnavailable as exc:
            self._give_up(str(exc))
            return []
        entries, ignored = _history(raw, package)
        if ignored:
            what = "entry" if ignored == 1 else "entries"
            warn(
                f"remote {self.url}/ac/{history_key(package)}: {ignored} malformed {what} of {package}'s history "
                "ignored (a field of another type, a time that is no date)"
            )
        return [Earlier(e["key"], e["key_document"], e["time"], "remote") for e in entries]

    # -- writing

    def upload(
        self, entry: WheelEntry, package: str, key_document: dict[str, Any], *, if_missing: bool = False
    ) -> None:
        """Put a wheel on the remote: the blob first (unless it is there), then the record that points at it.

        ``if_missing``: only when the remote has no record for the key yet (a
        wheel from the local cache, which an earlier run may have uploaded).
        """
        if not self.write or self._off or (if_missing and entry.key in self._present):
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
            if if_missing and self.store.size(f"ac/{entry.key}") is not None:
                with self._lock:
                    self._present.add(entry.key)
                return
            blob_there = self.store.size(f"cas/{entry.sha256}") == entry.size
            if not blob_there:
                self.store.put(f"cas/{entry.sha256}", entry.path)
            self.store.put(f"ac/{entry.key}", canonical_json(record))
        except RemoteUnavailable as exc:
            self._give_up(str(exc))
            return
        self._add_history(package, entry.key, key_document)
        with self._lock:
            self._present.add(entry.key)
        what = "its record (the blob was there)" if blob_there else "blob and record"
        print(f"uploaded {package} to remote {self.url} (key {entry.key[:12]}; {what})", flush=True)

    def _add_history(self, package: str, key: str, key_document: dict[str, Any]) -> None:
        """Put ``key`` first in the package's history record (read, then written: two writers at once may
        lose one entry, which only makes `doit plan` compare with an older build)."""
        path = f"ac/{history_key(package)}"
        try:
            known = read_history(self.store.get(path), package)
            entry = {"key": key, "time": time.time(), "key_document": key_document}
            builds = [entry, *(e for e in known if e["key"] != key)][:HISTORY]
            self.store.put(path, canonical_json({"package": package, "history": builds}))
        except RemoteUnavailable as exc:
            self._give_up(str(exc))

    def _give_up(self, problem: str) -> None:
        with self._lock:
            first = not self._off
            self._off = True
        if first:
            warn(f"remote cache {self.url} unavailable ({problem}); not consulted again in this run, building locally")


def _measure(path: Path) -> tuple[int, str]:
    digest, got = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            got += len(chunk)
            digest.update(chunk)
    return got, digest.hexdigest()


def _receive(chunks: Iterable[bytes], dest: Path, limit: int) -> str | None:
    """Write ``chunks`` into ``dest``; stops with the problem when more than ``limit`` bytes come."""
    got = 0
    with open(dest, "wb") as fh:
        for chunk in chunks:
            got += len(chunk)
            if got > limit:
                return f"larger than the {limit} bytes the record states"
            fh.write(chunk)
    return None


def open_store(url: str, *, timeout: float) -> Store:
    """The store behind a ``remote=`` URL (checked by :func:`check_url` first)."""
    if url.startswith("s3://"):
        location = parse_s3_url(url)
        assert not isinstance(location, str), location
        return S3Store(location, timeout=timeout)
    return HttpStore(url, timeout=timeout)


# --------------------------------------------------------------------------- HTTP


class HttpStore:
    """A Bazel HTTP remote cache: GET, HEAD and PUT under ``url``.

    Each request is tried :data:`TRIES` times (a connection error, a timeout, HTTP 5xx) with
    :data:`BACKOFF_S` between tries, by the session's urllib3 ``Retry`` (tasks/core/net.py), and without
    proxies from the environment (the remote is named explicitly).
    """

    def __init__(self, url: str, *, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._lock = threading.Lock()
        self._session: requests.Session | None = None

    def get(self, path: str) -> bytes | None:
        resp = self._request("GET", path)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise RemoteUnavailable(f"GET {self.url}/{path}: HTTP {resp.status_code}")
        return resp.content

    def size(self, path: str) -> int | None:
        resp = self._request("HEAD", path)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise RemoteUnavailable(f"HEAD {self.url}/{path}: HTTP {resp.status_code}")
        length = resp.headers.get("Content-Length", "")
        return int(length) if length.isdigit() else -1

    def put(self, path: str, source: Path | bytes) -> None:
        data = source.read_bytes() if isinstance(source, Path) else source
        resp = self._request("PUT", path, data)
        if resp.status_code not in (200, 201, 204):
            raise RemoteUnavailable(f"PUT {self.url}/{path}: HTTP {resp.status_code}")

    def download(self, path: str, dest: Path, limit: int) -> str | None:
        try:
            with self._http().get(f"{self.url}/{path}", timeout=self.timeout, stream=True) as resp:
                if resp.status_code == 404:
                    return "missing on the server"
                if resp.status_code >= 500:  # still, after the tries
                    raise RemoteUnavailable(f"GET {self.url}/{path}: HTTP {resp.status_code}")
                if resp.status_code != 200:
                    return f"HTTP {resp.status_code}"
                return _receive(resp.iter_content(CHUNK), dest, limit)
        except OSError as exc:  # requests' errors are OSErrors
            raise RemoteUnavailable(f"GET {self.url}/{path}: {exc}") from None

    def _request(self, method: str, path: str, data: bytes | None = None) -> requests.Response:
        """One request, tried as the session tries it; its last answer (a 5xx too), or RemoteUnavailable."""
        try:
            return self._http().request(method, f"{self.url}/{path}", data=data, timeout=self.timeout)
        except OSError as exc:  # requests' errors are OSErrors
            raise RemoteUnavailable(f"{method} {self.url}/{path}: {exc}") from None

    def _http(self) -> requests.Session:
        with self._lock:
            if self._session is None:
                self._session = net.session(trust_env=False, tries=TRIES, backoff_s=BACKOFF_S)
            return self._session


# --------------------------------------------------------------------------- S3


class S3Store:
    """Objects in an S3 bucket (or an S3-compatible server), through boto3.

    Endpoint, region and credentials come from boto3's own configuration:
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_REGION``,
    ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` and the
    files under ``~/.aws``. Without any credentials reads are anonymous (a
    public bucket). botocore retries each request (``standard`` mode,
    :data:`TRIES` attempts in all) with ``timeout`` to connect and to read.
    """

    def __init__(self, location: S3Location, *, timeout: float) -> None:
        self.location = location
        self.url = str(location)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._client: Any = None

    def get(self, path: str) -> bytes | None:
        try:
            body = self._call("GetObject", path)
            if body is None:
                return None
            data: bytes = body["Body"].read()
            return data
        except self._stream_errors() as exc:
            raise RemoteUnavailable(f"GET {self.url}/{path}: {exc}") from None

    def size(self, path: str) -> int | None:
        head = self._call("HeadObject", path)
        return None if head is None else int(head["ContentLength"])

    def put(self, path: str, source: Path | bytes) -> None:
        if isinstance(source, Path):
            with open(source, "rb") as fh:
                self._call("PutObject", path, Body=fh)
        else:
            self._call("PutObject", path, Body=source)

    def download(self, path: str, dest: Path, limit: int) -> str | None:
        resp = self._call("GetObject", path)
        if resp is None:
            return "missing on the server"
        from botocore.exceptions import FlexibleChecksumError

        try:
            return _receive(resp["Body"].iter_chunks(CHUNK), dest, limit)
        except FlexibleChecksumError as exc:  # the server's own checksum of the object does not match its bytes
            return str(exc)
        except self._stream_errors() as exc:
            raise RemoteUnavailable(f"GET {self.url}/{path}: {exc}") from None
        finally:
            resp["Body"].close()

    def _call(self, operation: str, path: str, **params: Any) -> Any:
        """One S3 request on ``path``'s key; None when the object does not exist."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            client = self._s3()
            method = {"GetObject": client.get_object, "HeadObject": client.head_object, "PutObject": client.put_object}
            return method[operation](Bucket=self.location.bucket, Key=self.location.key(path), **params)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                return None
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
            message = error.get("Message") or "no message"
            raise RemoteUnavailable(
                f"{operation} {self.url}/{path}: {code or 'error'} (HTTP {status}): {message}"
            ) from None
        except BotoCoreError as exc:  # connection refused, timeouts, an unknown profile, ...
            raise RemoteUnavailable(f"{operation} {self.url}/{path}: {exc}") from None
        except ValueError as exc:  # botocore's word for a malformed endpoint URL
            raise RemoteUnavailable(f"{operation} {self.url}/{path}: S3 client settings: {exc}") from None

    def _stream_errors(self) -> tuple[type[Exception], ...]:
        from botocore.exceptions import BotoCoreError
        from urllib3.exceptions import HTTPError

        return (BotoCoreError, HTTPError, OSError)

    def _s3(self) -> Any:
        import boto3  # imported on use: keeps `doit list` fast
        from botocore import UNSIGNED
        from botocore.config import Config

        with self._lock:
            if self._client is None:
                session = boto3.session.Session()
                config = Config(
                    connect_timeout=self.timeout,
                    read_timeout=self.timeout,
                    retries={"mode": "standard", "max_attempts": TRIES},
                )
                anonymous = session.get_credentials() is None
                if anonymous:
                    config = config.merge(Config(signature_version=UNSIGNED))
                self._client = session.client("s3", config=config)
                if anonymous:
                    print(f"remote {self.url}: no AWS credentials found, reading anonymously", flush=True)
            return self._client


# --------------------------------------------------------------------------- records and shards


def check_record(raw: bytes, key: str) -> dict[str, Any] | str:
    """The ``ac/`` record for ``key`` if it is well formed and names this key; else what is wrong with it."""
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        return f"not JSON ({exc.__class__.__name__})"
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
    if not isinstance(doc, dict) or _hashes_to(doc) != key:
        return "its key document does not hash to the action key"
    return record


def history_key(package: str) -> str:
    """Where the remote keeps ``package``'s history under ``ac/``: a sha256 no action key has."""
    return hashlib.sha256(f"reprostack-history:{package}".encode()).hexdigest()


def read_history(raw: bytes | None, package: str) -> list[dict[str, Any]]:
    """The entries of a history record of ``package`` whose key document hashes to their key and whose time is
    a date (tasks/store/history.py's ``date``: not NaN, not 1e20)."""
    return _history(raw, package)[0]


def _history(raw: bytes | None, package: str) -> tuple[list[dict[str, Any]], int]:
    """:func:`read_history`'s entries, and how many others the record holds (malformed: ignored)."""
    from tasks.store.history import date

    try:
        doc = json.loads(raw) if raw is not None else {}
    except (ValueError, RecursionError):
        return [], 1
    if not isinstance(doc, dict) or doc.get("package") != package or not isinstance(doc.get("history"), list):
        return [], 0 if raw is None else 1
    out = []
    for e in doc["history"]:
        if not isinstance(e, dict) or not isinstance(e.get("key_document"), dict) or not isinstance(e.get("key"), str):
            continue
        when = date(e.get("time"))
        if when is not None and _hashes_to(e["key_document"]) == e["key"]:
            out.append({**e, "time": when})
    return out, len(doc["history"]) - len(out)


def _hashes_to(doc: dict[str, Any]) -> str:
    """The action key of ``doc``; "" for one that has none (a lone surrogate, nesting past the parser's)."""
    try:
        return action_key(doc)
    except (ValueError, RecursionError):
        return ""
