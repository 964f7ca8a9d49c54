"""Self-tests of the fixture packages and tooling under tests/fixtures/."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures"
SRC_DIR = FIXTURES_DIR / "src"
if str(FIXTURES_DIR) not in sys.path:
    sys.path.insert(0, str(FIXTURES_DIR))

import make_fixtures  # noqa: E402
from serve import FixtureServer  # noqa: E402

PACKAGES = ("repro_pure", "repro_pybind", "repro_cuda", "repro_torchext")

#: Smoke check run (in a subprocess, with the unpacked wheel on PYTHONPATH) per package.
SMOKE: dict[str, str] = {
    "repro_pure": (
        "import repro_pure\nassert repro_pure.greet('x') == 'hello, x'\nassert repro_pure.MESSAGE == 'unpatched'\n"
    ),
    "repro_pybind": (
        "import repro_pybind\n"
        "assert repro_pybind.add(2, 3) == 5\n"
        "assert repro_pybind.dot([1.0, 2.0], [3.0, 4.5]) == 12.0\n"
    ),
    "repro_cuda": (
        "import repro_cuda\n"
        "n = repro_cuda.device_count()\n"
        "assert isinstance(n, int) and n >= 0\n"
        "if n == 0:\n"
        "    try:\n"
        "        repro_cuda.vadd([1.0], [2.0])\n"
        "    except RuntimeError as exc:\n"
        "        assert str(exc), 'empty CUDA error string'\n"
        "    else:\n"
        "        raise AssertionError('vadd without a device did not raise')\n"
        "else:\n"
        "    assert repro_cuda.vadd([1.0, 2.5], [10.0, 20.0]) == [11.0, 22.5]\n"
    ),
    "repro_torchext": (
        "import torch, repro_torchext\n"
        "out = repro_torchext.scaled_add(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), 0.5)\n"
        "assert out.tolist() == [2.5, 4.0], out\n"
    ),
}


# --------------------------------------------------------------------------- helpers


def _clean_env(home: Path) -> dict[str, str]:
    """Environment for git/pip subprocesses: no user git config, no pip config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "PIP_"))}
    env.update(
        HOME=str(home),
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_TERMINAL_PROMPT="0",
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
    )
    return env


def _run(cmd: list[str], env: Mapping[str, str], cwd: Path | None = None) -> str:
    proc = subprocess.run(
        cmd, cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-8000:]}")
    return proc.stdout


def _git(env: Mapping[str, str], *args: str, cwd: Path | None = None) -> str:
    return _run(["git", *args], env, cwd).strip()


def find_nvcc() -> str | None:
    if os.environ.get("NVCC"):  # the fixture's setup.py takes NVCC first, as our toolchain probe does
        nvcc = os.environ["NVCC"]
        return nvcc if os.path.isfile(nvcc) and os.access(nvcc, os.X_OK) else None
    candidates = [shutil.which("nvcc")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for cand in candidates:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = find_nvcc()
    if nvcc:
        sibling = Path(nvcc).resolve().parent / "cuobjdump"
        if sibling.is_file():
            return str(sibling)
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for cand in sorted(Path(root).glob("*/bin/cuobjdump")):
            if os.access(cand, os.X_OK):
                return str(cand)
    return None


def _tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every non-object file under root (objects differ only in zlib bytes)."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and "/objects/" not in f"/{rel}":
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    dest = tmp_path_factory.mktemp("published")
    return dest, make_fixtures.publish(dest)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _clean_env(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def build_wheel(
    tmp_path_factory: pytest.TempPathFactory,
    published: tuple[Path, dict[str, Any]],
    env: dict[str, str],
) -> Callable[[str], Path]:
    """Build (once per module) the wheel of a fixture package; return the wheel path."""
    cache: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name in cache:
            return cache[name]
        work = tmp_path_factory.mktemp(f"build-{name}")
        if name == "repro_torchext":
            # Built from a clone of the published repo, so the submodule is exercised.
            dest, _ = published
            src = work / name
            _git(
                env,
                "-c",
                "protocol.file.allow=always",
                "clone",
                "--quiet",
                "--recurse-submodules",
                (dest / "git" / "repro_torchext.git").as_uri(),
                str(src),
            )
        else:
            src = work / name
            shutil.copytree(
                SRC_DIR / name,
                src,
                ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "*.so"),
            )
        build_env = dict(env)
        if name == "repro_cuda":
            build_env["REPRO_CUDA_ARCHS"] = "sm_90a"
        out = work / "wheels"
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-build-isolation",
                "--no-deps",
                "--no-index",
                "--no-cache-dir",
                "-w",
                str(out),
                str(src),
            ],
            build_env,
        )
        wheels = sorted(out.glob("*.whl"))
        assert len(wheels) == 1, wheels
        cache[name] = wheels[0]
        return wheels[0]

    return build


