"""`doit preflight` (tasks/outside/preflight.py): each check against fixtures: a fake libcuda compiled here, fixture
wheels with other archs and tags, fixture interpreters holding a torch of another version, CUDA or ABI.

The checker runs as the node runs it: the shipped copy, standalone, in a directory of its own, under a
plain interpreter, with the fake driver found through LD_LIBRARY_PATH."""

from __future__ import annotations

import ast
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, require
from fake_wheels import make_wheel

from tasks.outside import preflight
from tasks.store.wheelnorm import normalize_wheel

SOURCE = REPO / "tasks" / "outside" / "preflight.py"
TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"
PLATFORM = f"linux_{platform.machine()}"


@pytest.fixture(scope="session")
def fake_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding libcuda.so.1, compiled from tests/fixtures/fake_libcuda.c."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        require("no C compiler (gcc): the test compiles a fake libcuda.so.1")
    out = tmp_path_factory.mktemp("driver")
    src = REPO / "tests" / "fixtures" / "fake_libcuda.c"
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(out / "libcuda.so.1"), str(src)], check=True)
    return out


def _site(prefix: Path) -> Path:
    return next(prefix.glob("lib/python*/site-packages"))


def _install(wheel: Path, site: Path) -> None:
    """A wheel unpacked into site-packages is what pip installs, for importlib.metadata and import."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)


def target(
    tmp: Path, *, torch: tuple[str, str | None, bool] | None, dists: dict[str, str] | None = None,
    torch_dist: str = "",
) -> Path:  # fmt: skip
    """An interpreter (a venv) whose torch is a fixture distribution named torch: (version, CUDA, C++11 ABI);
    ``torch_dist``: the distribution's version where it differs from ``torch.__version__`` (PyPI's CUDA torch
    is the distribution 2.11.0 whose ``__version__`` says 2.11.0+cu130)."""
    env = tmp / "target"
    venv.EnvBuilder(with_pip=False).create(env)
    site, files = _site(env), tmp / "dists"
    if torch is not None:
        version, cuda, abi = torch
        code = {
            "torch/__init__.py": f"from torch import version, _C\n__version__ = {version!r}\n".encode(),
            "torch/version.py": f"cuda = {cuda!r}\n".encode(),
            "torch/_C.py": f"_GLIBCXX_USE_CXX11_ABI = {abi!r}\n".encode(),
        }
        _install(make_wheel(files, "torch", torch_dist or version, "py3-none-any", code), site)
    for name, version in (dists or {}).items():
        _install(make_wheel(files, name, version, "py3-none-any", {f"{name}_mod.py": b""}), site)
    return env / "bin" / "python"


def house(
    tmp: Path, *, wheels: list[tuple[str, str, bool]], torch_pin: str = "", needs: tuple[str, ...] = (), **spec: Any
) -> Path:
    """A wheelhouse: (project, tag, cuda) wheels, each needing ``needs`` of the provided set, the shipped checker and
    preflight.json (``spec`` over defaults)."""
    out = tmp / "wheels"
    out.mkdir(parents=True)
    shutil.copy(SOURCE, out / "preflight.py")
    entries = []
    for project, tag, cuda in wheels:
        raw = make_wheel(tmp / "raw", project, "0.1.0", tag, {f"{project}/__init__.py": b""})
        normalize_wheel(raw, out / raw.name, requires=[f"torch=={torch_pin}"] if torch_pin else [])
        entries.append({"filename": raw.name, "package": project, "cuda": cuda, "origin": "built",
                        "needs": list(needs)})  # fmt: skip
    doc: dict[str, Any] = {
        "format": preflight.SPEC_FORMAT,
        "archs": ["sm_90a"],
        "build": {"cuda": "13.0", "torch": torch_pin, "torch_cuda": "13.0" if torch_pin else "",
                  "torch_cxx11_abi": True if torch_pin else None, "glibc": "2.17", "machine": platform.machine()},
        "provided": [],
        "wheels": entries,
    }  # fmt: skip
    for key, value in spec.items():
        if key in doc["build"]:
            doc["build"][key] = value
        else:
            doc[key] = value
    (out / "preflight.json").write_text(json.dumps(doc))
    return out


def run(
    wheels: Path, python: Path | None, driver: Path | None, *args: str, **env: str
) -> tuple[int, str, dict[str, Any]]:
    """The shipped checker as a node runs it, with ``args``; (exit status, output, JSON report)."""
    variables = {k: v for k, v in os.environ.items() if not k.startswith(("REPRO_", "FAKE_CUDA"))}
    variables["LD_LIBRARY_PATH"] = str(driver) if driver else ""
    if driver is None:
        variables["REPRO_LIBCUDA"] = str(wheels / "no-such-dir" / "libcuda.so.1")  # wherever this test runs
    variables.update(env)
    report = wheels.parent / "report.json"
    argv = [sys.executable, "-I", str(wheels / "preflight.py"), "--json", str(report)]
    res = subprocess.run([*argv, *args, *(["--python", str(python)] if python else [])], capture_output=True, text=True,
                         env=variables, cwd=wheels.parent, stdin=subprocess.DEVNULL, check=False)  # fmt: skip
    doc = json.loads(report.read_text()) if report.is_file() else {}
    return res.returncode, res.stdout + res.stderr, doc


def status(doc: dict[str, Any], name: str) -> str:
    return str(next(c["status"] for c in doc["checks"] if c["check"] == name))


def line(output: str, name: str) -> str:
    return next(ln for ln in output.splitlines() if ln[6:].startswith(name + " "))


def test_the_checker_is_standard_library_python_3_8() -> None:
    """It runs on the node's own Python: 3.8 syntax, standard library imports only."""
    tree = ast.parse(SOURCE.read_text(), feature_version=(3, 8))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported - {"__future__"} <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    for node in ast.walk(tree):  # no 3.9+ builtins used at run time (annotations are strings: __future__)
        if isinstance(node, ast.Attribute):
            assert node.attr not in ("removeprefix", "removesuffix", "is_relative_to"), node.attr


