"""uv in place of pip, offline (docs/offline.md, "With uv"): the wheelhouse into an environment whose base holds
torch, and the tool from a mirror's ``tool/``, each with the commands the page gives.

Real components: `doit wheels` of the example lock (its pure-Python package, its torch extension and the runtime
closure) and `doit mirror`, run as a user runs them; uv (pinned in the test extra) with its own --require-hashes
check and ``uv pip check``, never reaching the network (``UV_OFFLINE``, no index); torch's CPU build.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from conftest import Workspace, require
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from integration.test_tool_wheels import EMPTY_LOCK, _alter

pytestmark = pytest.mark.integration

#: The example lock's pure-Python package and its torch extension, whose wheel requires the base's torch.
TORCH_PROFILE = "\n[profiles.torch]\n" + "".join(
    f"[profiles.torch.packages.{p}]\nenabled = false\n" for p in ("repro_pybind", "repro_cuda")
)


def _uv() -> str:
    try:
        import uv
    except ImportError:
        require("uv is not installed (pip install uv, pinned in the test extra: scripts/bootstrap.sh --tests)")
    return uv.find_uv_bin()


def _run_uv(*args: str, python: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """``uv ARGS`` for the environment of ``python``: offline, a cache of the test's own, no configuration of this
    machine's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_", "REPRO_", "VIRTUAL_ENV"))}
    env.update(UV_OFFLINE="1", UV_CACHE_DIR=str(cache), UV_NO_CONFIG="1", UV_PYTHON_DOWNLOADS="never")
    env.update(UV_PYTHON=str(python))
    return subprocess.run(
        [_uv(), *args], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300, check=False
    )


def _environment_with_torch(path: Path) -> Path:
    """A Python environment holding torch in its own site-packages, as a cluster's or an NGC container's Python
    does: a venv into which torch and everything it requires are linked from this one (their .dist-info copied
    without RECORD, so no installer can remove the linked files); its python."""
    venv.EnvBuilder(with_pip=False).create(path)
    site = next(path.glob("lib/python3*/site-packages"))
    seen: set[str] = set()
    todo = ["torch"]
    while todo:
        name = todo.pop()
        if canonicalize_name(name) in seen:
            continue
        seen.add(canonicalize_name(name))
        dist = importlib.metadata.distribution(name)
        reqs = [Requirement(r) for r in dist.requires or []]
        todo += [r.name for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]
        root = Path(str(dist.locate_file("")))
        for top in sorted({f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}):
            if top.endswith(".dist-info"):
                shutil.copytree(root / top, site / top, ignore=shutil.ignore_patterns("RECORD"))
            elif not (site / top).exists():
                (site / top).symlink_to(root / top)
    return path / "bin" / "python"


