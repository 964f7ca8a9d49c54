"""Git sources: fetch a pinned commit into a cached bare repository and export its tree.

The tree is exported blob by blob (``git ls-tree`` + ``git cat-file --batch``)
rather than with ``git archive`` or a checkout, so no attribute, filter or
line-ending conversion of the repository can change the bytes.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

from tasks.core import members, net, proc, procfs
from tasks.core.errors import FetchError, LockError, VerificationError, unreachable
from tasks.core.treehash import FileFilter


@dataclass(frozen=True)
class TreeItem:
    mode: str
    type: str
    sha: str
    path: str


def git_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(GIT_TERMINAL_PROMPT="0", GIT_ASKPASS="true", LC_ALL="C")
    # A server that accepts the connection and then stops sending: git gives up after net.timeout() s
    # without data (curl's low-speed limit), as HTTP downloads do (tasks/core/net.py).
    env.update(GIT_HTTP_LOW_SPEED_LIMIT="1", GIT_HTTP_LOW_SPEED_TIME=str(max(1, round(net.timeout()))))
    return env


#: The most a git command may take in all, however it goes (a safety net behind the stall bounds).
GIT_DEADLINE = 3 * 3600.0
_STALLED = re.compile(r"Operation too slow|Operation timed out|Connection timed out|timed out after")


def _stalled(log: Path) -> bool:
    return bool(_STALLED.search(proc.tail(log, 20)))


def url_hash(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:24]


#: How this module runs a short git command (:func:`tasks.core.proc.query`'s signature); tests pass their own
#: to see what git is asked and give its answer (tests/unit/test_git.py).
Runner = proc.Query


def _git(repo: Path, *args: str, what: str = "", input: bytes | None = None, runner: Runner = proc.query) -> bytes:
    return runner(
        ["git", "--git-dir", str(repo), *args],
        env=git_env(),
        error=FetchError,
        what=what,
        input=input,
    ).stdout


def _has_commit(repo: Path, commit: str) -> bool:
    res = proc.query(["git", "--git-dir", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"], env=git_env())
    return res.returncode == 0


class _StallWatch:
    """Stops a git command whose process group reads no byte and uses no CPU for ``limit`` seconds.

    curl's low-speed limit bounds http(s) only; git://, ssh:// and scp-style URLs have no such setting,
    and a server that accepts the connection and then sends nothing leaves git (or its ssh) blocked in
    read() for good. Every process of the command's group is watched (git, ssh, index-pack,
    git-remote-http): bytes read (``rchar`` of /proc/PID/io, sockets and pipes included), CPU time
    (index-pack resolving deltas reads its pack through mmap) and the log's size. When none of them
    moves for ``limit`` seconds the group gets SIGTERM (git removes its lock files), then SIGKILL.
    """

    def __init__(self, log: Path, limit: float) -> None:
        self.log = log
        self.limit = limit
        self.fired = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, pgid: int) -> None:
        self._thread = threading.Thread(target=self._watch, args=(pgid,), daemon=True, name=f"git-watch-{pgid}")
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self, pgid: int) -> None:
        last: object = None
        since = time.monotonic()
        while not self._done.wait(min(1.0, self.limit / 4)):
            now = _activity(pgid, self.log)
            if now is None:  # the group has ended
                return
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= self.limit:
                self.fired = True
                procfs.stop(lambda: [p.pid for p in _group(pgid)], grace=2.0)  # TERM: git removes its locks
                return


def _group(pgid: int) -> list[procfs.Process]:
    """The live processes of group ``pgid``."""
    return [p for p in procfs.processes() if p.pgid == pgid and p.state != "Z"]


def _activity(pgid: int, log: Path) -> tuple[object, ...] | None:
    """What changes while group ``pgid`` makes progress (see :class:`_StallWatch`); None when it has ended."""
    members = _group(pgid)
    if not members:
        return None
    seen: list[object] = []
    for p in members:
        rchar = -1
        try:
            with open(f"/proc/{p.pid}/io") as fh:
                rchar = next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))
        except (OSError, StopIteration, ValueError):
            pass  # gone meanwhile, or no I/O accounting: CPU time and the log still count
        seen.append((p.pid, rchar, p.cpu_ticks))
    try:
        seen.append(log.stat().st_size)
    except OSError:
        pass
    return tuple(seen)


class _Stalled(FetchError):
    """A ``git fetch`` that received nothing for REPRO_NET_TIMEOUT seconds and was stopped."""


def _fetch(repo: Path, url: str, args: list[str], log: Path, what: str) -> None:
    """``git fetch --no-tags ARGS`` from ``url``, bounded in time on every transport (:class:`_Stalled`)."""
    watch = _StallWatch(log, net.timeout())
    try:
        proc.run(
            ["git", "--git-dir", str(repo), "fetch", "--no-tags", *args],
            env=git_env(),
            log=log,
            error=FetchError,
            what=what,
            on_start=watch.start,
            timeout=GIT_DEADLINE,
        )
    except FetchError:
        if watch.fired or _stalled(log):
            raise _Stalled(
                f"git fetch {url}: the server stopped sending: no data for {net.timeout():g} s (REPRO_NET_TIMEOUT); "
                f"git was stopped. Check the URL and your network, raise REPRO_NET_TIMEOUT for a slow link, "
                f"or use mirror=DIR. Full log: {log}"
            ) from None
        raise
    finally:
        watch.stop()


def ensure_commit(repo: Path, url: str, commit: str, log: Path) -> None:
    """Make ``commit`` of ``url`` present in the bare repository ``repo``.

    Each ``git fetch`` gives up after REPRO_NET_TIMEOUT seconds without data, on every transport
    (:class:`_StallWatch`; curl's low-speed limit too for http(s)), and after GIT_DEADLINE in all.
    """
    if not repo.exists():
        repo.parent.mkdir(parents=True, exist_ok=True)
        proc.query(["git", "init", "--bare", "-q", str(repo)], env=git_env(), error=FetchError)
    if _has_commit(repo, commit):
        return
    try:
        # Servers that allow fetching by commit (GitHub does) send only what is needed.
        _fetch(repo, url, ["--depth=1", url, commit], log, what=f"git fetch {url} {commit}")
    except _Stalled:
        raise
    except FetchError:
        no_route = unreachable(url, proc.tail(log, 20))
        if no_route:
            raise no_route from None
        # Dumb-HTTP and restrictive servers: fetch every branch and tag instead.
        refspecs = ["+refs/heads/*:refs/remotes/src/*", "+refs/tags/*:refs/tags/*"]
        _fetch(repo, url, [url, *refspecs], log, what=f"git fetch {url}")
    if not _has_commit(repo, commit):
        raise FetchError(f"{url}: commit {commit} not found on the server (is the pin right? was history rewritten?)")


def resolve_ref(url: str, ref: str, *, runner: Runner = proc.query) -> str:
    """The commit a tag or branch of ``url`` points at (``git ls-remote``): an annotated tag's commit, else
    the tag's, else the branch's; a :class:`LockError` where the ref names nothing, or several commits."""
    out = runner(
        ["git", "ls-remote", url, ref, f"{ref}^{{}}"],
        env=git_env(),
        error=LockError,
        what=f"git ls-remote {url}",
        timeout=net.timeout() * 2,
    ).stdout.decode()
    refs: dict[str, str] = {}
    for line in out.splitlines():
        sha, _, name = line.partition("\t")
        refs[name] = sha
    for name in (f"refs/tags/{ref}^{{}}", f"refs/tags/{ref}", f"refs/heads/{ref}", ref):
        if name in refs:
            return refs[name]
    if len(set(refs.values())) == 1:
        return next(iter(refs.values()))
    raise LockError(f"{url}: ref {ref!r} not found (no such tag or branch)")


def list_tree(repo: Path, commit: str, *, runner: Runner = proc.query) -> list[TreeItem]:
    out = _git(repo, "ls-tree", "-r", "-z", "--full-tree", commit, what=f"git ls-tree {commit}", runner=runner)
    items = []
    for rec in out.split(b"\0"):
        if not rec:
            continue
        meta, _, path = rec.partition(b"\t")
        mode, typ, sha = meta.decode().split()
        items.append(TreeItem(mode, typ, sha, path.decode("utf-8", "surrogateescape")))
    return items


def gitlinks(repo: Path, commit: str) -> dict[str, str]:
    """Submodule paths of ``commit`` and the commits they are pinned to."""
    return {i.path: i.sha for i in list_tree(repo, commit) if i.type == "commit"}


def submodule_urls(repo: Path, commit: str, super_url: str, *, runner: Runner = proc.query) -> dict[str, str]:
    """Submodule path -> absolute URL from ``.gitmodules`` at ``commit`` (a relative URL joined to ``super_url``)."""
    try:
        blob = _git(repo, "show", f"{commit}:.gitmodules", runner=runner)
    except FetchError:
        return {}
    out = runner(
        [
            "git",
            "config",
            "--file",
            "-",
            "--get-regexp",
            r"^submodule\..*\.(path|url)$",
        ],
        env=git_env(),
        error=FetchError,
        input=blob,
    ).stdout.decode()
    paths: dict[str, str] = {}
    urls: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        name, _, field = key[len("submodule.") :].rpartition(".")
        (paths if field == "path" else urls)[name] = value
    result = {}
    for name, path in paths.items():
        url = urls.get(name, "")
        if url.startswith(("./", "../")):
            base = super_url if super_url.endswith("/") else super_url + "/"
            url = urljoin(base, url) if "://" in base else os.path.normpath(os.path.join(base, url))
        result[path] = url
    return result


def _read_blobs(repo: Path, shas: list[str]) -> list[bytes]:
    """The contents of the blobs ``shas`` (symlink targets: small), in order."""
    if not shas:
        return []
    out = _git(repo, "cat-file", "--batch", input="".join(f"{s}\n" for s in shas).encode(), what="git cat-file")
    found, pos = [], 0
    for _sha in shas:
        end = out.index(b"\n", pos)
        header = out[pos:end].split()
        if len(header) != 3 or header[1] != b"blob":
            raise FetchError(f"git cat-file: unexpected answer {header!r}")
        size = int(header[2])
        found.append(out[end + 1 : end + 1 + size])
        pos = end + 1 + size + 1
    return found


def _plan(
    repo: Path, commit: str, prefix: str, keep: FileFilter, submodules: Mapping[str, tuple[Path, str]] | None
) -> list[tuple[Path, TreeItem, str]]:
    """(repository, blob, path in the tree) of every blob to export, submodules' included."""
    planned = []
    for item in list_tree(repo, commit):
        full = f"{prefix}{item.path}"
        if item.type == "commit":
            if submodules and item.path in submodules:
                sub_repo, sub_commit = submodules[item.path]
                if sub_commit != item.sha:
                    raise VerificationError(
                        f"submodule {full}: the lock pins {sub_commit} but the superproject records {item.sha}; "
                        "run `doit lock` to update the pin"
                    )
                planned += _plan(sub_repo, sub_commit, f"{full}/", keep, None)
            continue
        if item.type == "blob" and keep.keeps(full):
            planned.append((repo, item, full))
    return planned


def export_tree(
    repo: Path,
    commit: str,
    dest: Path,
    *,
    keep: FileFilter,
    submodules: Mapping[str, tuple[Path, str]] | None = None,
) -> None:
    """Write the files of ``commit`` kept by ``keep`` under ``dest``.

    ``submodules`` maps a gitlink path to (bare repo, commit) to export in its
    place; the commit must equal the gitlink recorded in the superproject.
    Gitlinks not listed are left out.
    """
    planned = _plan(repo, commit, "", keep, submodules)
    if not planned:
        return
    # Check every path and link target before anything is written (tasks/core/members.py), the superproject's
    # and its submodules' together (a link in one may lead through a link in the other): a link out of the
    # tree (to a host file, say), directly or through a chain of the tree's own links, is refused here as
    # it is in archives.
    targets: dict[tuple[Path, str], str] = {}
    for source in dict.fromkeys(r for r, _item, _full in planned):
        shas = list(dict.fromkeys(i.sha for r, i, _full in planned if r == source and i.mode == "120000"))
        for sha, data in zip(shas, _read_blobs(source, shas), strict=True):
            targets[source, sha] = data.decode("utf-8", "surrogateescape")
    try:
        members.check(
            members.Member(
                name=full,
                kind=members.SYMLINK if item.mode == "120000" else members.FILE,
                target=targets.get((source, item.sha), ""),
            )
            for source, item, full in planned
        )
    except members.UnsafeMember as exc:
        raise VerificationError(f"git tree {commit}: refused, nothing of it was used: member {exc}") from None
    # Files first, streamed through one cat-file process per repository; links last, so nothing is
    # ever written through one.
    for source in dict.fromkeys(r for r, _item, _full in planned):
        _write_blobs(
            source, [(item, dest / full) for r, item, full in planned if r == source and item.mode != "120000"]
        )
    for source, item, full in planned:
        if item.mode == "120000":
            target = dest / full
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(targets[source, item.sha], target)


def _write_blobs(repo: Path, blobs: list[tuple[TreeItem, Path]]) -> None:
    """Write each blob of ``repo`` to its path (644, or 755 for an executable), through one ``git cat-file``."""
    if not blobs:
        return
    with proc.stream(["git", "--git-dir", str(repo), "cat-file", "--batch"], env=git_env()) as (ask, answer):
        for item, target in blobs:
            ask.write(item.sha.encode() + b"\n")
            ask.flush()
            header = answer.readline().split()
            if len(header) != 3 or header[1] != b"blob":
                raise FetchError(f"git cat-file: unexpected answer {header!r} for {item.path}")
            data = answer.read(int(header[2]))
            answer.read(1)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            os.chmod(target, 0o755 if item.mode == "100755" else 0o644)