def test_without_a_driver_it_says_so_in_one_line(tmp_path: Path) -> None:
    wheels = house(tmp_path, wheels=[("ext", f"{TAG}-{TAG}-{PLATFORM}", True)])
    code, out, doc = run(wheels, None, None)
    assert code == preflight.EXIT_FAILED == 21
    said = [ln for ln in out.splitlines() if "no NVIDIA driver" in ln]
    assert len(said) == 1 and said[0].startswith("FAIL  driver")
    assert "needed: CUDA >= 13.0 (the wheels were built with CUDA 13.0)" in said[0]
    assert status(doc, "driver") == "FAIL" and status(doc, "gpu") == "SKIP" and doc["ok"] is False
    off = subprocess.run([sys.executable, "-I", str(wheels / "preflight.py"), "--gpu", "off"], capture_output=True,
                         text=True, check=False)  # fmt: skip
    assert off.returncode == 0 and "SKIP  driver    found: not asked (--gpu off)" in off.stdout  # a CPU-only node


def test_driver_and_gpus_against_the_build_cuda_and_the_sass_archs(tmp_path: Path, fake_driver: Path) -> None:
    wheels = house(tmp_path, wheels=[("ext", f"{TAG}-{TAG}-{PLATFORM}", True)])
    code, out, doc = run(wheels, None, fake_driver, FAKE_CUDA_VERSION="13000", FAKE_CUDA_GPUS="9.0,9.0")
    assert code == 0, out
    assert "found: CUDA 13.0 (driver API 13000" in line(out, "driver")
    assert "found: GPU 0 Fake GPU 0 sm_90; GPU 1 Fake GPU 1 sm_90; needed: SASS for it among the target archs sm_90a" \
        in line(out, "gpu")  # fmt: skip
    code, out, doc = run(wheels, None, fake_driver, FAKE_CUDA_VERSION="12080", FAKE_CUDA_GPUS="9.0")
    assert code == 21 and status(doc, "driver") == "FAIL" and "found: CUDA 12.8" in line(out, "driver")
    code, out, doc = run(wheels, None, fake_driver, FAKE_CUDA_VERSION="13000", FAKE_CUDA_GPUS="9.0,8.0")
    assert code == 21 and "do not run on GPU 1 Fake GPU 1 sm_80" in line(out, "gpu")
    code, out, doc = run(wheels, None, fake_driver, FAKE_CUDA_VERSION="13000", FAKE_CUDA_GPUS="10.0")
    assert code == 21 and status(doc, "gpu") == "FAIL"  # sm_90a: 9.0 only
    code, out, doc = run(wheels, None, fake_driver, FAKE_CUDA_VERSION="13000", FAKE_CUDA_GPUS="")
    assert code == 21 and "no GPU visible to the driver (cuInit: 100)" in line(out, "gpu")
    plain = house(tmp_path / "plain", wheels=[("ext", f"{TAG}-{TAG}-{PLATFORM}", True)], archs=["sm_90"])
    assert run(plain, None, fake_driver, FAKE_CUDA_VERSION="13000", FAKE_CUDA_GPUS="9.0")[0] == 0


