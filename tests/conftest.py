"""Shared fixtures: the published fixture packages, a loopback server, doit workspaces.

A workspace is a scratch directory holding a copy of the example lock (its
URLs pointed at the test's server) and its patches; doit runs there as a user
would run it, through ``python -m doit -f <repo>/dodo.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tempfile
import venv
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "fixtures"))

from make_fixtures import publish  # noqa: E402
from serve import FixtureServer  # noqa: E402

from tasks.core.fsutil import rmtree  # noqa: E402
from tasks.core.treehash import file_sha256  # noqa: E402
from tasks.env.toolchain import _which  # noqa: E402

EXAMPLE_LOCK = REPO / "examples" / "example.lock"


def ci_requires() -> bool:
    """Whether the environment says this is CI (CI=true, as CI services set it), where every test must run.

    Outside CI, tests that need docker, nginx or the S3 server skip with the reason when the machine cannot
    run them (an unprivileged container has no docker daemon); in CI they fail instead. Tests marked ``gpu``
    skip wherever no GPU is present, CI included: CI's machines have none.
    """
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


#: What the example's CUDA fixture and torch extension need: a test marked ``needs_nvcc`` / ``needs_torch``
#: is skipped where they are missing (a stock container has neither), and fails in CI; so is one marked
#: ``runs_torch`` (it runs torch here, compiling nothing) where torch is missing.
HAVE_NVCC = _which("nvcc", dict(os.environ)) is not None
HAVE_TORCH = importlib.util.find_spec("torch") is not None
#: Python's C headers (Debian's python3-dev): every fixture extension (pybind11, CUDA, torch) includes Python.h.
HAVE_HEADERS = Path(sysconfig.get_paths()["include"], "Python.h").is_file()


#: The suites by folder: a test's marker is its folder's. ``-m "not integration"`` is tests/unit, what
#: ``bash .ci/run --fast`` runs; tests/integration and tests/fixtures_selftest (which builds the fixture
#: packages themselves, compilers and all) are ``integration``.
INTEGRATION_DIRS = (REPO / "tests" / "integration", REPO / "tests" / "fixtures_selftest")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test in INTEGRATION_DIRS is marked ``integration``; none elsewhere may be."""
    misplaced = []
    for item in items:
        inside = any(Path(str(item.path)).resolve().is_relative_to(d) for d in INTEGRATION_DIRS)
        if inside:
            item.add_marker(pytest.mark.integration)
        elif item.get_closest_marker("integration"):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(f"marked integration in tests/unit (move them to tests/integration): {misplaced}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") and not HAVE_GPU:
        pytest.skip("no NVIDIA GPU here (nvidia-smi lists none): the test runs on a GPU host")
    compiles = any(item.get_closest_marker(m) for m in ("needs_nvcc", "needs_torch", "needs_headers"))
    if compiles and not HAVE_HEADERS:
        require("Python's C headers (Python.h) are not installed (apt-get install python3-dev): the test compiles")
    if item.get_closest_marker("needs_nvcc") and not HAVE_NVCC:
        require("nvcc not found (NVCC, PATH, CUDA_HOME, /usr/local/cuda): the test builds the example's CUDA fixture")
    if item.get_closest_marker("needs_torch") and not HAVE_TORCH:
        require("torch is not importable: the test builds the example's torch extension (pip install torch)")
    if item.get_closest_marker("runs_torch") and not HAVE_TORCH:
        require("torch is not importable: the test runs torch's CPU build (pip install torch)")


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's ``size=``) at ``path``: a full disk made to order. Needs root and mount."""
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    if os.geteuid() != 0 or not shutil.which("mount") or subprocess.run(mount, capture_output=True).returncode != 0:
        require("cannot mount a small tmpfs here (needs root and mount privileges)")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def _have_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    return listed.returncode == 0 and any(line.startswith("GPU ") for line in listed.stdout.splitlines())


#: An NVIDIA GPU: tests marked ``gpu`` skip without one, in CI too (CI's machines have none).
HAVE_GPU = _have_gpu()


def require(message: str) -> NoReturn:
    """Skip the test with ``message``, or fail it in CI (see :func:`ci_requires`)."""
    if ci_requires():
        pytest.fail(f"CI needs this: {message}", pytrace=False)
    pytest.skip(message)