def _skip_reason(name: str) -> str | None:
    import sysconfig

    if name != "repro_pure" and not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        return "Python's C headers (Python.h) are not installed (apt-get install python3-dev)"
    if name == "repro_torchext" and importlib.util.find_spec("torch") is None:
        return "torch is not importable in this interpreter (pip install torch to build repro_torchext)"
    if name == "repro_cuda" and find_nvcc() is None:
        return "nvcc not found (NVCC, PATH, CUDA_HOME, /usr/local/cuda)"
    return None


# --------------------------------------------------------------------------- tests


def test_publish_is_deterministic(tmp_path: Path, published: tuple[Path, dict[str, Any]]) -> None:
    first_dest, first = published
    second = make_fixtures.publish(tmp_path / "again")
    assert first == second
    assert set(first["commits"]) == {"repro_pure", "minihdr", "repro_torchext"}
    for info in first["commits"].values():
        assert len(info["commit"]) == 40
        assert info["tag"] == "v0.1.0"
        assert info["branch"] == "main"
    wheels = {
        f"packages/{p.replace('-', '_')}-{v}-py3-none-any.whl"
        for p, vs in make_fixtures.RUNTIME_WHEELS.items()
        for v in vs
    }
    assert set(first["sha256"]) == {"archives/repro_pybind-0.1.0.tar", "packages/repro_cuda-0.1.0.tar", *wheels}
    # Not only the reported shas: every published byte outside loose objects matches.
    assert _tree_hashes(first_dest) == _tree_hashes(tmp_path / "again")
    for rel, digest in first["sha256"].items():
        assert hashlib.sha256((first_dest / rel).read_bytes()).hexdigest() == digest


def test_published_git_repos(published: tuple[Path, dict[str, Any]], env: dict[str, str]) -> None:
    dest, result = published
    for info in result["commits"].values():
        repo = dest / info["path"]
        assert (repo / "info" / "refs").is_file(), "update-server-info was not run"
        assert _git(env, "--git-dir", str(repo), "rev-parse", "refs/heads/main") == info["commit"]
        assert _git(env, "--git-dir", str(repo), "rev-parse", "v0.1.0") == info["tag_object"]
        assert _git(env, "--git-dir", str(repo), "rev-parse", "v0.1.0^{commit}") == info["commit"]
        assert _git(env, "--git-dir", str(repo), "symbolic-ref", "HEAD") == "refs/heads/main"
        assert _git(env, "--git-dir", str(repo), "rev-list", "--count", "main") == "1"
        _git(env, "--git-dir", str(repo), "fsck", "--strict", "--no-dangling")
    torchext = dest / "git" / "repro_torchext.git"
    entry = _git(env, "--git-dir", str(torchext), "ls-tree", "main", "third_party/minihdr")
    assert entry == f"160000 commit {result['commits']['minihdr']['commit']}\tthird_party/minihdr"
    gitmodules = _git(env, "--git-dir", str(torchext), "show", "main:.gitmodules")
    assert "url = ../minihdr.git" in gitmodules


def test_archives_are_normalised(published: tuple[Path, dict[str, Any]]) -> None:
    dest, result = published
    prefixes = {
        "archives/repro_pybind-0.1.0.tar": "repro_pybind-0.1.0",
        "packages/repro_cuda-0.1.0.tar": "repro_cuda-0.1.0",
    }
    for rel, prefix in prefixes.items():
        with tarfile.open(dest / rel, mode="r:") as tar:
            members = tar.getmembers()
        names = [m.name for m in members]
        assert names == sorted(names, key=lambda n: n.split("/"))
        assert names[0] == prefix
        assert all(n == prefix or n.startswith(prefix + "/") for n in names)
        for m in members:
            assert (m.mtime, m.uid, m.gid, m.uname, m.gname) == (make_fixtures.EPOCH, 0, 0, "", "")
            assert m.isdir() or m.isfile()
            assert m.mode == (0o755 if m.isdir() else 0o644), (m.name, oct(m.mode))
        assert f"{prefix}/pyproject.toml" in names
        assert f"{prefix}/setup.py" in names
        assert not any("egg-info" in n or "/build/" in n for n in names)
    html = (dest / "simple" / "repro-cuda" / "index.html").read_text()
    digest = result["sha256"]["packages/repro_cuda-0.1.0.tar"]
    assert f'href="../../packages/repro_cuda-0.1.0.tar#sha256={digest}"' in html
    assert 'href="repro-cuda/"' in (dest / "simple" / "index.html").read_text()


