"""The hermetic toolchain: the set's identity, the build environment, the key; lock and mirror on a file:// index."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from fake_wheels import make_wheel, publish_fake_toolchain, write_simple_index
from fake_wheels import sha256 as file_sha

from tasks.cli.lockcmd import lock_hermetic
from tasks.core.errors import LockError, VerificationError
from tasks.env.hermetic import Hermetic, install_command, key_section, mirror_wheels, set_sha256, wheel_fits
from tasks.lock import pypi
from tasks.lock.keys import key_document
from tasks.lock.lockfile import Package, Source, WheelPin, load_lock
from tasks.store.cache import Cache

NVCC = WheelPin(name="nvidia-cuda-nvcc", version="13.0.88", hashes=("a" * 64,))
NVVM = WheelPin(name="nvidia-nvvm", version="13.0.88", hashes=("b" * 64,))


def test_set_hash_ignores_order_and_changes_with_any_pin() -> None:
    assert set_sha256([NVCC, NVVM]) == set_sha256([NVVM, NVCC])
    other = WheelPin(name="nvidia-nvvm", version="13.0.88", hashes=("c" * 64,))
    assert set_sha256([NVCC, other]) != set_sha256([NVCC, NVVM])
    assert key_section([NVVM, NVCC])["requirements"] == [NVCC.requirement(), NVVM.requirement()]


def test_env_puts_the_hermetic_cuda_first_and_hides_the_hosts(tmp_path: Path) -> None:
    root = tmp_path / "toolchains" / "x"
    tc = Hermetic(root=root, sha256="x")
    host = {"PATH": "/usr/local/cuda/bin:/usr/bin", "CUDA_HOME": "/usr/local/cuda", "NVCC": "/usr/local/cuda/bin/nvcc"}
    # A toolchain of wheel sources only (a pinned torch, no CUDA wheels): the host's CUDA stays.
    assert tc.env(host) == {**host, "PYTHONPATH": str(root / "site")}
    tc.nvcc.parent.mkdir(parents=True)
    tc.nvcc.write_text("")
    env = tc.env(host)
    assert env["PATH"] == f"{root}/site/nvidia/cu13/bin:/usr/local/cuda/bin:/usr/bin"
    assert env["CUDA_HOME"] == env["CUDA_PATH"] == f"{root}/site/nvidia/cu13"
    assert "NVCC" not in env
    assert env["PYTHONPATH"] == f"{root}/site"
    assert tc.env({"PATH": "/usr/bin", "PYTHONPATH": "/a"})["PYTHONPATH"] == f"{root}/site:/a"


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


# --------------------------------------------------------------------------- doit lock, doit mirror (a file:// index)


@pytest.mark.parametrize(
    ("filename", "python", "fits"),
    [
        ("x-1.0-py3-none-manylinux_2_17_x86_64.whl", ">=3.10", True),
        ("x-1.0-py3-none-manylinux2014_aarch64.manylinux_2_17_aarch64.whl", ">=3.10", True),
        ("x-1.0-py3-none-manylinux1_x86_64.whl", "", True),
        ("x-1.0-py3-none-any.whl", "", True),
        ("x-1.0-py2.py3-none-any.whl", "", True),
        ("x-1.0-py2-none-any.whl", "", False),
        ("x-1.0-py3-none-win_amd64.whl", "", False),
        ("x-1.0-py3-none-macosx_11_0_arm64.whl", "", False),
        ("x-1.0-py3-none-musllinux_1_2_x86_64.whl", "", False),
        ("x-1.0-py3-none-manylinux_2_17_ppc64le.whl", "", False),
        ("x-1.0-cp39-cp39-manylinux_2_17_x86_64.whl", ">=3.10", False),
        ("x-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", ">=3.10", True),
        ("x-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", "==3.12.*", False),
        ("x-1.0-cp39-abi3-manylinux_2_17_x86_64.whl", ">=3.10", True),
        ("x-1.0-cp313-abi3-manylinux_2_17_x86_64.whl", "<3.12", False),
        ("x-1.0-cp313-cp313t-manylinux_2_17_x86_64.whl", "", False),
        ("x-1.0-pp310-pypy310_pp73-manylinux_2_17_x86_64.whl", "", False),
        ("x-1.0-py312-none-any.whl", ">=3.10", True),
        ("x-1.0-py313-none-any.whl", "<3.13", False),
        ("x-1.0+cu130-py3-none-manylinux_2_28_x86_64.whl", "", True),  # pip's ==1.0 takes a local label too
        ("x-1.0.0-py3-none-any.whl", "", True),
        ("x-1.0rc1-py3-none-any.whl", "", False),
        ("x-1.1-py3-none-any.whl", "", False),
        ("y-1.0-py3-none-any.whl", "", False),
        ("x-1.0.tar.gz", "", False),
    ],
)
def test_which_wheels_doit_lock_hashes(filename: str, python: str, fits: bool) -> None:
    assert wheel_fits(filename, project="x", version="1.0", python=python) is fits


LOCK = """\
# a lock with comments that `doit lock` keeps
format = 1