@pytest.mark.parametrize(
    ("arch", "capability", "runs"),
    [("sm_90a", (9, 0), True), ("sm_90a", (10, 0), False), ("sm_90", (9, 0), True), ("sm_80", (8, 6), True),
     ("sm_80", (9, 0), False), ("sm_100f", (10, 3), True), ("sm_100a", (10, 3), False), ("sm_120", (10, 0), False)],
)  # fmt: skip
def test_which_sass_runs_on_which_gpu(arch: str, capability: tuple[int, int], runs: bool) -> None:
    assert preflight.runs_on(arch, capability) is runs


def test_python_and_glibc_against_the_wheels_tags(tmp_path: Path) -> None:
    wheels = house(
        tmp_path,
        wheels=[("ok", f"{TAG}-{TAG}-manylinux_2_17_{platform.machine()}", False), ("other", "cp39-cp39-linux_x86_64",
                False), ("newer", f"{TAG}-{TAG}-manylinux_2_99_{platform.machine()}", False)],
        archs=[],
    )  # fmt: skip
    code, out, doc = run(wheels, None, None)
    assert code == 21
    assert status(doc, "driver") == "SKIP"  # the lock names no GPU archs
    assert "no tag of theirs fits this interpreter: other-0.1.0-cp39-cp39-linux_x86_64.whl" in line(out, "python")
    assert "needed: glibc >= 2.99" in line(out, "glibc") and "too old for: newer-0.1.0" in line(out, "glibc")
    fits = house(tmp_path / "fits", wheels=[("ok", f"{TAG}-abi3-{PLATFORM}", False), ("pure", "py3-none-any", False)],
                 archs=[])  # fmt: skip
    code, out, doc = run(fits, None, None)
    assert code == 0 and status(doc, "python") == "PASS" and status(doc, "glibc") == "PASS", out


def test_the_installed_torch_against_the_wheels_pin(tmp_path: Path) -> None:
    pin = "2.11.0+cu130"
    wheels = house(tmp_path, wheels=[("ext", f"{TAG}-{TAG}-{PLATFORM}", False)], torch_pin=pin, archs=[])
    good = target(tmp_path / "good", torch=(pin, "13.0", True))
    code, out, _doc = run(wheels, good, None)
    assert code == 0, out
    assert "found: torch 2.11.0+cu130 (CUDA 13.0, C++11 ABI 1); needed: torch 2.11.0+cu130 (CUDA 13.0" in line(
        out, "torch"
    )
    cases = {
        "cpu": (("2.11.0+cpu", None, True), "version 2.11.0+cpu is not 2.11.0+cu130"),
        "cuda": ((pin, "12.8", True), "CUDA 12.8 is not 13.0"),
        "abi": ((pin, "13.0", False), "its C++ ABI differs"),
    }
    for name, (torch, said) in cases.items():
        code, out, _doc = run(wheels, target(tmp_path / name, torch=torch), None)
        assert code == 21 and said in line(out, "torch"), (name, out)
    code, out, _doc = run(wheels, target(tmp_path / "none", torch=None), None)
    assert code == 21 and "torch not installed for this interpreter" in line(out, "torch")