def test_dumb_http_clone(tmp_path: Path, published: tuple[Path, dict[str, Any]], env: dict[str, str]) -> None:
    dest, result = published
    with FixtureServer(dest) as server:
        assert server.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{server.url}/git/repro_pure.git/info/refs") as resp:
            assert result["commits"]["repro_pure"]["commit"].encode() in resp.read()

        pure = tmp_path / "repro_pure"
        _git(env, "clone", "--quiet", f"{server.url}/git/repro_pure.git", str(pure))
        assert _git(env, "rev-parse", "HEAD", cwd=pure) == result["commits"]["repro_pure"]["commit"]
        assert _git(env, "describe", "--tags", "--exact-match", cwd=pure) == "v0.1.0"
        assert (pure / "repro_pure" / "__init__.py").is_file()

        torchext = tmp_path / "repro_torchext"
        _git(
            env,
            "-c",
            "protocol.allow=always",
            "clone",
            "--quiet",
            "--recurse-submodules",
            "--branch",
            "v0.1.0",
            f"{server.url}/git/repro_torchext.git",
            str(torchext),
        )
        assert (torchext / "third_party" / "minihdr" / "include" / "minihdr.h").is_file()
        sub = torchext / "third_party" / "minihdr"
        assert _git(env, "rev-parse", "HEAD", cwd=sub) == result["commits"]["minihdr"]["commit"]
        assert _git(env, "config", "remote.origin.url", cwd=sub) == f"{server.url}/git/minihdr.git"


def test_simple_index_over_http(tmp_path: Path, published: tuple[Path, dict[str, Any]], env: dict[str, str]) -> None:
    dest, result = published
    out = tmp_path / "dl"
    with FixtureServer(dest) as server:
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-build-isolation",
                "--no-cache-dir",
                "--no-binary",
                ":all:",
                "--index-url",
                f"{server.url}/simple",
                "-d",
                str(out),
                "repro-cuda==0.1.0",
            ],
            env,
        )
    got = out / "repro_cuda-0.1.0.tar"
    assert hashlib.sha256(got.read_bytes()).hexdigest() == result["sha256"]["packages/repro_cuda-0.1.0.tar"]


@pytest.mark.parametrize("name", PACKAGES)
def test_package_builds_and_imports(
    name: str, tmp_path: Path, build_wheel: Callable[[str], Path], env: dict[str, str]
) -> None:
    reason = _skip_reason(name)
    if reason:
        pytest.skip(reason)
    wheel = build_wheel(name)
    assert wheel.name.startswith(f"{name}-0.1.0-")
    unpacked = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
    run_env = dict(env)
    run_env["PYTHONPATH"] = str(unpacked)
    _run([sys.executable, "-c", SMOKE[name]], run_env, cwd=tmp_path)


def test_cuda_extension_has_sm90a_sass(tmp_path: Path, build_wheel: Callable[[str], Path], env: dict[str, str]) -> None:
    reason = _skip_reason("repro_cuda")
    if reason:
        pytest.skip(reason)
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (PATH, next to nvcc, or pip install nvidia-cuda-cuobjdump)")
    wheel = build_wheel("repro_cuda")
    with zipfile.ZipFile(wheel) as zf:
        sos = [n for n in zf.namelist() if n.startswith("repro_cuda/_vadd.") and n.endswith(".so")]
        assert len(sos) == 1, zf.namelist()
        zf.extract(sos[0], tmp_path)
    so = tmp_path / sos[0]
    listing = _run([cuobjdump, "--list-elf", str(so)], env)
    assert "sm_90a" in listing, listing
    ptx = subprocess.run(
        [cuobjdump, "--list-ptx", str(so)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    assert ".ptx" not in ptx.stdout, f"expected SASS only, found PTX:\n{ptx.stdout}"
    # static cudart: the module must not need libcudart.so at load time
    needed = _run(["readelf", "-d", str(so)], env) if shutil.which("readelf") else ""
    assert "libcudart" not in needed


def test_serve_says_when_it_listens_and_a_busy_port_in_one_line(tmp_path: Path) -> None:
    """serve.py as the quickstart runs it: it says "serving" once it listens; a busy port is one line, exit 1."""
    (tmp_path / "hello.txt").write_text("hi\n")
    server = subprocess.Popen(
        [sys.executable, str(FIXTURES_DIR / "serve.py"), str(tmp_path), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line.startswith("serving "), line
        url = line.split(" at ")[1].split()[0]
        with urllib.request.urlopen(f"{url}/hello.txt", timeout=10) as response:
            assert response.read() == b"hi\n"
        busy = subprocess.run(
            [sys.executable, str(FIXTURES_DIR / "serve.py"), str(tmp_path), "--port", url.rsplit(":", 1)[1]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert busy.returncode == 1
        assert busy.stderr.strip().startswith("cannot listen on 127.0.0.1:") and "\n" not in busy.stderr.strip()
    finally:
        server.kill()
        server.communicate()