EXAMPLE_URL = "http://127.0.0.1:8737"


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[str]]]:
    """The processes a test starts (append them), killed whatever the test's outcome: no stray run, and no
    ResourceWarning of its pipes, in a later test."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate()


@pytest.fixture(scope="session")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("published")
    publish(dest)
    return dest


@pytest.fixture(scope="session")
def server(published: Path) -> Iterator[FixtureServer]:
    with FixtureServer(published, port=0) as srv:
        yield srv


#: The example lock's profile of its pure-Python package alone: no compiler, no nvcc, no torch.
PURE_PROFILE = "\n[profiles.pure]\n" + "".join(
    f"[profiles.pure.packages.{p}]\nenabled = false\n" for p in ("repro_pybind", "repro_cuda", "repro_torchext")
)


def lock_text_for(url: str, lock: Path = EXAMPLE_LOCK) -> str:
    return lock.read_text().replace(EXAMPLE_URL, url)


#: The toolchain fingerprints the tool memoises in each cache (``cache/toolchain/<stamp>.json``,
#: tasks/env/toolchain.py ``detect``), gathered from every workspace's runs in this process and given to
#: each workspace before its runs: making one imports torch (about two CPU-seconds), and nearly every test
#: starts with a cache of its own. The stamp is the tool's digest of the interpreter, its site directories,
#: the tools on PATH and the steering environment, so a test that changes any of them still probes afresh
#: (and the unit tests of tasks/env/toolchain.py probe for themselves).
_TOOLCHAIN_MEMOS: dict[str, str] = {}


def _seed_toolchain(cache: Path) -> None:
    if not _TOOLCHAIN_MEMOS or (cache.exists() and not cache.is_dir()):
        return  # a test that hands the tool a file for its cache sees it as it made it
    memo_dir = cache / "toolchain"
    with contextlib.suppress(OSError):
        memo_dir.mkdir(parents=True, exist_ok=True)
        for name, text in _TOOLCHAIN_MEMOS.items():
            if not (memo_dir / name).exists():
                (memo_dir / name).write_text(text)


def _gather_toolchain(cache: Path) -> None:
    for memo in (cache / "toolchain").glob("*.json"):
        if memo.name not in _TOOLCHAIN_MEMOS:
            with contextlib.suppress(OSError, UnicodeDecodeError):
                _TOOLCHAIN_MEMOS[memo.name] = memo.read_text()


@dataclass
class Workspace:
    root: Path
    cache: Path
    index_url: str
    env_extra: dict[str, str] = field(default_factory=dict)

    @property
    def lock(self) -> Path:
        return self.root / "example.lock"

    @property
    def wheels(self) -> Path:
        return self.root / "wheels"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "REPRO_"))}
        env.update(PIP_INDEX_URL=self.index_url, PIP_CONFIG_FILE=os.devnull, PYTHONUNBUFFERED="1")
        env.update(self.env_extra)
        return env

    def command(self, *args: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "doit",
            "-f",
            str(REPO / "dodo.py"),
            "-d",
            str(self.root),
            *args,
            f"lock={self.lock}",
            f"cache={self.cache}",
        ]

    def doit(self, *args: str, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        _seed_toolchain(self.cache)
        res = subprocess.run(
            self.command(*args),
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        _gather_toolchain(self.cache)
        if check and res.returncode != 0:
            raise AssertionError(f"doit {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        return res

    def popen(self, *args: str) -> subprocess.Popen[str]:
        _seed_toolchain(self.cache)
        return subprocess.Popen(
            self.command(*args),
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            stdin=subprocess.DEVNULL,
        )

    def edit_lock(self, old: str, new: str) -> None:
        text = self.lock.read_text()
        assert old in text, old
        self.lock.write_text(text.replace(old, new, 1))


def make_workspace(root: Path, cache: Path, url: str) -> Workspace:
    root.mkdir(parents=True, exist_ok=True)
    (root / "example.lock").write_text(lock_text_for(url))
    shutil.copytree(REPO / "examples" / "patches", root / "patches")
    return Workspace(root=root, cache=cache, index_url=f"{url}/simple")


@pytest.fixture
def workspace(tmp_path: Path, server: FixtureServer) -> Workspace:
    return make_workspace(tmp_path / "ws", tmp_path / "cache", server.url)


def built_packages(output: str) -> list[str]:
    """Packages a doit run compiled (from its 'built <pkg> in' lines)."""
    return re.findall(r"^built (\S+) in ", output, flags=re.M)


def object_counts(output: str, package: str) -> tuple[int, int]:
    """(hits, misses) of the object cache in a doit run's 'built <pkg> ...' line."""
    m = re.search(rf"^built {package} .*object cache (\d+) hits / (\d+) misses", output, flags=re.M)
    assert m, output
    return int(m.group(1)), int(m.group(2))


