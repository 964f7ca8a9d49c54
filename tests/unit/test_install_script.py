"""docker/install-wheels.sh, the image's install, run here outside any container (tests/integration/test_image.py
runs it in the base with docker): uv installs the wheels where the base has it on PATH, pip where it has not.

The "base" is this host's interpreter behind a ``python3`` without pip or ensurepip (a Debian base without
python3-venv, as uv-only images are), on a PATH of the few tools the script runs, and the real uv where given.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO, require
from fake_wheels import make_wheel

SCRIPT = REPO / "docker" / "install-wheels.sh"
MESSAGE = b'MESSAGE = "from the wheelhouse"\n'


def _uv() -> str:
    try:
        import uv
    except ImportError:
        require("uv is not installed (pip install uv, pinned in the test extra)")
    return uv.find_uv_bin()


def _base(tmp_path: Path, uv: str | None) -> Path:
    """The bin/ of the base: its python3, the tools the script runs, and uv where given."""
    bin_dir = tmp_path / "base-bin"
    bin_dir.mkdir()
    for tool in ("cat", "env", "ls", "mktemp", "rm"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    if uv:
        (bin_dir / "uv").symlink_to(uv)
    real = getattr(sys, "_base_executable", sys.executable)
    python = bin_dir / "python3"
    python.write_text(
        "#!/bin/sh\n"
        "# no pip, no ensurepip: `-m venv` works only --without-pip, as on a Debian base without python3-venv\n"
        'for a in "$@"; do [ "$a" = --without-pip ] && exec ' + f'"{real}"' + ' "$@"; done\n'
        'case "$1 $2" in "-m venv"|"-m pip"|"-m ensurepip") echo "python3: no pip in this base" >&2; exit 1;; esac\n'
        f'exec "{real}" "$@"\n'
    )
    python.chmod(0o755)
    return bin_dir


def _wheelhouse(tmp_path: Path) -> Path:
    wheels = tmp_path / "wheels"
    wheel = make_wheel(wheels, "demo", "1.0", "py3-none-any", {"demo/__init__.py": MESSAGE})
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (wheels / "requirements.txt").write_text(f"demo==1.0 --hash=sha256:{digest}\n")
    return wheels


def _install(bin_dir: Path, prefix: Path, wheels: Path, cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(bin_dir), "HOME": str(cwd), "SOURCE_DATE_EPOCH": "315532800", **extra}
    return subprocess.run(
        ["/bin/sh", str(SCRIPT), str(bin_dir / "python3"), str(prefix), str(wheels)],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _steps(output: str) -> list[str]:
    return [line.removeprefix("reprostack: step ") for line in output.splitlines() if line.startswith("reprostack: ")]


def test_uv_installs_where_the_base_has_it_the_same_bytes_every_time(tmp_path: Path) -> None:
    """uv on the base's PATH: uv installs the hash-pinned wheels into the venv, no pip needed, with none of the base's
    own uv settings (a UV_CONSTRAINT and a uv.toml that would refuse the wheel are left out), and two runs give
    the same files byte for byte, .pyc included."""
    bin_dir, wheels = _base(tmp_path, _uv()), _wheelhouse(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "uv.toml").write_text('[pip]\nno-binary = [":all:"]\n')
    (cwd / "constraints.txt").write_text("demo==2.0\n")
    prefix = tmp_path / "opt" / "venv"
    runs = []
    for _ in range(2):
        res = _install(bin_dir, prefix, wheels, cwd, UV_CONSTRAINT=str(cwd / "constraints.txt"))
        out = res.stdout + res.stderr
        assert res.returncode == 0, out
        steps = _steps(res.stdout)
        assert "uv pip install --no-index --require-hashes -r requirements.txt" in steps, out
        assert not any(s.startswith("pip install") for s in steps), out
        assert "demo==1.0" in res.stdout.splitlines(), out  # the listing, by uv
        runs.append(_files(prefix))
        shutil.move(prefix, tmp_path / f"run{len(runs)}")
    assert runs[0] == runs[1], sorted(k for k in runs[0].keys() | runs[1].keys() if runs[0].get(k) != runs[1].get(k))
    site = next(Path("lib").joinpath(p.name, "site-packages") for p in (tmp_path / "run1" / "lib").iterdir())
    assert runs[0][str(site / "demo" / "__init__.py")] == MESSAGE
    assert runs[0][str(site / "demo-1.0.dist-info" / "INSTALLER")].strip() == b"uv"
    (pyc,) = [k for k in runs[0] if k.startswith(str(site / "demo" / "__pycache__"))]
    assert int.from_bytes(runs[0][pyc][4:8], "little") & 0b11 == 0b11, pyc  # checked-hash, from compileall
    shutil.move(tmp_path / "run1", prefix)
    ran = subprocess.run(
        [str(prefix / "bin" / "python"), "-c", "import demo; print(demo.MESSAGE)"],
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert ran.stdout.strip() == "from the wheelhouse"


def test_pip_installs_where_the_base_has_no_uv(tmp_path: Path) -> None:
    """No uv on the base's PATH: pip's step, as before (this base has no pip, so it stops there, naming it)."""
    res = _install(_base(tmp_path, None), tmp_path / "venv", _wheelhouse(tmp_path), tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert _steps(res.stdout)[-1] == "pip install --no-index --require-hashes -r requirements.txt", out
    assert "no pip in this base" in res.stderr and not any(s.startswith("uv ") for s in _steps(res.stdout)), out