@pytest.mark.needs_torch  # builds the example's torch extension
def test_uv_installs_the_wheelhouse_where_the_base_holds_torch(workspace: Workspace, tmp_path: Path) -> None:
    """The wheelhouse's documented install with uv in place of pip, into an environment that holds torch: uv wants a
    trusted hash for torch too, so the page's uv command adds --no-deps (every wheel of the hash-pinned file, and
    nothing else, installed and checked), and ``uv pip check`` finds torch and the closure whole; the extension
    runs. In a venv that sees torch only through its base, uv's check sees no torch."""
    ws = workspace
    ws.lock.write_text(ws.lock.read_text() + TORCH_PROFILE)
    ws.doit("wheels", "profile=torch")
    wheels = ws.wheels
    python, cache = _environment_with_torch(tmp_path / "node"), tmp_path / "uv-cache"
    documented = ["pip", "install", "--offline", "--no-index", "--find-links", str(wheels)]
    hashed = ["--require-hashes", "-r", str(wheels / "requirements.txt")]

    as_pip = _run_uv(*documented, *hashed, python=python, cache=cache)
    assert as_pip.returncode != 0, as_pip.stdout + as_pip.stderr
    assert "no trusted hash was provided for: `torch`" in as_pip.stderr, as_pip.stderr

    res = _run_uv(*documented, "--no-deps", *hashed, python=python, cache=cache)
    assert res.returncode == 0, res.stdout + res.stderr
    installed = sorted(line.split()[1] for line in res.stderr.splitlines() if line.startswith(" + "))
    pinned = sorted(line.split()[0] for line in (wheels / "requirements.txt").read_text().splitlines() if "==" in line)
    assert installed == pinned and any(p.startswith("repro-torchext==") for p in pinned), res.stderr
    check = _run_uv("pip", "check", python=python, cache=cache)
    assert check.returncode == 0 and "All installed packages are compatible" in check.stderr, check.stderr
    ran = subprocess.run(
        [
            str(python),
            "-W",
            "ignore",
            "-c",
            "import repro_pure, repro_greeting, repro_torchext, torch\n"
            "print(repro_pure.MESSAGE, repro_torchext.scaled_add(torch.ones(2), torch.ones(2), 2.0).tolist())",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert ran.stdout.split() == ["patched", "[3.0,", "3.0]"], ran.stdout + ran.stderr
    # What --no-deps leaves to the check: a closure wheel gone is named by it.
    assert _run_uv("pip", "uninstall", "repro-colors", python=python, cache=cache).returncode == 0
    broken = _run_uv("pip", "check", python=python, cache=cache)
    assert broken.returncode != 0 and "requires `repro-colors" in broken.stderr, broken.stderr

    # A venv that sees torch only through its base (here a .pth; uv reads neither that nor --system-site-packages):
    # uv installs the same, and its check finds no torch (pip's, run with that venv's python, would find it).
    over = tmp_path / "over-the-base"
    venv.EnvBuilder(with_pip=False).create(over)
    next(over.glob("lib/python3*/site-packages")).joinpath("_base.pth").write_text(
        str(next((tmp_path / "node").glob("lib/python3*/site-packages"))) + "\n"
    )
    res = _run_uv(*documented, "--no-deps", *hashed, python=over / "bin" / "python", cache=cache)
    assert res.returncode == 0, res.stdout + res.stderr
    blind = _run_uv("pip", "check", python=over / "bin" / "python", cache=cache)
    assert blind.returncode != 0 and "requires `torch==" in blind.stderr, blind.stderr


def test_uv_installs_the_tool_from_tool_wheels(tmp_path: Path) -> None:
    """The tool from a mirror's tool/ with uv: a venv by ``uv venv``, the hash-pinned wheels by ``uv pip install``,
    offline; `reprostack` runs and ``uv pip check`` passes. An altered wheel is refused before its code runs."""
    ws = Workspace(root=tmp_path / "ws", cache=tmp_path / "cache", index_url="http://127.0.0.1:9/simple")
    ws.root.mkdir()
    ws.lock.write_text(EMPTY_LOCK)
    mirror = tmp_path / "mirror"
    ws.doit("mirror", f"mirror={mirror}")
    tool, cache = mirror / "tool", tmp_path / "uv-cache"
    base = Path(getattr(sys, "_base_executable", sys.executable))

    def install(node: Path, wheels: Path) -> subprocess.CompletedProcess[str]:
        made = _run_uv("venv", "--offline", "--python", str(base), str(node), python=base, cache=cache)
        assert made.returncode == 0, made.stdout + made.stderr
        return _run_uv(
            *("pip", "install", "--offline", "--no-index", "--find-links", str(wheels)),
            *("--require-hashes", "-r", str(wheels / "requirements.txt")),
            python=node / "bin" / "python",
            cache=cache,
        )

    node = tmp_path / "node"
    res = install(node, tool)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not (node / "bin" / "pip").exists()  # uv's venv: the tool needs no pip
    run = subprocess.run(
        [str(node / "bin" / "reprostack"), "--version"], capture_output=True, text=True, timeout=120, check=True
    )
    assert run.stdout.startswith(f"reprostack {importlib.metadata.version('reprostack')} "), run.stdout
    check = _run_uv("pip", "check", python=node / "bin" / "python", cache=cache)
    assert check.returncode == 0 and "All installed packages are compatible" in check.stderr, check.stderr

    altered = tmp_path / "altered"
    shutil.copytree(tool, altered)
    (doit_wheel,) = altered.glob("doit-*.whl")
    marker = tmp_path / "altered-code-ran"
    _alter(doit_wheel, "doit/__init__.py", f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')")
    refused = install(tmp_path / "node2", altered)
    assert refused.returncode != 0 and "doit" in refused.stderr and "Hash mismatch" in refused.stderr, refused.stderr
    assert not marker.exists(), "the altered wheel's code ran on the node"