def test_a_pin_without_a_local_label_takes_pypis_cuda_torch_as_pip_does(tmp_path: Path) -> None:
    """The wheels pin the build torch's distribution version; PyPI's CUDA torch is the distribution 2.11.0
    whose __version__ is 2.11.0+cu130 (the GPU host's): pip takes it for ==2.11.0, and so does preflight.
    A CPU torch of that version still fails, on its CUDA; another version, on its version."""
    wheels = house(tmp_path, wheels=[("ext", f"{TAG}-{TAG}-{PLATFORM}", False)], torch_pin="2.11.0", archs=[])
    host = target(tmp_path / "host", torch=("2.11.0+cu130", "13.0", True), torch_dist="2.11.0")
    code, out, _doc = run(wheels, host, None)
    assert code == 0, out
    assert "found: torch 2.11.0+cu130, installed as 2.11.0 (CUDA 13.0, C++11 ABI 1)" in line(out, "torch")
    cases = {
        "cpu": (("2.11.0+cpu", None, True), "CUDA None is not 13.0"),
        "other": (("2.10.0", "13.0", True), "version 2.10.0 is not 2.11.0"),
        "short": (("2.11", "13.0", True), ""),
    }
    for name, (torch, said) in cases.items():
        code, out, _doc = run(wheels, target(tmp_path / name, torch=torch), None)
        assert (code == 21 and said in line(out, "torch")) if said else code == 0, (name, out)
        if name == "cpu":
            assert "version" not in line(out, "torch").split("--")[-1], out


def test_the_provided_set_fails_only_on_what_the_wheels_need(tmp_path: Path) -> None:
    """The captured base holds uv, which no wheel needs: a node without it passes, with a note (issue 38: a GPU
    node was refused for it). A node lacking what a wheel needs, or holding a version the requirements on the
    way refuse (torch's triton==3.6.0), fails, naming it and the wheel; another version they accept (setuptools,
    which torch requires without a version: a node was refused for 80.10.2 against the captured 81.0.0) is a
    note; --strict asks every provided distribution at its captured version, as the format 1 description did."""
    provided = ["triton==3.6.0", "nvidia-nccl", "uv==0.11.15", "setuptools==81.0.0"]
    wheels = house(tmp_path, wheels=[("pure", "py3-none-any", False)], archs=[], provided=provided,
                   needs=("triton==3.6.0", "nvidia-nccl", "setuptools"))  # fmt: skip
    node = target(tmp_path / "ok", torch=None, dists={"triton": "3.6.0", "nvidia-nccl": "2", "setuptools": "80.10.2"})
    code, out, doc = run(wheels, node, None)
    assert code == 0, out
    said = line(out, "provided")
    assert said.startswith("PASS  provided  found: triton 3.6.0, nvidia-nccl 2, setuptools 80.10.2; needed: the 3 of "
                           "the 4 provided"), said  # fmt: skip
    assert ("note: 2 other differences from the captured base, which the wheels' needs allow: uv not installed, "
            "setuptools is 80.10.2, not 81.0.0") in said, said  # fmt: skip
    assert status(doc, "provided") == "PASS" and doc["ok"] is True

    code, out, doc = run(wheels, node, None, "--strict")  # exact equality with the captured base
    assert code == 21 and "-- uv not installed" in line(out, "provided"), out

    code, out, _doc = run(wheels, target(tmp_path / "bad", torch=None, dists={"triton": "3.5.0"}), None)
    assert code == 21, out
    assert (
        "-- triton is 3.5.0, not ==3.6.0 (needed by pure-0.1.0-py3-none-any.whl); nvidia-nccl not installed "
        "(needed by pure-0.1.0-py3-none-any.whl); setuptools not installed (needed by"
    ) in line(out, "provided"), out

    spec = json.loads((wheels / "preflight.json").read_text())  # what an older wheelhouse says: no needs
    spec["format"] = 1
    for wheel in spec["wheels"]:
        del wheel["needs"]
    (wheels / "preflight.json").write_text(json.dumps(spec))
    code, out, _doc = run(wheels, node, None)
    assert code == 21 and "(format 1) -- uv not installed" in line(out, "provided"), out


