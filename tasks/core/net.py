"""The one way this project speaks HTTP: one timeout rule, one session factory, one download.

Every HTTP request of tasks/ goes through a session from :func:`session` (``tests/unit/test_one_way_out.py``
fails on a ``requests.get``, ``requests.Session()`` or ``urllib.request.urlopen`` anywhere else; the
files that run elsewhere with the standard library alone are exempt). boto3 (the S3 store of
tasks/store/remote.py) keeps its own client, with the same timeout and number of tries.

Timeout: :func:`timeout`, ``REPRO_NET_TIMEOUT`` seconds (default 60), for a connection to open and for a
transfer to go without data: the package index and downloads (tasks/lock/pypi.py, :func:`download`), the
image registry (tasks/cli/oci.py), git (tasks/lock/git.py) and pip (tasks/env/closure.py). The remote wheel
cache alone has its own, ``remote_timeout`` (tasks/core/settings.py, default 10 s): a cache that does not
answer must cost seconds, not minutes, since the build goes on locally without it.

Proxies (requests' ``trust_env``: ``HTTP(S)_PROXY``/``NO_PROXY``, ``.netrc``, ``REQUESTS_CA_BUNDLE``):

- the package index and downloads: honoured, as pip honours them for the same index;
- the image registry: honoured, as docker would use them;
- the remote cache (HTTP): ignored; it is named explicitly (``remote=URL``), mostly a host of the site
  that a proxy for the outside world must not see.

Retries: the remote cache's HTTP requests are tried 3 times (a connection error, a timeout, HTTP 5xx),
0.5 s then 1 s apart (``TRIES`` and ``BACKOFF_S`` of tasks/store/remote.py), by urllib3's ``Retry`` mounted on
the session; every other request is tried once, and its error says what failed.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from tasks.core import proc
from tasks.core.errors import FetchError, unreachable

if TYPE_CHECKING:
    import requests

#: Seconds without data before a network operation gives up, when REPRO_NET_TIMEOUT is not set.
DEFAULT_TIMEOUT_S = 60.0


def timeout() -> float:
    """Seconds a connection may take to open and a transfer may go without data (``REPRO_NET_TIMEOUT``)."""
    return float(os.environ.get("REPRO_NET_TIMEOUT") or DEFAULT_TIMEOUT_S)


def session(*, trust_env: bool, tries: int = 1, backoff_s: Sequence[float] = ()) -> requests.Session:
    """A ``requests.Session`` following the proxy policy above (``trust_env``).

    ``tries`` > 1: a request whose connection fails, times out or answers HTTP 5xx is sent again, up to
    ``tries`` times in all, waiting ``backoff_s[i]`` (the last one repeated) before try ``i + 2``; the
    last 5xx answer is returned, not raised. An error in the middle of a streamed body is not retried.
    Every request still names its timeout (:func:`timeout`, or the remote's own).
    """
    import requests  # imported on use: keeps `doit` start-up fast
    from requests.adapters import HTTPAdapter

    s = requests.Session()
    s.trust_env = trust_env
    if tries > 1:
        adapter = HTTPAdapter(max_retries=_retry(tries, tuple(backoff_s)))
        s.mount("http://", adapter)
        s.mount("https://", adapter)
    return s


def _retry(tries: int, backoff_s: tuple[float, ...]) -> Any:
    from urllib3.util.retry import Retry

    class _Retry(Retry):  # urllib3's, with a fixed series of waits
        def get_backoff_time(self) -> float:
            if not backoff_s or not self.history:
                return 0.0
            return backoff_s[min(len(self.history) - 1, len(backoff_s) - 1)]

    return _Retry(
        total=tries - 1,
        connect=tries - 1,
        read=tries - 1,
        status=tries - 1,
        redirect=0,
        allowed_methods=None,  # every method, PUT too: the remote's writes are idempotent
        status_forcelist=range(500, 600),
        raise_on_status=False,
        raise_on_redirect=False,
        respect_retry_after_header=False,  # bounded time: the waits above, never the server's
    )


def download(url: str, dest: Path) -> None:
    """Download ``url`` (http(s) or file) to ``dest``.

    Stops at a stop signal (tasks/core/proc.py): the handler shuts the connection's socket, so a read
    blocked on a server that trickles or stalls returns at once, and :class:`Interrupted` is raised;
    the caller's temporary directory then goes with it.
    """
    what = f"download of {url}"
    parsed = urlparse(url)
    try:
        if parsed.scheme == "file" or not parsed.scheme:
            src = Path(url2pathname(parsed.path)) if parsed.scheme else Path(url)
            with proc.in_process(what), src.open("rb") as fh, dest.open("wb") as out:
                while chunk := fh.read(1 << 20):
                    proc.check_interrupted(what)
                    out.write(chunk)
            return
        connection: list[socket.socket] = []  # a duplicate of the body's socket, for the handler to shut

        def stop() -> None:
            for c in connection:
                c.shutdown(socket.SHUT_RDWR)

        try:
            with proc.in_process(what, stop=stop), session(trust_env=True) as http:
                with http.get(url, stream=True, timeout=timeout()) as resp:
                    connection.extend(_socket_of(resp))
                    resp.raise_for_status()
                    with dest.open("wb") as out:
                        for chunk in resp.iter_content(1 << 16):
                            proc.check_interrupted(what)
                            out.write(chunk)
                    proc.check_interrupted(what)  # a shut socket may end the body early, without an error
        finally:
            for c in connection:
                c.close()
    except OSError as exc:  # requests.RequestException is an OSError
        proc.check_interrupted(what)  # the error is the shut socket's
        import requests

        if not isinstance(exc, requests.RequestException) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise  # this host's file system (a full disk, a read-only cache): the run's one line names it
        raise unreachable(url, str(exc)) or FetchError(f"download of {url} failed: {exc}") from None


def _socket_of(resp: Any) -> list[socket.socket]:
    """A duplicate of the socket a streamed response's body comes from (none where it cannot be had).

    Shutting it down (from the interrupt handler, in another thread) ends the body at once, also a
    read blocked on a server that trickles or stalls, and also over TLS; being our own descriptor, it
    is never another file's, whenever the handler comes.
    """
    try:
        return [socket.socket(fileno=os.dup(resp.raw.fileno()))]
    except (OSError, ValueError, AttributeError):
        return []