[toolchain]
python = ">=3.10"
archs = ["sm_90a"]

[toolchain.hermetic]
requirements = [
  "fake-cuda-tool==1.0",  # the tool
  # the runtime, listed without #sha256= fragments
  "Fake_Cuda_RT==2.0",
]

[sources]

[packages]
"""


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, dict[str, Path]]:
    """A file:// index of the fake toolchain, as the one pip is configured with."""
    root = tmp_path / "index"
    wheels = publish_fake_toolchain(root)
    monkeypatch.setattr(pypi, "pip_indexes", lambda: [(root / "simple").as_uri()])
    return root, wheels


def _pin(name: str, version: str, *files: Path) -> WheelPin:
    return WheelPin(name=name, version=version, hashes=tuple(sorted(file_sha(f) for f in files)))


def _hashes(text: str) -> list[list[str]]:
    """The --hash values of each requirement line of a lock text, in order."""
    reqs = tomllib.loads(text)["toolchain"]["hermetic"]["requirements"]
    return [[h.removeprefix("--hash=sha256:") for h in r.split()[1:]] for r in reqs]


def test_lock_fills_the_hashes_of_exact_pins_and_keeps_the_layout(
    tmp_path: Path, index: tuple[Path, dict[str, Path]]
) -> None:
    root, wheels = index
    lock = tmp_path / "hermetic.lock"
    lock.write_text(LOCK)
    report = lock_hermetic(lock, Cache(tmp_path / "cache"), update=())
    text = lock.read_text()
    tool = sorted([file_sha(wheels["x86_64"]), file_sha(wheels["aarch64"])])
    assert _hashes(text) == [tool, [file_sha(wheels["rt"])]]
    # Only the requirement strings changed: comments, spelling and layout stay.
    assert re.sub(r" --hash=sha256:[0-9a-f]{64}", "", text) == LOCK
    assert f"  {wheels['x86_64'].name}  sha256:{file_sha(wheels['x86_64'])}" in report
    assert "hermetic fake-cuda-rt==2.0: 1 wheel" in report
    assert all(p.hashes for p in load_lock(lock).toolchain.hermetic)

    # Pinned requirements are left alone, unless update=hermetic (or all) asks.
    extra = make_wheel(root / "files", "fake-cuda-tool", "1.0", "py3-none-manylinux_2_28_x86_64", {"a": b""})
    write_simple_index(
        root, {"fake-cuda-tool": [wheels["x86_64"].name, wheels["aarch64"].name, extra.name]}, no_fragments=()
    )
    report = lock_hermetic(lock, Cache(tmp_path / "cache"), update=())
    assert report[0] == "hermetic fake-cuda-tool==1.0: pinned (2 hashes)"
    assert lock.read_text() == text
    lock_hermetic(lock, Cache(tmp_path / "cache"), update=("hermetic",))
    assert _hashes(lock.read_text())[0] == sorted([*tool, file_sha(extra)])


