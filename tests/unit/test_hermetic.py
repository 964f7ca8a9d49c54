"""The hermetic toolchain's pure parts: the set's identity, the build environment, the key."""

from __future__ import annotations

from pathlib import Path

from tasks.hermetic import Hermetic, install_command, key_section, set_sha256
from tasks.keys import key_document
from tasks.lockfile import Package, Source, WheelPin

NVCC = WheelPin(name="nvidia-cuda-nvcc", version="13.0.88", hashes=("a" * 64,))
NVVM = WheelPin(name="nvidia-nvvm", version="13.0.88", hashes=("b" * 64,))


def test_set_hash_ignores_order_and_changes_with_any_pin() -> None:
    assert set_sha256([NVCC, NVVM]) == set_sha256([NVVM, NVCC])
    other = WheelPin(name="nvidia-nvvm", version="13.0.88", hashes=("c" * 64,))
    assert set_sha256([NVCC, other]) != set_sha256([NVCC, NVVM])
    assert key_section([NVVM, NVCC])["requirements"] == [NVCC.requirement(), NVVM.requirement()]


def test_env_puts_the_hermetic_cuda_first_and_hides_the_hosts() -> None:
    tc = Hermetic(root=Path("/cache/toolchains/x"), sha256="x")
    env = tc.env(
        {"PATH": "/usr/local/cuda/bin:/usr/bin", "CUDA_HOME": "/usr/local/cuda", "NVCC": "/usr/local/cuda/bin/nvcc"}
    )
    assert env["PATH"] == "/cache/toolchains/x/site/nvidia/cu13/bin:/usr/local/cuda/bin:/usr/bin"
    assert env["CUDA_HOME"] == env["CUDA_PATH"] == "/cache/toolchains/x/site/nvidia/cu13"
    assert "NVCC" not in env
    assert env["PYTHONPATH"] == "/cache/toolchains/x/site"
    assert tc.env({"PATH": "/usr/bin", "PYTHONPATH": "/a"})["PYTHONPATH"] == "/cache/toolchains/x/site:/a"


def test_install_is_hash_checked_and_offline_from_a_mirror(tmp_path: Path) -> None:
    cmd = install_command(Path("req.txt"), Path("site"), mirror=None)
    assert {"--require-hashes", "--no-deps", "--only-binary=:all:"} <= set(cmd)
    assert "--no-index" not in cmd
    (tmp_path / "wheels").mkdir()
    cmd = install_command(Path("req.txt"), Path("site"), mirror=tmp_path)
    assert cmd[-3:] == ["--no-index", "--find-links", str(tmp_path / "wheels")]


def test_action_key_covers_the_hermetic_set_only_when_there_is_one() -> None:
    pkg = Package(name="p", source="s")
    sources = {"s": Source(name="s", kind="url", tree_sha256="d" * 64)}
    kw = {"sources": sources, "patches": [], "toolchain": {}, "archs": ["sm_90a"], "build_requires": {}}
    assert "hermetic_toolchain" not in key_document(pkg, **kw)  # type: ignore[arg-type]
    doc = key_document(pkg, **kw, hermetic=key_section([NVCC]))  # type: ignore[arg-type]
    assert doc["hermetic_toolchain"]["sha256"] == set_sha256([NVCC])