def test_a_wheelhouse_without_its_description_is_exit_status_10(tmp_path: Path) -> None:
    shutil.copy(SOURCE, tmp_path / "preflight.py")
    res = subprocess.run([sys.executable, "-I", str(tmp_path / "preflight.py")], capture_output=True, text=True,
                         check=False)  # fmt: skip
    assert res.returncode == 10 and "cannot read the wheelhouse: No such file or directory: " in res.stderr


def _unreadable(wheels: Path) -> str:
    """The shipped checker on ``wheels``, as a node runs it, under a 1 GiB address space and a minute: what it
    says on stderr, after checking that it is exit status 10 and one line (a checker that reads /dev/zero to its
    end dies of MemoryError here, one that waits on a fifo is stopped)."""
    cmd = f"ulimit -v 1048576; exec {shlex.quote(sys.executable)} -I {shlex.quote(str(wheels / 'preflight.py'))}"
    try:
        res = subprocess.run(["bash", "-c", cmd + " --gpu off"], capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise AssertionError(f"preflight on {wheels} did not return in 120 s") from None
    assert res.returncode == 10, (res.returncode, res.stdout, res.stderr)
    assert len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("preflight: cannot read the wheelhouse: "), res.stderr
    return res.stderr


SHAPES = {
    "a list": ("[]", "not a JSON object but list"),
    "a string": ('"preflight"', "not a JSON object but str"),
    "format as text": ('{"format": "2"}', "format '2', this checker reads 1, 2"),
    "format true": ('{"format": true}', "format True"),
    "wheels an object": ('{"format": 2, "wheels": {"a.whl": {}}}', "wheels is not a list"),
    "a wheel a string": ('{"format": 2, "wheels": ["a-1-py3-none-any.whl"]}', "wheels[0] is not an object"),
    "a wheel /dev/zero": ('{"format": 2, "wheels": [{"filename": "/dev/zero"}]}',
                          "wheels[0].filename '/dev/zero' is not the file name of a wheel in the wheelhouse"),
    "a wheel out of it": ('{"format": 2, "wheels": [{"filename": "../../x-1-py3-none-any.whl"}]}',
                          "is not the file name of a wheel"),
    "needs a string": ('{"format": 2, "wheels": [{"filename": "x-1-py3-none-any.whl", "needs": "torch"}]}',
                       "wheels[0].needs is not a list of strings"),
    "a need not PEP 440": ('{"format": 3, "wheels": [{"filename": "x-1-py3-none-any.whl", "needs": ["pip~=1"]}]}',
                           "wheels[0].needs: 'pip~=1' is not a distribution's name with PEP 440 version specifiers"),
    "provided numbers": ('{"format": 2, "provided": [1]}', "provided is not a list of strings"),
    "provided a command": ('{"format": 2, "provided": ["torch; rm -rf /"]}', "is not 'name==version' or 'name'"),
    "build a list": ('{"format": 2, "build": []}', "build is not an object"),
    "cuda a number": ('{"format": 2, "build": {"cuda": 13}}', "build.cuda is not a string"),
    "archs a string": ('{"format": 2, "archs": "sm_90a"}', "archs is not a list of strings"),
    "nested archs": ('{"format": 2, "archs": ' + "[" * 100_000 + "]" * 100_000 + "}", "is nested too deeply"),
    "nested, cut short": ("[" * 1_000_000, "is nested too deeply"),
    "cut short": ('{"format": 2,', "is not JSON"),
    "not UTF-8": ("\udcff", "is not JSON"),
}  # fmt: skip


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_description_of_another_shape_is_one_line_and_exit_status_10(tmp_path: Path, shape: str) -> None:
    text, said = SHAPES[shape]
    wheels = house(tmp_path, wheels=[], archs=[])
    (wheels / "preflight.json").write_text(text, errors="surrogateescape")
    assert said in _unreadable(wheels)


def test_a_fifo_or_a_device_in_the_wheelhouse_is_refused_without_reading_it(tmp_path: Path) -> None:
    """The checker reads regular files only, and bounded: a fifo (no writer: an open would wait for ever), a link
    to /dev/zero (a read to its end never ends) or a file larger than the bound, as preflight.json or as a
    wheel it names, is refused in one line, before it is read."""
    wheels = house(tmp_path, wheels=[("pure", "py3-none-any", False)], archs=[])
    (wheel,) = wheels.glob("*.whl")
    spec = wheels / "preflight.json"
    spec.rename(wheels / "spec.json")
    os.mkfifo(spec)
    assert f"{spec} is a fifo, not a regular file" in _unreadable(wheels)
    spec.unlink()
    spec.symlink_to("/dev/zero")
    assert f"{spec} is a character device, not a regular file" in _unreadable(wheels)
    spec.unlink()
    with open(spec, "wb") as fh:  # sparse: larger than the bound, no disk used
        fh.truncate(preflight.MAX_SPEC_BYTES + 1)
    assert f"{spec} is larger than {preflight.MAX_SPEC_BYTES} bytes" in _unreadable(wheels)
    spec.unlink()
    (wheels / "spec.json").rename(spec)

    wheel.unlink()
    os.mkfifo(wheel)
    assert f"{wheel} is a fifo, not a regular file" in _unreadable(wheels)
    wheel.unlink()
    wheel.symlink_to("/dev/zero")
    assert f"{wheel} is a character device, not a regular file" in _unreadable(wheels)
    wheel.unlink()
    wheel.mkdir()
    assert f"{wheel} is a directory, not a regular file" in _unreadable(wheels)
    wheel.rmdir()
    wheel.write_bytes(b"not a zip")
    assert f"{wheel} is not a readable wheel (BadZipFile" in _unreadable(wheels)


@pytest.mark.parametrize(
    ("version", "specifier", "met"),
    [("4.16.0", ">=4.10.0", True), ("4.9", ">=4.10.0", False), ("2.11.0+cu130", "==2.11.0", True),
     ("2.11.1", "==2.11.*", True), ("2.12.0", "==2.11.*", False), ("1.4.5", "~=1.4.2", True), ("1.5", "~=1.4.2", False),
     ("1.13", "<1.4", False), ("1.3.9", "<1.4", True), ("3.0", "!=3.0.0", False), ("2.0", ">2", False),
     ("2.0.1", ">2", True), ("23.2.1", "~=22.0", False), ("22.9", "~=22.0", True), ("5.3", "~=1.0", False),
     ("23.2.1", "~=23.1.0", False), ("not-a-version", ">=0", False), ("not-a-version", "===Not-A-Version", True),
     # PEP 440 where packaging 26.2 is not: a compatible release's stem is its release numbers however its
     # pre-release is spelt (packaging keeps "0c1" in the stem of ~=1.0c1) or with a leading v (~=v1.4)
     ("1.5", "~=1.0c1", True), ("1.5", "~=v1.4", True)],
)  # fmt: skip
def test_which_versions_a_specifier_accepts(version: str, specifier: str, met: bool) -> None:
    assert preflight.satisfies(version, specifier) is met


#: Versions a node may hold: each operator's edges (trailing zeros, pre-, post- and dev releases of the specified
#: version, epochs, local labels), other spellings PEP 440 normalises, and one that is not a version at all.
VERSIONS = [
    "0.9", "1", "1.0", "1.0.0", "1.0.1", "1.1", "1.5", "2.0", "5.3",
    "1.0a1", "1.0rc2", "1.0.post1", "1.0.dev3", "1.0a1.post2.dev3", "1.0.post1.dev1", "1.0rc2.post1", "0.9.post1",
    "1.0-RC.2", "1.0-1", "v1.0", "1.0alpha1", "1!1.0", "1!0.5",
    "1.0+local.7", "1.0.post1+x", "1.0a1+x",
    "22.0", "22.9", "23.1.0", "23.1.7", "23.2.1",
    "2.11", "2.11.0", "2.11.0+cu130", "2.11.0+CU130", "2.11.0+cpu", "2.11.0rc1", "2.11.0.post1", "2.11.1", "2.12.0",
    "not-a-version",
]  # fmt: skip
#: Every operator, at the versions above.
SPECIFIERS = [
    "==1.0", "==1.0.0", "==1", "==1.0a1", "==1.0rc2", "==1.0.post1", "==1.0.dev3", "==1!1.0", "==1.0+local.7",
    "!=1.0", "!=1.0.post1", "!=1.0+local.7",
    "==1.*", "==1.0.*", "==1.0.0.*", "!=1.*", "!=2.*", "==1!1.*", "==0.*",
    "~=1.0", "~=1.0.0", "~=1.1", "~=1.0a1", "~=1.0.post1", "~=1.0.dev3", "~=22.0", "~=23.1.0", "~=1!1.0",
    ">=1.0", ">=1.0a1", ">=1.0.dev3", ">=1!0", "<=1.0", "<=1.0a1", "<=1.0.post1",
    ">1.0", ">1.0.post1", ">1.0a1", ">1.0.dev3", ">0.9", ">1!0.9",
    "<1.0", "<1.0rc2", "<1.0.post1", "<1.0.dev3", "<1.1", "<1!1.0",
    "==2.11.0", "==2.11", "==2.11.0+cu130", "==2.11.0+cpu", "!=2.11.0", "==2.11.*", "!=2.11.*", ">=2.11", "<=2.11.0",
    ">2.11.0", "<2.11.0", "<2.11.1", ">2.11", "~=2.11.0", "~=2.11",
    "===1.0", "===v1.0", "===2.11.0+cu130", "===not-a-version",
]  # fmt: skip


def test_satisfies_judges_as_packaging_does() -> None:
    """Every pair of a version a node may hold and a specifier is judged as pip check judges it: as
    ``packaging.specifiers.Specifier(specifier).contains(version, prereleases=True)`` (issue 55: ~=22.0 took 23.2.1).
    """
    from packaging.specifiers import Specifier

    pairs = [(v, s) for s in SPECIFIERS for v in VERSIONS]
    wrong = []
    for version, specifier in pairs:
        expected = Specifier(specifier).contains(version, prereleases=True)
        if preflight.satisfies(version, specifier) is not expected:
            wrong.append(f"{version} {specifier}: packaging says {expected}")
    assert not wrong, f"{len(wrong)} of {len(pairs)} pairs judged otherwise:\n" + "\n".join(wrong)


def test_versions_are_ordered_as_packaging_orders_them() -> None:
    from packaging.version import Version

    valid = [v for v in VERSIONS if v != "not-a-version"]
    assert sorted(valid, key=preflight.parse_version) == sorted(valid, key=Version)
    assert preflight.parse_version("not-a-version") is None


def test_version_matches_is_pips_double_equals() -> None:
    """The ``==pin`` rule (torch, captured versions) is PEP 440's: ``2.11.0`` takes ``2.11.0+cu130``, ``2.11`` is
    ``2.11.0``, ``2.11.0-RC1`` is ``2.11.0rc1``, a label is one label."""
    from packaging.specifiers import Specifier

    pins = ["2.11.0", "2.11", "2.11.0+cu130", "2.11.0+CPU", "2.11.0rc1", "2.11.0.post1", "1!2.11.0", "2.11.*"]
    installed = ["2.11.0", "2.11", "2.11.0.0", "2.11.0+cu130", "2.11.0+cpu", "2.11.0-RC1", "2.11.0rc1+cu130",
                 "2.11.0-1", "v2.11.0", "1!2.11.0", "2.11.1", "2.10.0+cu130"]  # fmt: skip
    pairs = [(have, pin) for pin in pins for have in installed]
    wrong = []
    for have, pin in pairs:
        if preflight.version_matches(have, pin) is not Specifier("==" + pin).contains(have, prereleases=True):
            wrong.append((have, pin))
    assert not wrong, f"{len(wrong)} of {len(pairs)} (installed, pin) pairs judged otherwise than packaging: {wrong}"
    assert preflight.version_matches("2.11.0_custom", "2.11.0_custom")  # not PEP 440: equal as written only
    assert not preflight.version_matches("2.11.0", "2.11.0_custom")


@pytest.mark.parametrize(
    "specifier", ["~=1", ">=1.0+cu130", "<1.*", "==1.0a1.*", "==1.*.*", "~=1.0+x", "=>1.0", "1.0", "==", "<>1", ""]
)
def test_a_specifier_that_is_not_pep_440_is_refused_as_packaging_refuses_it(specifier: str) -> None:
    from packaging.specifiers import InvalidSpecifier, Specifier

    with pytest.raises(InvalidSpecifier):
        Specifier(specifier)
    assert preflight.parse_specifier(specifier) is None
    with pytest.raises(ValueError, match="is not a PEP 440 version specifier"):
        preflight.satisfies("1.0", specifier)
    if not specifier or specifier[0] not in "=!~<>":
        return  # "pip1.0" and "pip" are names
    spec = {"format": 3, "wheels": [{"filename": "x-1-py3-none-any.whl", "needs": [f"pip{specifier}"]}]}
    with pytest.raises(preflight.Unreadable, match="is not a distribution's name with PEP 440 version specifiers"):
        preflight.check_spec(spec)


def test_a_compatible_release_refuses_the_next_major_on_the_node() -> None:
    """Issue 55: a wheelhouse needing pip~=22.0 passed a node holding pip 23.2.1. ~=22.0 is >=22.0, ==22.*."""
    needed = {"pip": (["ext-0.1.0-py3-none-any.whl"], ["~=22.0"])}
    node = {"version": [3, 12, 3], "dists": {"pip": "23.2.1"}}
    result = preflight.provided_check(["pip==22.3.1"], node, needed)
    assert result["status"] == "FAIL", result
    assert result["detail"].startswith("pip is 23.2.1, not ~=22.0 (needed by ext-0.1.0-py3-none-any.whl)"), result
    node["dists"] = {"pip": "22.9"}
    result = preflight.provided_check(["pip==22.3.1"], node, needed)
    assert result["status"] == "PASS" and "note: 1 other difference" in result["detail"], result


def test_the_shipped_checker_refuses_a_node_outside_a_compatible_release(tmp_path: Path) -> None:
    wheels = house(tmp_path, wheels=[("pure", "py3-none-any", False)], archs=[], provided=["pip==22.3.1"],
                   needs=("pip~=22.0",))  # fmt: skip
    code, out, doc = run(wheels, target(tmp_path / "node", torch=None, dists={"pip": "23.2.1"}), None)
    assert code == 21 and status(doc, "provided") == "FAIL" and "this node can take the wheels" not in out, out
    assert "-- pip is 23.2.1, not ~=22.0 (needed by pure-0.1.0-py3-none-any.whl)" in line(out, "provided"), out
