"""The compilers a build runs: every name and path that the run's gate (tasks/outside/gate.py) and the object
cache (tasks/env/objcache.py) put themselves in front of, and a watch for compiles that got past both.

A build reaches a compiler in one of three ways:

- by a name looked up on ``PATH``: ``cc gcc c++ g++ nvcc clang clang++``, the names this Python gives
  setuptools (sysconfig's ``CC``, ``CXX``, ``LDSHARED``, ``LDCXXSHARED``: ``x86_64-linux-gnu-gcc`` on the
  distributions' own Python), the target-prefixed gcc and g++ of its ``MULTIARCH``, and names the
  environment gives in ``CC``, ``CXX``, ``CUDAHOSTCXX``, ``NVCC``, ``LDSHARED`` or ``LDCXXSHARED`` (CMake
  takes its compilers from the first three, else from ``PATH``). An executable of the same name goes first on ``PATH``;
- by a path in one of those variables (``CXX=/opt/gcc/bin/g++`` on the GPU host): the variable is
  replaced by a script of the same name that runs the compiler through the gate and the cache;
- by a path of the build's own (a ``setup.py`` that runs ``/usr/bin/gcc-12``): nothing can route that.
  :class:`Watch` samples the build's processes and finds the compilers that run outside every gate,
  so that the build's summary says how many and which, rather than claiming every compile took a token.

Whatever goes into ``PATH`` or a compiler variable lies in a directory without whitespace
(:func:`spaceless_dir`): build scripts split those values on spaces (``shlex.split(nvcc)``,
setuptools' ``CC``, ccache's ``CCACHE_PREFIX``, make's ``MAKEFLAGS``).
"""

from __future__ import annotations

import atexit
import os
import re
import shlex
import shutil
import sysconfig
import tempfile
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from tasks.core import procfs
from tasks.core.errors import BuildError

#: Compilers reached by these names on PATH whatever the Python or the environment says.
BY_NAME = ("cc", "gcc", "c++", "g++", "nvcc", "clang", "clang++")
#: This Python's compiler commands: what setuptools compiles and links extensions with.
SYSCONFIG_VARS = ("CC", "CXX", "LDSHARED", "LDCXXSHARED")
#: The environment's compiler variables (setuptools, CMake, torch's cpp_extension, nvcc's host compiler).
ENV_VARS = ("CC", "CXX", "CUDAHOSTCXX", "NVCC", "LDSHARED", "LDCXXSHARED")
#: Set by the gate for the compiler it runs and everything that compiler starts (see :class:`Watch`).
GATED_MARK = "REPRO_GATED"
#: Processes that do a compile's work, whatever the driver that started them is called.
WORKERS = frozenset({"cc1", "cc1plus", "cc1obj", "lto1", "collect2", "cicc", "ptxas", "cudafe++"})
#: clang compiles in its driver's own process (clang, clang++, clang-18), not in clang-format or clangd.
_CLANG = re.compile(r"clang(\+\+)?(-\d+(\.\d+)*)?")


def first_word(command: str) -> str:
    """The program a compiler command (``"ccache g++ -m64"``) runs: its first word, "" when none."""
    try:
        words = shlex.split(command)
    except ValueError:
        return ""
    return words[0] if words else ""


def names(env: Mapping[str, str]) -> list[str]:
    """The compiler names a build with ``env`` may look up on PATH, in a stable order."""
    found = list(BY_NAME)
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        found += [f"{multiarch}-gcc", f"{multiarch}-g++"]
    found += [first_word(str(sysconfig.get_config_var(var) or "")) for var in SYSCONFIG_VARS]
    found += [first_word(env.get(var, "")) for var in ENV_VARS]
    return list(dict.fromkeys(n for n in found if n and "/" not in n and n != "ccache"))


def by_path(env: Mapping[str, str]) -> dict[str, str]:
    """The environment's compiler variables that name their compiler by path: variable -> value."""
    return {var: env[var] for var in ENV_VARS if "/" in first_word(env.get(var, ""))}


def write_script(path: Path, text: str) -> Path:
    """``path`` as an executable holding ``text``, written atomically unless it already does."""
    if path.is_file() and path.read_text() == text:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(text)
    tmp.chmod(0o755)
    os.replace(tmp, path)
    return path


def has_space(path: Path | str) -> bool:
    return any(c.isspace() for c in str(path))


def spaceless_dir(preferred: Path, prefix: str) -> Path:
    """``preferred``, created, unless its path holds whitespace: then a new directory in the system's
    temporary directory, removed when this process ends.

    Its paths go into PATH and into compiler variables that build tools split on spaces.
    """
    if not has_space(preferred):
        preferred.mkdir(parents=True, exist_ok=True)
        return preferred
    tmp = tempfile.gettempdir()
    if has_space(tmp):
        raise BuildError(
            f"cannot run compilers from {preferred}: build tools split the paths given to them on spaces, and the "
            f"temporary directory {tmp} has one too; use a builddir= without spaces, or set TMPDIR to one"
        )
    made = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, made, True)
    return made


class Watch:
    """Compilers that run in a build's session outside every gate: found by sampling ``/proc``.

    A compiler run by the gate has :data:`GATED_MARK` in its environment, and so does every process it
    starts (cc1plus under gcc, cicc under nvcc). A worker process (:data:`WORKERS`, or clang itself)
    without it was started by a compiler that escaped: counted once per driver, by the driver's name
    (its ``argv[0]``). A compile shorter than the sampling period can go unseen.
    """

    def __init__(self, every: float = 0.1) -> None:
        self.every = every
        self.session = 0
        self._seen: set[tuple[int, str]] = set()
        self._drivers: dict[tuple[int, str], str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def started(self, pid: int) -> None:
        """The build command started as ``pid``, the leader of its own session."""
        self.session = pid

    def __enter__(self) -> Watch:
        self._thread = threading.Thread(target=self._run, name="compiler-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def escaped(self) -> Counter[str]:
        """Compiler name -> how many of its runs escaped the gate."""
        return Counter(self._drivers.values())

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            if self.session:
                self.scan()

    def scan(self) -> None:
        """Look at the session's processes once."""
        table = {p.pid: p for p in procfs.processes()}
        for p in table.values():
            if p.sid != self.session or (p.pid, p.start) in self._seen:
                continue
            if p.name not in WORKERS and not _CLANG.fullmatch(p.name):
                continue
            gated = _gated(p.pid)
            if gated is None:  # ended, or still starting: looked at again next time
                continue
            self._seen.add((p.pid, p.start))
            if gated:
                continue
            driver = p
            while driver.name in WORKERS or driver.name in ("sh", "bash", "dash"):
                parent = table.get(driver.ppid)
                if parent is None or parent.sid != self.session:
                    break
                driver = parent
            key = (driver.pid, driver.start)
            if key not in self._drivers:
                self._drivers[key] = _argv0(driver.pid) or driver.name


def _gated(pid: int) -> bool | None:
    """Whether ``pid`` runs under a gate; None when its environment cannot be read (it ended)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return f"{GATED_MARK}=1".encode() in environ.split(b"\0") if environ else None


def _argv0(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def describe(escaped: Mapping[str, int]) -> str:
    """``escaped`` for a message: "2 by /usr/bin/gcc-12, 1 by clang"."""
    return ", ".join(f"{n} by {name}" for name, n in sorted(escaped.items()))
