"""Find the files of PyPI-kind sources through the index the user's pip uses (tasks/core/net.py downloads them).

The index is pip's own configuration (``PIP_INDEX_URL`` / ``PIP_EXTRA_INDEX_URL``
or ``pip config``), so a site mirror or proxy configured for pip is honoured.
Pages are read in the PEP 503 (HTML) form, which every index serves.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse
from urllib.request import url2pathname

from packaging.utils import canonicalize_name

from tasks.core import net, proc
from tasks.core.errors import FetchError, unreachable

DEFAULT_INDEX = "https://pypi.org/simple/"


@dataclass(frozen=True)
class Link:
    filename: str
    url: str
    sha256: str


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            for key, value in attrs:
                if key == "href" and value:
                    self.hrefs.append(value)


def parse_simple_page(html: str, base_url: str) -> list[Link]:
    """Links of a PEP 503 project page, with the sha256 from the URL fragment when given."""
    parser = _Anchors()
    parser.feed(html)
    links = []
    for href in parser.hrefs:
        url = urljoin(base_url, href)
        path, _, fragment = url.partition("#")
        sha = fragment[len("sha256=") :] if fragment.startswith("sha256=") else ""
        links.append(Link(filename=unquote(path.rsplit("/", 1)[-1]), url=path, sha256=sha))
    return links


def pip_indexes() -> list[str]:
    """The index URLs pip is configured with, main index first (asked of pip once per configuration)."""
    settings = tuple(os.environ.get(k, "") for k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONFIG_FILE"))
    if settings not in _INDEXES:
        _INDEXES[settings] = _pip_indexes()
    return list(_INDEXES[settings])


_INDEXES: dict[tuple[str, ...], list[str]] = {}


def _pip_indexes() -> list[str]:
    main = os.environ.get("PIP_INDEX_URL", "")
    extra = os.environ.get("PIP_EXTRA_INDEX_URL", "").split()
    # PIP_CONFIG_FILE=os.devnull: pip reads no configuration file, so its settings are the variables above.
    no_files = os.environ.get("PIP_CONFIG_FILE", "") == os.devnull
    if not no_files and (not main or not extra):
        try:
            res = proc.query(
                [sys.executable, "-m", "pip", "config", "list"],
                timeout=60,
                env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
            )
            for line in res.stdout.decode().splitlines():
                key, _, value = line.partition("=")
                value = value.strip().strip("'\"")
                if key.endswith(".index-url") and not main:
                    main = value
                elif key.endswith(".extra-index-url") and not os.environ.get("PIP_EXTRA_INDEX_URL"):
                    extra.extend(value.split())
        except (OSError, proc.TimeoutExpired):
            pass
    return [main or DEFAULT_INDEX, *extra]


def _read(url: str) -> bytes | None:
    parsed = urlparse(url)
    if parsed.scheme == "file":
        path = Path(url2pathname(parsed.path))
        if path.is_dir():
            path = path / "index.html"
        return path.read_bytes() if path.is_file() else None
    with net.session(trust_env=True) as http:
        resp = http.get(url, timeout=net.timeout(), headers={"Accept": "text/html"})
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    return resp.content


def find_file(project: str, filename: str, indexes: list[str] | None = None) -> Link:
    """Look ``filename`` of ``project`` up in the configured indexes."""
    tried = []
    no_route: list[FetchError] = []
    for index in indexes or pip_indexes():
        page = index.rstrip("/") + f"/{canonicalize_name(project)}/"
        tried.append(page)
        try:
            body = _read(page)
        except OSError as exc:  # requests' errors are OSErrors
            tried[-1] += f" ({exc.__class__.__name__})"
            no_route += filter(None, [unreachable(page, str(exc))])
            continue
        if body is None:
            continue
        for link in parse_simple_page(body.decode("utf-8", "replace"), page):
            if link.filename == filename:
                return link
    if no_route and len(no_route) == len(tried):
        raise no_route[0]  # not "not found": no index could be asked
    raise FetchError(f"{filename} of project {project} not found in the package index(es): {', '.join(tried)}")


def list_files(project: str, indexes: list[str] | None = None) -> list[Link]:
    """Every file of ``project`` in the first index that knows it."""
    for index in indexes or pip_indexes():
        page = index.rstrip("/") + f"/{canonicalize_name(project)}/"
        try:
            body = _read(page)
        except OSError:
            continue
        if body is not None:
            return parse_simple_page(body.decode("utf-8", "replace"), page)
    return []


@dataclass(frozen=True)
class ProjectFiles:
    """A project's files over every configured index, as pip sees them (merged by file name)."""

    links: list[Link]
    pages: list[str]  # the project pages asked, in index order
    found: list[str]  # those that know the project


def project_files(project: str, indexes: list[str] | None = None) -> ProjectFiles:
    """Every file of ``project`` on every configured index (pip merges the indexes too).

    A file name listed by two indexes with different sha256s is an error, and
    so is an index that cannot be read: either would leave a partial view.
    """
    pages: list[str] = []
    found: list[str] = []
    by_name: dict[str, Link] = {}
    for index in indexes or pip_indexes():
        page = index.rstrip("/") + f"/{canonicalize_name(project)}/"
        pages.append(page)
        try:
            body = _read(page)
        except OSError as exc:  # requests' errors are OSErrors
            raise unreachable(page, str(exc)) or FetchError(
                f"cannot read {page} ({exc.__class__.__name__}: {exc}); retry when it answers"
            ) from None
        if body is None:
            continue
        found.append(page)
        for link in parse_simple_page(body.decode("utf-8", "replace"), page):
            seen = by_name.get(link.filename)
            if seen is None or (link.sha256 and not seen.sha256):
                by_name[link.filename] = link
            elif link.sha256 and link.sha256 != seen.sha256:
                raise FetchError(
                    f"{link.filename}: the package indexes disagree on its sha256 ({seen.url} has {seen.sha256}, "
                    f"{link.url} has {link.sha256}); fix or drop one of them in pip's configuration"
                )
    return ProjectFiles(links=list(by_name.values()), pages=pages, found=found)
