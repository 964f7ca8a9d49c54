"""The toolchain probe and the part of it that enters the action key."""

from __future__ import annotations

import os
import shlex
import shutil
import sysconfig
from pathlib import Path

import pytest

from tasks.env.toolchain import description, fingerprint, probe


def _dist(site: Path, name: str, version: str) -> None:
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_probe_reports_the_copy_the_interpreter_imports(tmp_path: Path) -> None:
    # A venv made with --system-site-packages sees its own copy first and the system's behind it
    # (setuptools 80.9 in the venv, 65.5 in the system): the build imports the first, so the
    # build-requirement check must see that one, not the last one listed.
    first, behind = tmp_path / "venv-site", tmp_path / "system-site"
    _dist(first, "reprostack_probe_fixture", "2.0")
    _dist(behind, "reprostack_probe_fixture", "1.0")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(first), str(behind)])}
    assert probe(env)["dists"]["reprostack-probe-fixture"] == "2.0"


def _info(ninja: str, nvcc_path: str = "/opt/cuda-13.0/bin/nvcc") -> dict[str, object]:
    return {
        "python": {"python": "3.12.3", "soabi": "cpython-312-x86_64-linux-gnu", "platform": "linux-x86_64"},
        "tools": {
            "cc": "cc 12",
            "cxx": "c++ 12",
            "cmake": "cmake 3.28",
            "ninja": ninja,
            "nvcc": "Cuda compilation tools, release 13.0, V13.0.88",
            "nvcc_path": nvcc_path,
        },
        "cudnn": {"version": "9.10.2", "path": "/usr"},
    }


def test_ninja_is_recorded_but_not_keyed() -> None:
    # Activating the venv put ninja 1.13 in front of the system's 1.11 and rebuilt every package.
    old, new = _info("1.11.1"), _info("1.13.0")
    assert fingerprint(old, cuda=True) == fingerprint(new, cuda=True)
    assert description(old)["ninja"] == "1.11.1" and description(new)["ninja"] == "1.13.0"


def test_the_nvcc_used_is_keyed_by_its_resolved_path() -> None:
    a, b = _info("1.13.0"), _info("1.13.0", nvcc_path="/opt/cuda-13.0-other/bin/nvcc")
    assert fingerprint(a, cuda=True) != fingerprint(b, cuda=True)
    assert fingerprint(a) == fingerprint(b)  # a package without CUDA is keyed without nvcc


def test_a_cpu_torch_is_refused_for_a_cuda_package_before_it_builds() -> None:
    """One clear line, without [toolchain] torch_cuda, instead of a NameError deep in upstream's setup.py."""
    from tasks.env.toolchain import toolchain_problems, torch_requirement
    from tasks.lock.lockfile import Toolchain

    info = {"python": {"python": "3.12.3", "torch": {"version": "2.11.0+cpu", "cuda": None, "cxx11_abi": True}},
            "tools": {"nvcc": "Cuda compilation tools, release 13.0, V13.0.88"}}  # fmt: skip
    problems = toolchain_problems(Toolchain(), info, torch=True, cuda=True)
    assert len(problems) == 1 and "torch 2.11.0+cpu is a CPU build (torch.version.cuda is None)" in problems[0]
    assert toolchain_problems(Toolchain(), info, torch=True, cuda=False) == []  # a C++ torch extension: fine
    assert torch_requirement(info) == "torch==2.11.0+cpu"


def test_a_compiler_setuptools_runs_is_keyed_where_it_is_another_program_than_cc(tmp_path: Path) -> None:
    # Debian's python3 compiles with sysconfig's CC, x86_64-linux-gnu-gcc, not with cc; where the host's cc
    # is another compiler (update-alternatives to clang; here a wrapper), the key must name both.
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    same, other = tmp_path / "same", tmp_path / "other"
    for d in (same, other):
        d.mkdir()
    for name in ("cc", "c++"):
        (same / name).symlink_to(os.path.realpath(gcc if name == "cc" else shutil.which("g++") or gcc))
        (other / name).write_text(f'#!/bin/sh\nexec {shlex.quote(gcc)} "$@"\n')
        (other / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX", "CUDAHOSTCXX")}
    keyed_same = fingerprint(probe({**base, "PATH": f"{same}{os.pathsep}{base['PATH']}"}))
    keyed_other = fingerprint(probe({**base, "PATH": f"{other}{os.pathsep}{base['PATH']}"}))
    assert "compilers" not in keyed_same  # cc and c++ are the compilers setuptools and nvcc run: keys as before
    sysconfig_cc = sysconfig.get_config_var("CC").split()[0]
    assert keyed_other["compilers"][sysconfig_cc].startswith(sysconfig_cc), keyed_other


def test_the_torch_pin_is_the_installed_distributions_version_not_torch_version() -> None:
    """PyPI's CUDA wheels (and the H100 host's torch) install as 2.11.0 while torch.__version__ says
    2.11.0+cu130: a Requires-Dist on the latter is one pip finds no torch for (seen on that host)."""
    from tasks.env.toolchain import torch_requirement

    # the shape probe() returns: the interpreter's findings under "python", its distributions beside them
    info = {"python": {"torch": {"version": "2.11.0+cu130", "cuda": "13.0"}}, "dists": {"torch": "2.11.0"}}
    assert torch_requirement(info) == "torch==2.11.0"
    info["dists"] = {"torch": "2.11.0+cu130"}  # the PyTorch index's wheels carry the label
    assert torch_requirement(info) == "torch==2.11.0+cu130"


def test_the_probe_pins_the_torch_distribution_pip_sees(tmp_path: Path) -> None:
    """End to end through the real probe: a torch whose module says 9.9.9+cu999 and whose distribution (the
    METADATA pip reads) says 9.9.9, first on PYTHONPATH, is pinned as pip will see it."""
    from tasks.env.toolchain import probe, torch_requirement

    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "__version__ = '9.9.9+cu999'\nclass version:\n    cuda = '99.9'\n    git_version = ''\n"
        "class _C:\n    _GLIBCXX_USE_CXX11_ABI = True\n"
    )
    (tmp_path / "torch-9.9.9.dist-info").mkdir()
    (tmp_path / "torch-9.9.9.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 9.9.9\n")
    info = probe({**os.environ, "PYTHONPATH": str(tmp_path)})
    assert info["python"]["torch"]["version"] == "9.9.9+cu999"
    assert torch_requirement(info) == "torch==9.9.9"