@pytest.fixture(scope="session")
def quick_cache(tmp_path_factory: pytest.TempPathFactory, server: FixtureServer) -> Path:
    """A cache holding the example lock's 'quick' profile, built once per session."""
    if not HAVE_NVCC:
        require("nvcc not found: the example's 'quick' profile includes the CUDA fixture")
    if not HAVE_HEADERS:
        require("Python's C headers (Python.h) are not installed: the 'quick' profile compiles extensions")
    root = tmp_path_factory.mktemp("quick")
    ws = make_workspace(root / "ws", root / "cache", server.url)
    ws.doit("wheels", "profile=quick")
    return ws.cache


def copy_cache(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns("*.lock"))
    return dest


@functools.cache
def _pip_template() -> Path:
    """A venv made by ensurepip once per test process (removed at its exit): what venv_with_pip copies."""
    template = Path(tempfile.mkdtemp(prefix="reprostack-pip-venv-"))
    atexit.register(shutil.rmtree, template, True)
    venv.EnvBuilder(with_pip=True).create(template / "venv")
    return template / "venv"


def venv_with_pip(path: Path) -> Path:
    """A venv as ``python -m venv`` makes it, with ensurepip's pip (and what else ensurepip installs), at
    ``path``; its python. ensurepip installs and byte-compiles pip (about four CPU-seconds): it runs once per
    test process, into a template, whose site-packages and bin/ scripts (their ``#!`` line made the new venv's)
    are copied into each venv made after it."""
    template = _pip_template()
    venv.EnvBuilder(with_pip=False).create(path)
    site_rel = next(template.glob("lib/python3*/site-packages")).relative_to(template)
    shutil.copytree(template / site_rel, path / site_rel, symlinks=True, dirs_exist_ok=True)
    for script in (template / "bin").iterdir():
        if script.is_symlink() or not script.is_file() or (path / "bin" / script.name).exists():
            continue
        first, sep, rest = script.read_bytes().partition(b"\n")
        if first.startswith(b"#!") and str(template).encode() in first:
            (path / "bin" / script.name).write_bytes(b"#!" + str(path / "bin" / "python").encode() + sep + rest)
            (path / "bin" / script.name).chmod(0o755)
    return path / "bin" / "python"


def scratch_venv(path: Path) -> str:
    """A fresh venv that also sees this interpreter's packages (torch) through a .pth file."""
    py = venv_with_pip(path)
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "_outer_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return str(py)


#: The packages of the example lock's 'quick' profile.
QUICK = ["repro_cuda", "repro_pure", "repro_pybind"]


def warm_workspace(root: Path, quick_cache: Path, server: FixtureServer) -> Workspace:
    """A workspace whose cache has the sources and compile objects of the quick profile, but no wheels."""
    cache = copy_cache(quick_cache, root / "cache")
    rmtree(cache / "wheels")
    return make_workspace(root / "ws", cache, server.url)


def shas(ws: Workspace) -> dict[str, str]:
    """package -> sha256 of the lock's packages in the workspace's wheels/ (the runtime closure's fetched
    wheels left out), every file of it checked against manifest.json."""
    doc = json.loads((ws.wheels / "manifest.json").read_text())
    for w in doc["wheels"]:
        assert file_sha256(ws.wheels / w["filename"]) == w["sha256"]
    return {w["package"]: w["sha256"] for w in doc["wheels"] if w.get("origin") != "fetched"}


def entries(cache: Path) -> dict[str, dict[str, object]]:
    """package -> entry.json of the cache's wheel entries."""
    found = {}
    for p in (cache / "wheels").glob("*/*/entry.json"):
        meta = json.loads(p.read_text())
        found[meta["package"]] = meta
    return found


# The image tests' docker and runtime base (tests/integration/test_image.py, test_guard.py's base_image).
@pytest.fixture(scope="session")
def docker_ready() -> None:
    reason = ""
    if shutil.which("docker") is None:
        reason = "the docker command is not installed (Debian: apt-get install docker.io)"
    else:
        res = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            reason = f"cannot reach the docker daemon: {res.stderr.strip()[-300:]} (start dockerd; .ci/run does)"
    if reason:
        skipped = REPO / "build" / "ci-docker.skipped"  # what scripts/ci-docker.sh skipped, and why (.ci/run)
        if skipped.is_file():
            reason += f"; {skipped.read_text().strip()}"
        require(f"no docker for the image tests: {reason} (with CI=true this is a failure)")


@pytest.fixture(scope="session")
def base_id(docker_ready: None) -> str:
    """The runtime base: REPRO_TEST_BASE (an image ID) or the one make-base-image.sh makes (cached by tag)."""
    given = os.environ.get("REPRO_TEST_BASE", "")
    if given:
        return given
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "make-base-image.sh"), "runtime"],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    if res.returncode != 0:
        pytest.fail(f"scripts/make-base-image.sh runtime failed:\n{res.stderr[-3000:]}", pytrace=False)
    return res.stdout.strip().splitlines()[-1]
