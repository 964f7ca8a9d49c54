"""Source kinds: one object per kind of upstream input, in one registry (spack's fetch strategies).

A kind holds everything that differs between a git repository, an archive URL, an sdist on the
package index and a wheel file: the keys its lock entry takes (``fields``) and the checks beyond
their types (``check``), its identifying pin (``pin``), whether `doit lock` has pinned it
(``complete``) and how (``lock``), how its tree is produced (``materialize``), what `doit mirror`
writes for it (``mirror_entry``), and how provenance and the SBOM describe it (``provenance``,
``sbom``). The rest of tasks/ asks :func:`of` for a source's kind and never compares kind names; an
unknown kind is a :class:`LockError`, never a default.

Layering: this module holds the model the kinds act on (:class:`Source`, :class:`Submodule`) and
imports the field checks (tasks/lock/schema.py) at the top; the transports (tasks/lock/git.py,
tasks/lock/pypi.py, tasks/core/net.py, tasks/core/archive.py, tomlkit for `doit lock`'s tables) are
imported inside the methods that fetch, so that parsing a lock (tasks/lock/lockfile.py, which validates
each ``[sources.NAME]`` with its kind's ``fields`` and ``check``) loads none of them. Callers of the
kinds' methods: tasks/lock/fetch.py, tasks/cli/lockcmd.py, tasks/stages/provenance.py,
tasks/stages/sbom.py, tasks/cli/graph.py.

Adding a kind: subclass :class:`TreeKind` (a tree packages build from; implement ``pin``,
``complete``, ``materialize`` and the descriptions, and ``_resolve``/``_pinned`` if `doit lock`
pins more than the tree hash) or :class:`SourceKind`, and add an instance to :data:`KINDS`. Its
values live in :class:`Source`'s fields (``url``, ``ref``, ``commit``, ``sha256``,
``filename``, ...): ``check`` returns the ones it derives from keys of its own. A kind kept outside
this repository is a plugin: ``REPRO_SOURCE_KINDS`` names modules (comma-separated, importable from
``sys.path``), each with a sequence ``SOURCE_KINDS`` of kind instances; they are imported once, when
the first lock is read, and may not replace a kind of this module.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar
from urllib.parse import unquote, urlparse

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from tasks.core.errors import FetchError, LockError, VerificationError
from tasks.core.fsutil import copy_atomic
from tasks.core.treehash import FileFilter, file_sha256, tree_sha256
from tasks.lock.schema import (
    Field,
    Problems,
    is_int,
    is_license,
    is_sha1,
    is_sha256,
    is_str,
    is_str_list,
    is_table,
    suggest,
)

if TYPE_CHECKING:
    from tasks.store.cache import Cache

#: The environment variable naming plugin modules of more kinds (see the module's docstring).
PLUGINS_VAR = "REPRO_SOURCE_KINDS"
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

#: Keys every kind whose source is a tree takes.
TREE_FIELDS = {
    "kind": Field(is_str, required=True),
    "tree_sha256": Field(is_sha256),
    "strip": Field(is_int),
    "include": Field(is_str_list),
    "exclude": Field(is_str_list),
    "license": Field(is_license),
}
SUBMODULE_FIELDS = {
    "url": Field(is_str, required=True),
    "commit": Field(is_sha1),
    "license": Field(is_license),
}


@dataclass(frozen=True, kw_only=True)
class Submodule:
    path: str
    url: str
    commit: str
    license: str = ""  # SPDX license id or expression, for the SBOM


@dataclass(frozen=True, kw_only=True)
class Source:
    """One pinned upstream input. ``tree_sha256`` covers the kept tree."""

    name: str
    kind: str
    url: str = ""
    ref: str = ""
    commit: str = ""
    submodules: tuple[Submodule, ...] = ()
    project: str = ""
    version: str = ""
    filename: str = ""
    sha256: str = ""
    tree_sha256: str = ""
    strip: int | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    license: str = ""  # SPDX license id or expression, for the SBOM

    def pin(self) -> dict[str, Any]:
        """The identifying fields of this source, for manifests and keys (its kind's, tasks/lock/kinds.py)."""
        return of(self.kind).pin(self)


@dataclass(frozen=True, kw_only=True)
class BomEntry:
    """What the SBOM says of a source (tasks/stages/sbom.py makes a CycloneDX component of it)."""

    name: str
    version: str
    ref: str
    license: str = ""
    sha256: str = ""
    purl_type: str = "generic"
    purl_name: str = ""
    purl_version: str | None = None
    purl_qualifiers: tuple[tuple[str, str], ...] = ()
    #: External references: ("vcs" | "distribution", url).
    links: tuple[tuple[str, str], ...] = ()
    swhid: str = ""
    #: Our properties, ``reprostack:<name>`` in the document.
    properties: tuple[tuple[str, str], ...] = ()
    parts: tuple[BomEntry, ...] = ()


def source_filter(src: Source) -> FileFilter:
    return FileFilter(include=src.include, exclude=src.exclude)


class SourceKind:
    """One kind of source. Subclasses set ``name`` and ``fields`` and implement the methods."""

    name: ClassVar[str] = ""
    #: The keys of its lock entry, with their checks (``kind`` among them).
    fields: ClassVar[Mapping[str, Field]] = {}
    #: The source is one wheel file used as is (a prebuilt package, a hermetic wheel), not a tree.
    wheel: ClassVar[bool] = False

    def check(self, where: str, entry: Mapping[str, Any], p: Problems) -> dict[str, Any]:
        """Add the problems of an entry whose keys passed ``fields`` (a pin `doit lock` fills in with
        ``p.unpinned``); return the :class:`Source` values the kind derives from its entry, if any."""
        return {}

    def pin(self, src: Source) -> dict[str, Any]:
        """The identifying fields of ``src``, for manifests and keys."""
        raise NotImplementedError

    def complete(self, src: Source) -> bool:
        """Whether `doit lock` has nothing left to pin."""
        raise NotImplementedError

    def lock(
        self, src: Source, *, cache: Cache, mirror: Path | None, log: Path, refresh: bool
    ) -> tuple[dict[str, Any], str]:
        """Pin ``src``: the keys to write into its lock entry, in order (a tomlkit table goes at the
        entry's end), and one line for `doit lock`'s report."""
        raise NotImplementedError

    def materialize(
        self, src: Source, work: Path, *, cache: Cache, mirror: Path | None, log: Path
    ) -> tuple[Path, dict[str, Any]]:
        """The kept tree of ``src`` under ``work`` (unverified) and its metadata (origin, archive sha256)."""
        raise LockError(f"source {src.name}: a source of kind {self.name!r} has no tree to build from")

    def mirror_entry(self, src: Source, *, cache: Cache, mirror: Path) -> str:
        """Copy the cached ``src`` into ``mirror``; return the file written, relative to it."""
        raise NotImplementedError

    def provenance(self, src: Source, path: str) -> list[dict[str, Any]]:
        """Resource descriptors of ``src`` (and its parts) placed at ``path`` in the build tree."""
        raise NotImplementedError

    def sbom(self, src: Source) -> BomEntry:
        raise NotImplementedError

    def _annotations(self, src: Source, path: str) -> dict[str, Any]:
        notes: dict[str, Any] = {"path": path, "tree_sha256": src.tree_sha256, "kind": src.kind}
        if src.license:
            notes["license"] = src.license
        return notes

    def __repr__(self) -> str:
        return f"<source kind {self.name!r}>"


class TreeKind(SourceKind):
    """A source that is a tree packages build from, pinned by the hash of the kept tree."""

    fields: ClassVar[Mapping[str, Field]] = TREE_FIELDS

    def lock(
        self, src: Source, *, cache: Cache, mirror: Path | None, log: Path, refresh: bool
    ) -> tuple[dict[str, Any], str]:
        src, edits = self._resolve(src, cache=cache, log=log, refresh=refresh)
        with cache.staging(f"lock-{src.name}") as work:
            root, meta = materialize(replace(src, tree_sha256=""), work, cache=cache, mirror=mirror, log=log)
            tree = tree_sha256(root)
        label, more = self._pinned(src, meta)
        edits |= more
        edits["tree_sha256"] = tree
        return edits, f"{src.name}: {label} tree {tree[:12]}"

    def _resolve(self, src: Source, *, cache: Cache, log: Path, refresh: bool) -> tuple[Source, dict[str, Any]]:
        """Before the tree is made: pins it is made from (a commit, a file name) and the keys to write."""
        return src, {}

    def _pinned(self, src: Source, meta: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """After: the report's short pin and the keys to write (an archive's sha256)."""
        return "", {}

    def mirror_entry(self, src: Source, *, cache: Cache, mirror: Path) -> str:
        from tasks.core.archive import pack_tree

        entry = cache.source_dir(src.tree_sha256)
        archive = entry / "archive"
        if archive.is_file() and src.sha256:
            dest = mirror / "archives" / src.sha256
            if not dest.is_file():
                copy_atomic(archive, dest)
            return f"archives/{src.sha256}"
        dest = mirror / "trees" / f"{src.tree_sha256}.tar.gz"
        if not dest.is_file():
            tmp = dest.with_name(f".{dest.name}.tmp")
            try:
                pack_tree(entry / "tree", tmp)
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)
        return f"trees/{src.tree_sha256}.tar.gz"


class Git(TreeKind):
    """A commit of a git repository (and of its submodules), fetched with tasks/lock/git.py."""

    name = "git"
    fields = TREE_FIELDS | {
        "url": Field(is_str, required=True),
        "ref": Field(is_str),
        "commit": Field(is_sha1),
        "submodules": Field(is_table),
    }

    def check(self, where: str, entry: Mapping[str, Any], p: Problems) -> dict[str, Any]:
        subs: list[Submodule] = []
        for sub_path, sub in entry.get("submodules", {}).items():
            sw = f"{where}.submodules.{sub_path}"
            if not isinstance(sub, dict):
                p.add(sw, "must be a table with url and commit")
                continue
            if p.check_table(sw, sub, SUBMODULE_FIELDS):
                if "commit" not in sub:
                    p.unpinned(sw, "missing 'commit' (run `doit lock` to take it from the superproject)")
                subs.append(
                    Submodule(
                        path=sub_path, url=sub["url"], commit=sub.get("commit", ""), license=sub.get("license", "")
                    )
                )
        if "commit" not in entry:
            if "ref" in entry:
                p.unpinned(where, f"missing 'commit' (run `doit lock` to resolve ref {entry['ref']!r})")
            else:
                p.add(where, "a git source needs 'commit', or a 'ref' (tag or branch) for `doit lock` to resolve")
        return {"submodules": tuple(sorted(subs, key=lambda s: s.path))}

    def pin(self, src: Source) -> dict[str, Any]:
        out: dict[str, Any] = {"name": src.name, "kind": src.kind, "tree_sha256": src.tree_sha256}
        out |= {"url": src.url, "commit": src.commit}
        if src.submodules:
            out["submodules"] = {s.path: s.commit for s in src.submodules}
        return out

    def complete(self, src: Source) -> bool:
        return bool(src.tree_sha256) and bool(src.commit) and all(s.commit for s in src.submodules)

    def _resolve(self, src: Source, *, cache: Cache, log: Path, refresh: bool) -> tuple[Source, dict[str, Any]]:
        import tomlkit

        from tasks.lock import git

        commit = src.commit
        if src.ref and (refresh or not commit):
            commit = git.resolve_ref(src.url, src.ref)
        repo = cache.git_dir(git.url_hash(src.url))
        with cache.lock(f"git-{git.url_hash(src.url)}"):
            git.ensure_commit(repo, src.url, commit, log)
        links = git.gitlinks(repo, commit)
        urls = git.submodule_urls(repo, commit, src.url)
        keep = source_filter(src)
        listed = {s.path: s for s in src.submodules}
        subs: list[Submodule] = []
        if listed:
            for path, sub in listed.items():
                if path not in links:
                    raise LockError(f"source {src.name}: submodule {path!r} is not a gitlink at {commit}")
                subs.append(replace(sub, commit=links[path]))
        else:
            # Every submodule whose files the filter can keep (a probe path stands for its files).
            for path, sha in sorted(links.items()):
                if keep.keeps(f"{path}/x") or keep.keeps(f"{path}/include/x.h"):
                    if not urls.get(path):
                        raise LockError(f"source {src.name}: submodule {path!r} has no URL in .gitmodules")
                    subs.append(Submodule(path=path, url=urls[path], commit=sha))
        edits: dict[str, Any] = {"commit": commit}
        if subs:
            table = tomlkit.table()
            for sub in subs:
                inner = tomlkit.inline_table()
                inner.update({"url": sub.url, "commit": sub.commit})
                if sub.license:
                    inner["license"] = sub.license
                table[sub.path] = inner
            edits["submodules"] = table
        return replace(src, commit=commit, submodules=tuple(subs)), edits

    def _pinned(self, src: Source, meta: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        return src.commit[:12], {}

    def materialize(
        self, src: Source, work: Path, *, cache: Cache, mirror: Path | None, log: Path
    ) -> tuple[Path, dict[str, Any]]:
        from tasks.lock import git

        root = work / "tree"
        root.mkdir()
        repo = cache.git_dir(git.url_hash(src.url))
        with cache.lock(f"git-{git.url_hash(src.url)}"):
            git.ensure_commit(repo, src.url, src.commit, log)
        subs: dict[str, tuple[Path, str]] = {}
        for sub in src.submodules:
            sub_repo = cache.git_dir(git.url_hash(sub.url))
            with cache.lock(f"git-{git.url_hash(sub.url)}"):
                git.ensure_commit(sub_repo, sub.url, sub.commit, log)
            subs[sub.path] = (sub_repo, sub.commit)
        git.export_tree(repo, src.commit, root, keep=source_filter(src), submodules=subs)
        return root, {"origin": src.url}

    def provenance(self, src: Source, path: str) -> list[dict[str, Any]]:
        first = {"uri": f"git+{src.url}@{src.commit}", "digest": {"gitCommit": src.commit}}
        out = [{"name": f"source:{src.name}", **first, "annotations": self._annotations(src, path)}]
        for sub in src.submodules:
            sub_notes: dict[str, Any] = {
                "path": f"{path}/{sub.path}" if path != "." else sub.path,
                "submodule_of": src.name,
            }
            if sub.license:
                sub_notes["license"] = sub.license
            out.append(
                {
                    "name": f"source:{src.name}/{sub.path}",
                    "uri": f"git+{sub.url}@{sub.commit}",
                    "digest": {"gitCommit": sub.commit},
                    "annotations": sub_notes,
                }
            )
        return out

    def sbom(self, src: Source) -> BomEntry:
        parts = tuple(
            _git_entry(f"{src.name}/{s.path}", s.url, s.commit, f"source:{src.name}/{s.path}", s.license)
            for s in src.submodules
        )
        entry = _git_entry(src.name, src.url, src.commit, f"source:{src.name}", src.license, parts)
        return replace(entry, properties=(("kind", src.kind), ("tree_sha256", src.tree_sha256)))


def _git_entry(name: str, url: str, commit: str, ref: str, license: str, parts: tuple[BomEntry, ...] = ()) -> BomEntry:
    return BomEntry(
        name=name,
        version=commit,
        ref=ref,
        license=license,
        purl_name=re.sub(r"[^A-Za-z0-9._-]", "-", name),
        purl_version=commit,
        purl_qualifiers=(("vcs_url", f"git+{url}@{commit}"),),
        links=(("vcs", url),),
        swhid=f"swh:1:rev:{commit}",
        parts=parts,
    )


class ArchiveKind(TreeKind):
    """A source archive (tar or zip), pinned by its sha256 and unpacked; subclasses say where it is."""

    def _download(self, src: Source, dest: Path) -> str:
        """Download the archive to ``dest``; return where it came from."""
        raise NotImplementedError

    def _resolve(self, src: Source, *, cache: Cache, log: Path, refresh: bool) -> tuple[Source, dict[str, Any]]:
        return (replace(src, sha256="") if refresh else src), {}

    def _pinned(self, src: Source, meta: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        digest = meta["archive_sha256"]
        return digest[:12], {"sha256": digest}

    def materialize(
        self, src: Source, work: Path, *, cache: Cache, mirror: Path | None, log: Path
    ) -> tuple[Path, dict[str, Any]]:
        from tasks.core import proc
        from tasks.core.archive import unpack

        meta: dict[str, Any] = {}
        archive = work / "archive"
        origin_archive = _mirror_archive(mirror, src)
        if origin_archive is not None:
            shutil.copyfile(origin_archive, archive)
            meta["origin"] = str(origin_archive)
        else:
            meta["origin"] = self._download(src, archive)
        digest = file_sha256(archive)
        meta["archive_sha256"] = digest
        if src.sha256 and digest != src.sha256:
            raise VerificationError(
                f"source {src.name}: archive from {meta['origin']} has sha256 {digest} "
                f"but the lock pins {src.sha256}; refusing to use it"
            )
        proc.check_interrupted(f"fetch of source {src.name}")
        root = unpack(archive, work / "unpack", strip=src.strip)
        source_filter(src).apply(root)
        return root, meta


class Url(ArchiveKind):
    """An archive by URL, downloaded with tasks/core/net.py's downloader."""

    name = "url"
    fields = TREE_FIELDS | {"url": Field(is_str, required=True), "sha256": Field(is_sha256)}

    def check(self, where: str, entry: Mapping[str, Any], p: Problems) -> dict[str, Any]:
        if "sha256" not in entry:
            p.unpinned(where, "missing 'sha256' of the archive (run `doit lock` to fill it in)")
        return {}

    def pin(self, src: Source) -> dict[str, Any]:
        return {
            "name": src.name,
            "kind": src.kind,
            "tree_sha256": src.tree_sha256,
            "url": src.url,
            "sha256": src.sha256,
        }

    def complete(self, src: Source) -> bool:
        return bool(src.tree_sha256) and bool(src.sha256)

    def _download(self, src: Source, dest: Path) -> str:
        from tasks.core import net

        net.download(src.url, dest)
        return src.url

    def provenance(self, src: Source, path: str) -> list[dict[str, Any]]:
        first = {"uri": src.url, "digest": {"sha256": src.sha256}}
        return [{"name": f"source:{src.name}", **first, "annotations": self._annotations(src, path)}]

    def sbom(self, src: Source) -> BomEntry:
        return _download_entry(src, (("kind", src.kind), ("tree_sha256", src.tree_sha256)))


def _download_entry(src: Source, properties: tuple[tuple[str, str], ...]) -> BomEntry:
    return BomEntry(
        name=src.name,
        version=f"sha256:{src.sha256}",
        ref=f"source:{src.name}",
        license=src.license,
        sha256=src.sha256,
        purl_name=src.name,
        purl_qualifiers=(("download_url", src.url),),
        links=(("distribution", src.url),),
        properties=properties,
    )


SDIST_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".zip")


def is_sdist_of(filename: str, project: str, version: str) -> bool:
    """Whether ``filename`` is a source archive of ``project`` ``version`` (any archive suffix)."""
    suffix = next((s for s in SDIST_SUFFIXES if filename.endswith(s)), None)
    if suffix is None:
        return False
    name, _, ver = filename[: -len(suffix)].rpartition("-")
    try:
        return canonicalize_name(name) == canonicalize_name(project) and Version(ver) == Version(version)
    except InvalidVersion:
        return False


class Pypi(ArchiveKind):
    """The sdist of one version of a project on the package index pip is configured with (tasks/lock/pypi.py)."""

    name = "pypi"
    fields = TREE_FIELDS | {
        "project": Field(is_str, required=True),
        "version": Field(is_str, required=True),
        "filename": Field(is_str),
        "sha256": Field(is_sha256),
    }

    def check(self, where: str, entry: Mapping[str, Any], p: Problems) -> dict[str, Any]:
        if not ("filename" in entry and "sha256" in entry):
            p.unpinned(where, "missing 'filename' and 'sha256' of the sdist (run `doit lock` to fill them in)")
        if "filename" in entry:
            stem = canonicalize_name(entry["filename"].split("-")[0])
            if stem != canonicalize_name(entry["project"]):
                p.add(where, f"filename {entry['filename']!r} does not belong to project {entry['project']!r}")
        return {}

    def pin(self, src: Source) -> dict[str, Any]:
        return {
            "name": src.name,
            "kind": src.kind,
            "tree_sha256": src.tree_sha256,
            "project": src.project,
            "version": src.version,
            "filename": src.filename,
            "sha256": src.sha256,
        }

    def complete(self, src: Source) -> bool:
        return bool(src.tree_sha256) and bool(src.filename and src.sha256)

    def _resolve(self, src: Source, *, cache: Cache, log: Path, refresh: bool) -> tuple[Source, dict[str, Any]]:
        from tasks.lock import pypi

        edits: dict[str, Any] = {}
        if not src.filename:
            candidates = [
                link for link in pypi.list_files(src.project) if is_sdist_of(link.filename, src.project, src.version)
            ]
            if not candidates:
                raise LockError(f"source {src.name}: no sdist of {src.project} {src.version} in the package index")
            edits["filename"] = candidates[0].filename
            src = replace(src, filename=candidates[0].filename, sha256="")
        return (replace(src, sha256="") if refresh else src), edits

    def _download(self, src: Source, dest: Path) -> str:
        from tasks.core import net
        from tasks.lock import pypi

        link = pypi.find_file(src.project, src.filename)
        if link.sha256 and src.sha256 and link.sha256 != src.sha256:
            raise VerificationError(
                f"source {src.name}: the index lists {src.filename} with sha256 {link.sha256} "
                f"but the lock pins {src.sha256}"
            )
        net.download(link.url, dest)
        return link.url

    def provenance(self, src: Source, path: str) -> list[dict[str, Any]]:
        first = {"uri": f"pkg:pypi/{src.project}@{src.version}", "digest": {"sha256": src.sha256}}
        notes = self._annotations(src, path)
        notes["filename"] = src.filename
        return [{"name": f"source:{src.name}", **first, "annotations": notes}]

    def sbom(self, src: Source) -> BomEntry:
        return BomEntry(
            name=src.project,
            version=src.version,
            ref=f"source:{src.name}",
            license=src.license,
            sha256=src.sha256,
            purl_type="pypi",
            purl_name=str(canonicalize_name(src.project)),
            purl_version=src.version,
            properties=(("kind", src.kind), ("tree_sha256", src.tree_sha256), ("filename", src.filename)),
        )


class Wheel(SourceKind):
    """A wheel file by URL and sha256, used as is: placed in the wheelhouse, never built (no tree)."""

    name = "wheel"
    wheel = True
    fields: ClassVar[Mapping[str, Field]] = {
        "kind": Field(is_str, required=True),
        "url": Field(is_str, required=True),
        "sha256": Field(is_sha256),
        "license": Field(is_license),
    }

    def check(self, where: str, entry: Mapping[str, Any], p: Problems) -> dict[str, Any]:
        filename = unquote(urlparse(entry["url"]).path.rsplit("/", 1)[-1])
        try:
            parse_wheel_filename(filename)
        except InvalidWheelFilename:
            p.add(where, f"url must name a wheel file (NAME-VERSION-TAGS.whl), not {filename!r}")
        if "sha256" not in entry:
            p.unpinned(where, "missing 'sha256' of the wheel (run `doit lock` where the URL is reachable)")
        return {"filename": filename}

    def pin(self, src: Source) -> dict[str, Any]:
        return {"name": src.name, "kind": src.kind, "url": src.url, "sha256": src.sha256, "filename": src.filename}

    def complete(self, src: Source) -> bool:
        return bool(src.sha256)

    def lock(
        self, src: Source, *, cache: Cache, mirror: Path | None, log: Path, refresh: bool
    ) -> tuple[dict[str, Any], str]:
        """The sha256 of the wheel, downloaded once (kept in the fetched store); where the URL cannot be
        reached here the pin stays empty and the line says how to fill it."""
        from tasks.core import net

        with cache.staging(f"lock-{src.name}") as work:
            path = work / src.filename
            try:
                net.download(src.url, path)
            except FetchError as exc:
                return {}, (
                    f"{src.name}: NOT PINNED: {src.url} cannot be reached from here "
                    f"({exc.message.splitlines()[0][:160]}); sha256 stays empty and builds refuse the lock until "
                    f"`doit lock update={src.name}` runs where it can"
                )
            digest = file_sha256(path)
            final = cache.fetched / digest
            final.mkdir(parents=True, exist_ok=True)
            os.replace(path, final / src.filename)
            (final / "origin").write_text(src.url + "\n")
        return {"sha256": digest}, f"{src.name}: wheel {src.filename} sha256 {digest[:12]}"

    def mirror_entry(self, src: Source, *, cache: Cache, mirror: Path) -> str:
        wheel = cache.fetched_wheel(src.sha256)
        if wheel is None:
            raise VerificationError(f"source {src.name}: its wheel is not in the cache; run `doit fetch:{src.name}`")
        (mirror / "wheels").mkdir(parents=True, exist_ok=True)
        dest = mirror / "wheels" / src.filename
        if not dest.is_file() or file_sha256(dest) != src.sha256:
            copy_atomic(wheel, dest)
        return f"wheels/{src.filename}"

    def provenance(self, src: Source, path: str) -> list[dict[str, Any]]:
        notes = self._annotations(src, path)
        notes["filename"] = src.filename
        return [{"name": f"source:{src.name}", "uri": src.url, "digest": {"sha256": src.sha256}, "annotations": notes}]

    def sbom(self, src: Source) -> BomEntry:  # no tree: its file name instead
        return _download_entry(src, (("kind", "wheel"), ("filename", src.filename)))


#: Kind name -> kind. Plugins (``REPRO_SOURCE_KINDS``) join when the first lock is read.
KINDS: dict[str, SourceKind] = {kind.name: kind for kind in (Git(), Url(), Pypi(), Wheel())}
_loaded: set[str] = set()


def registry() -> Mapping[str, SourceKind]:
    """:data:`KINDS`, with the kinds of the plugin modules ``REPRO_SOURCE_KINDS`` names (imported once)."""
    for module in (m.strip() for m in os.environ.get(PLUGINS_VAR, "").split(",")):
        if module and module not in _loaded:
            _load_plugin(module)
            _loaded.add(module)
    return KINDS


def _load_plugin(module: str) -> None:
    where = f"{PLUGINS_VAR}={os.environ.get(PLUGINS_VAR, '')}"
    if not MODULE_RE.match(module):
        raise LockError(f"{where}: {module!r} is not a module name (dotted Python identifiers, comma-separated)")
    try:
        found = importlib.import_module(module)
    except ImportError as exc:
        raise LockError(f"{where}: cannot import {module!r} ({exc}); is it on PYTHONPATH?") from None
    kinds = getattr(found, "SOURCE_KINDS", None)
    if not isinstance(kinds, list | tuple) or not all(isinstance(k, SourceKind) for k in kinds):
        raise LockError(f"{where}: module {module!r} must define SOURCE_KINDS, a list of tasks.lock.kinds.SourceKind")
    for kind in kinds:
        if not kind.name or not kind.fields:
            raise LockError(f"{where}: {module}.{type(kind).__name__} sets no name or no fields")
        if kind.name in KINDS and KINDS[kind.name] is not kind:
            raise LockError(f"{where}: {module}.{type(kind).__name__} names kind {kind.name!r}, which exists already")
        KINDS[kind.name] = kind


def find(name: object) -> SourceKind | None:
    """The kind called ``name``; None when there is none (or ``name`` is not a string)."""
    return registry().get(name) if isinstance(name, str) else None


def of(name: str) -> SourceKind:
    """The kind called ``name``: a :class:`LockError` for an unknown one, never a default."""
    kind = find(name)
    if kind is None:
        known = ", ".join(registry())
        raise LockError(f"unknown source kind {name!r}{suggest(str(name), registry())}: the kinds are {known} "
                        f"(tasks/lock/kinds.py; more through {PLUGINS_VAR})")  # fmt: skip
    return kind


def _mirror_tree(mirror: Path | None, src: Source) -> Path | None:
    if mirror is None or not src.tree_sha256:
        return None
    p = mirror / "trees" / f"{src.tree_sha256}.tar.gz"
    return p if p.is_file() else None


def _mirror_archive(mirror: Path | None, src: Source) -> Path | None:
    if mirror is None or not src.sha256:
        return None
    p = mirror / "archives" / src.sha256
    return p if p.is_file() else None


def materialize(
    src: Source, work: Path, *, cache: Cache, mirror: Path | None, log: Path
) -> tuple[Path, dict[str, Any]]:
    """Produce the kept tree of ``src`` under ``work`` (not yet verified against the tree hash): from the
    mirror's tree, else as its kind makes it. Returns the tree root and metadata (origin, archive sha256)."""
    from tasks.core.archive import unpack

    kind = of(src.kind)
    meta: dict[str, Any] = {"source": src.pin()}
    mirrored = _mirror_tree(mirror, src)
    if mirrored is not None:
        root = unpack(mirrored, work / "unpack", strip=0)
        meta["origin"] = str(mirrored)
        return root, meta
    root, more = kind.materialize(src, work, cache=cache, mirror=mirror, log=log)
    return root, meta | more