@pytest.mark.parametrize(
    ("requirement", "message"),
    [
        ("fake-cuda-toool==1.0", "fake-cuda-toool==1.0: no project 'fake-cuda-toool' on the package index"),
        ("fake-cuda-tool==9.9", "fake-cuda-tool==9.9: the package index has no file of version 9.9"),
        ("fake-win-only==1.0", "fake-win-only==1.0: no wheel for Linux x86_64 or aarch64 (manylinux) and Python >="),
        ("fake-cuda-tool>=1.0", "'fake-cuda-tool>=1.0' needs one exact version, 'fake-cuda-tool==<version>'"),
    ],
)
def test_lock_errors_name_the_requirement_and_leave_the_lock_as_it_was(
    tmp_path: Path, index: tuple[Path, dict[str, Path]], requirement: str, message: str
) -> None:
    lock = tmp_path / "hermetic.lock"
    lock.write_text(LOCK.replace('"fake-cuda-tool==1.0"', f'"{requirement}"'))
    before = lock.read_bytes()
    with pytest.raises(LockError) as err:
        lock_hermetic(lock, Cache(tmp_path / "cache"), update=())
    assert message in str(err.value)
    assert lock.read_bytes() == before


def test_a_hashless_pin_is_unpinned_until_doit_lock(tmp_path: Path) -> None:
    lock = tmp_path / "hermetic.lock"
    lock.write_text(LOCK)
    (rt, _tool) = load_lock(lock, require_pins=False).toolchain.hermetic
    assert (rt.name, rt.version, rt.hashes) == ("fake-cuda-rt", "2.0", ())
    with pytest.raises(LockError, match=r"'fake-cuda-tool==1.0' has no --hash=sha256:\.\.\. \(run `doit lock`"):
        load_lock(lock)


def test_mirror_copies_exactly_the_pinned_files_and_checks_them(
    tmp_path: Path, index: tuple[Path, dict[str, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    root, wheels = index
    pins = [_pin("fake-cuda-tool", "1.0", wheels["x86_64"], wheels["aarch64"])]
    pins.append(_pin("fake-cuda-rt", "2.0", wheels["rt"]))
    mirror = tmp_path / "mirror"
    lines = list(mirror_wheels(pins, python=">=3.10", mirror=mirror))
    got = sorted(p.name for p in (mirror / "wheels").iterdir())
    assert got == sorted(wheels[k].name for k in ("x86_64", "aarch64", "rt"))
    assert all((mirror / "wheels" / n).read_bytes() == (root / "files" / n).read_bytes() for n in got)
    assert len(lines) == 3 and all(line.endswith("(downloaded)") for line in lines)
    assert [p.name for p in mirror.iterdir()] == ["wheels"]  # no staging folder left

    # A second run finds every file in the mirror and does not ask the index.
    monkeypatch.setattr(pypi, "pip_indexes", lambda: pytest.fail("the index was asked"))
    assert all(line.endswith("(present)") for line in mirror_wheels(pins, python=">=3.10", mirror=mirror))


def test_mirror_refuses_a_file_that_is_not_the_pinned_one_and_adds_nothing(
    tmp_path: Path, index: tuple[Path, dict[str, Path]]
) -> None:
    root, wheels = index
    pin = _pin("fake-cuda-tool", "1.0", wheels["x86_64"], wheels["aarch64"])
    rt = _pin("fake-cuda-rt", "2.0", wheels["rt"])
    mirror = tmp_path / "mirror"
    # The index still lists the pinned sha256, but serves other bytes.
    wheels["aarch64"].write_bytes(wheels["aarch64"].read_bytes() + b"tampered")
    tampered = rf"{wheels['aarch64'].name} downloaded with sha256 [0-9a-f]{{64}}, but the lock"
    with pytest.raises(VerificationError, match=tampered):
        list(mirror_wheels([rt, pin], python=">=3.10", mirror=mirror))
    assert [p.name for p in mirror.iterdir()] == []  # not even the runtime's good wheel, no staging folder
    # The index lists (and serves) another file: no file has the pinned hash.
    write_simple_index(root, {"fake-cuda-tool": [wheels["x86_64"].name, wheels["aarch64"].name]})
    with pytest.raises(VerificationError, match=r"no file on the package index has the pinned sha256"):
        list(mirror_wheels([rt, pin], python=">=3.10", mirror=mirror))
    assert [p.name for p in mirror.iterdir()] == []
