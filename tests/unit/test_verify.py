"""Unit tests of the verify stage's pure parts: report, parsers, ELF reading."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

from tasks.core.errors import ReproError, VerifyFailed
from tasks.core.proc import run
from tasks.store.manifest import normalize_arch, parse_manifest
from tasks.verify import checks, cuda, elfcheck, session
from tasks.verify.cuda import DeviceCode
from tasks.verify.report import Report, Row

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "tasks" / "outside" / "smoke"


# --------------------------------------------------------------------------- report


def _report() -> Report:
    return Report(
        rows=(
            Row(package="wheelhouse", check="install", status="PASS", detail="ok"),
            Row(package="repro_cuda", check="arch", status="FAIL", detail="x.so: no SASS for sm_80\nsecond line"),
            Row(package="repro_cuda", check="smoke:vadd", status="SKIP", detail="no CUDA device"),
            Row(package="repro_pure", check="import", status="PASS", detail="y" * 500),
        ),
        archs=("sm_90a",),
    )


def test_report_counts_and_ok() -> None:
    report = _report()
    assert (report.passed, report.failed, report.skipped) == (2, 1, 1)
    assert not report.ok
    assert report.summary() == "2 passed, 1 failed, 1 skipped"
    assert [r.check for r in report.failures()] == ["arch"]
    only_skips = Report(rows=(Row(package="p", check="smoke:x", status="SKIP", detail="no GPU"),))
    assert only_skips.ok


def test_report_render_is_a_fixed_width_table() -> None:
    text = _report().render(detail_width=60)
    lines = text.splitlines()
    assert lines[0].split() == ["package", "check", "status", "detail"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    # Columns line up: every row's status starts at the header's "status" column.
    col = lines[0].index("status")
    for line in lines[2:6]:
        assert line[col : col + 4] in {"PASS", "FAIL", "SKIP"}
    # Multi-line details are flattened; long ones are cut with an ellipsis.
    assert "no SASS for sm_80 | second line" in text
    long_line = next(line for line in lines if "yyy" in line)
    assert long_line.endswith("...") and len(long_line) - col <= 60 + 8
    assert lines[-1] == "2 passed, 1 failed, 1 skipped"


def test_report_json_round_trip() -> None:
    report = _report()
    data = json.loads(report.to_json())
    assert data["ok"] is False
    assert data["summary"] == {"passed": 2, "failed": 1, "skipped": 1}
    assert data["rows"][1] == {
        "package": "repro_cuda",
        "check": "arch",
        "status": "FAIL",
        "detail": "x.so: no SASS for sm_80\nsecond line",
    }
    assert Report.from_dict(data) == report


def test_run_verify_raises_verify_failed_with_report_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks, "verify_wheelhouse", lambda *a, **k: _report())
    with pytest.raises(VerifyFailed) as info:
        checks.run_verify(tmp_path / "wheels", tmp_path / "work")
    assert str(tmp_path / "work" / "report.txt") in str(info.value)
    assert "repro_cuda arch" in str(info.value)
    assert info.value.exit_code == VerifyFailed.exit_code


# --------------------------------------------------------------------------- manifest


def _manifest(**wheel: object) -> dict[str, object]:
    entry: dict[str, object] = {
        "package": "repro_cuda",
        "name": "repro-cuda",
        "version": "0.1.0",
        "filename": "repro_cuda-0.1.0-cp311-cp311-linux_x86_64.whl",
        "sha256": "0" * 64,
        "cuda": True,
        "verify": {"imports": ["repro_cuda", "repro_cuda._vadd"], "smoke": "repro_cuda"},
    }
    entry.update(wheel)
    return {"format": 1, "archs": ["sm_90a"], "wheels": [entry]}


def test_parse_manifest() -> None:
    manifest = parse_manifest(_manifest())
    assert manifest.archs == ("sm_90a",)
    (spec,) = manifest.wheels
    assert spec.imports == ("repro_cuda", "repro_cuda._vadd")
    assert spec.smoke == "repro_cuda" and spec.cuda


def test_parse_manifest_empty_imports_mean_default() -> None:
    (spec,) = parse_manifest(_manifest(verify={"imports": [], "smoke": None})).wheels
    assert spec.imports is None and spec.smoke is None


def test_parse_manifest_reports_every_problem() -> None:
    doc = _manifest(version="", verify={"imports": ["ok", "not a module"], "smoke": "../evil"})
    doc["archs"] = ["sm_90a", "banana"]
    with pytest.raises(ReproError) as info:
        parse_manifest(doc)
    message = str(info.value)
    assert "banana" in message and "missing version" in message


@pytest.mark.parametrize(
    ("given", "want"), [("sm_90a", "sm_90a"), ("compute_90a", "sm_90a"), ("90", "sm_90"), ("sm_100f", "sm_100f")]
)
def test_normalize_arch(given: str, want: str) -> None:
    assert normalize_arch(given) == want


def test_normalize_arch_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="not a CUDA architecture"):
        normalize_arch("hopper")


# --------------------------------------------------------------------------- cuobjdump

# Real output of cuobjdump 13.2 on a library built with
#   nvcc -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_80,code=compute_80 -cudart static
LIST_ELF = """\
ELF file    1: libk.1.sm_90a.cubin
ELF file    2: libk.2.sm_90a.cubin
"""
LIST_PTX = "PTX file    1: libk.1.sm_80.ptx\n"


def test_parse_cuobjdump_listing() -> None:
    code = cuda.parse_cuobjdump(LIST_ELF, LIST_PTX)
    assert code.sass == {"sm_90a"}
    assert code.ptx == {"sm_80"}
    assert cuda.describe_device_code(code) == "SASS sm_90a; PTX sm_80"


def test_parse_cuobjdump_many_archs_and_dotted_names() -> None:
    listing = "\n".join(
        f"ELF file {i:>4}: flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.{i}.{arch}.cubin"
        for i, arch in enumerate(["sm_80", "sm_90", "sm_90a", "sm_100a"], start=1)
    )
    code = cuda.parse_cuobjdump(listing + "\nELF file    5: weird.cubin\n")
    assert code.sass == {"sm_80", "sm_90", "sm_90a", "sm_100a"}
    assert code.unknown == ("weird.cubin",)
    assert cuda.describe_device_code(code).startswith("SASS sm_80, sm_90, sm_90a, sm_100a")


def test_arch_problems() -> None:
    good = DeviceCode(sass=frozenset({"sm_90a"}))
    assert cuda.arch_problems(good, ["sm_90a"]) == []
    assert cuda.arch_problems(good, ["sm_90a", "sm_80"]) == ["no SASS for sm_80"]
    jit = DeviceCode(sass=frozenset({"sm_90a"}), ptx=frozenset({"sm_80"}))
    assert cuda.arch_problems(jit, ["sm_90a"]) == ["PTX without SASS for sm_80 (left to PTX JIT)"]
    ptx_only = DeviceCode(ptx=frozenset({"sm_90a"}))
    assert cuda.arch_problems(ptx_only, ["sm_90a"]) == [
        "no SASS for sm_90a",
        "PTX without SASS for sm_90a (left to PTX JIT)",
    ]
    both = DeviceCode(sass=frozenset({"sm_90a"}), ptx=frozenset({"sm_90a"}))
    assert cuda.arch_problems(both, ["sm_90a"]) == []


def test_arch_problems_same_family() -> None:
    # sm_90 SASS runs on the sm_90a target's GPU (FA2 builds plain sm_90) ...
    assert cuda.arch_problems(DeviceCode(sass=frozenset({"sm_90"})), ["sm_90a"]) == []
    # ... and compute_90 PTX beside sm_90a SASS is never JIT-compiled there.
    assert cuda.arch_problems(DeviceCode(sass=frozenset({"sm_90a"}), ptx=frozenset({"sm_90"})), ["sm_90a"]) == []
    # Another family's PTX still is.
    lone = DeviceCode(sass=frozenset({"sm_90a"}), ptx=frozenset({"sm_100"}))
    assert cuda.arch_problems(lone, ["sm_90a"]) == ["PTX without SASS for sm_100 (left to PTX JIT)"]


def test_find_cuobjdump_in_nvidia_wheel_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(sys, "path", [])  # not this interpreter's own wheel
    if Path("/usr/local/cuda/bin/cuobjdump").exists():
        pytest.skip("/usr/local/cuda/bin/cuobjdump exists and takes precedence")
    assert cuda.find_cuobjdump([tmp_path]) is None
    tool = tmp_path / "nvidia" / "cu13" / "bin" / "cuobjdump"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert cuda.find_cuobjdump([tmp_path]) == tool


def test_find_cuobjdump_in_the_base_site_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A --system-site-packages venv: the wheel is in the base interpreter's
    # site-packages, which is on sys.path but is not the venv's own.
    site = tmp_path / "base-site-packages"
    tool = site / "nvidia" / "cu13" / "bin" / "cuobjdump"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    if Path("/usr/local/cuda/bin/cuobjdump").exists():
        pytest.skip("/usr/local/cuda/bin/cuobjdump exists and takes precedence")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "venv-site-packages"), str(site)])
    assert cuda.find_cuobjdump() == tool


# --------------------------------------------------------------------------- names


EXT = sysconfig.get_config_var("EXT_SUFFIX")


@pytest.mark.parametrize(
    ("relpath", "want"),
    [
        (f"repro_pybind/_core{EXT}", "repro_pybind._core"),
        (f"flash_attn_2_cuda{EXT}", "flash_attn_2_cuda"),
        (f"transformer_engine/pytorch/ops/_fused{EXT}", "transformer_engine.pytorch.ops._fused"),
        ("pkg/_stable.abi3.so", "pkg._stable"),
        ("transformer_engine/libtransformer_engine.so", None),
        ("nvidia/cu13/lib/libcudart.so.13", None),
        (f"pkg-1.0.data/_x{EXT}", None),
    ],
)
def test_module_name(relpath: str, want: str | None) -> None:
    suffixes = [EXT, ".abi3.so", ".so"]
    assert checks.module_name(relpath, suffixes) == want


def test_module_name_uses_the_target_interpreters_suffix() -> None:
    assert (
        checks.module_name("pkg/_c.cpython-312-x86_64-linux-gnu.so", [".cpython-312-x86_64-linux-gnu.so"]) == "pkg._c"
    )
    assert checks.module_name("pkg/_c.cpython-312-x86_64-linux-gnu.so", [".cpython-311-x86_64-linux-gnu.so"]) is None


def test_shared_object_names() -> None:
    assert checks.is_shared_object_name("a/libfoo.so")
    assert checks.is_shared_object_name("a/libcudart.so.13")
    assert checks.is_shared_object_name("a/libx.so.1.2.3")
    assert not checks.is_shared_object_name("a/foo.py")
    assert not checks.is_shared_object_name("a/libfoo.so.txt")


# --------------------------------------------------------------------------- smoke protocol


def test_parse_smoke_output_ignores_noise() -> None:
    text = textwrap.dedent(
        """\
        some warning from a library
        {"check": "vadd", "status": "PASS", "detail": "ok"}
        {"not": "a check"}
        {"check": "x", "status": "MAYBE"}
        {broken json
        {"check": "gpu", "status": "SKIP", "detail": "no CUDA device"}
        """
    )
    assert checks.parse_smoke_output(text) == [("vadd", "PASS", "ok"), ("gpu", "SKIP", "no CUDA device")]


def test_smoke_scripts_share_the_harness_module() -> None:
    scripts = [p for p in SMOKE.glob("*.py") if not p.name.startswith("_")]
    assert {p.stem for p in scripts} >= {
        "repro_pure",
        "repro_pybind",
        "repro_torchext",
        "repro_cuda",
        "transformer_engine",
        "flash_attn_3",
        "flash_attn",
        "grouped_gemm",
        "apex",
    }
    for script in scripts:
        assert "from _harness import " in script.read_text(), f"{script.name} does not use _harness.py"


GPU_SCRIPTS = ["repro_cuda", "transformer_engine", "flash_attn_3", "flash_attn", "grouped_gemm", "apex"]


@pytest.mark.parametrize("name", GPU_SCRIPTS)
def test_gpu_smoke_scripts_skip_when_gpu_is_off(name: str, tmp_path: Path) -> None:
    # Copied under another name and run elsewhere, as the verify stage does.
    script = tmp_path / f"smoke_{name}.py"
    shutil.copyfile(SMOKE / f"{name}.py", script)
    shutil.copyfile(SMOKE / "_harness.py", tmp_path / "_harness.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["REPRO_VERIFY_GPU"] = "0"
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    rows = checks.parse_smoke_output(done.stdout)
    assert rows, done.stdout
    assert all(status != "PASS" for _, status, _ in rows)
    gpu_rows = [r for r in rows if r[0] not in ("fa3-available", "fa2-version")]
    assert gpu_rows and all(r[1:] == ("SKIP", "GPU checks disabled (REPRO_VERIFY_GPU=0)") for r in gpu_rows)


# --------------------------------------------------------------------------- processes


def test_run_unchecked_echoes_and_captures(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "x.log"
    done = run(["sh", "-c", "echo out; echo err >&2; exit 3"], log=log, env=dict(os.environ), check=False)
    assert done.returncode == 3 and not done.ok
    assert "out" in done.output and "err" in done.output
    text = log.read_text()
    assert text.startswith("$ sh -c ")
    assert "exit status 3" in done.failure("the thing") and str(log) in done.failure("the thing")


def test_run_unchecked_timeout_stops_the_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    done = run(
        ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"],
        log=tmp_path / "t.log",
        env=dict(os.environ),
        timeout=1.0,
        check=False,
    )
    assert done.timed_out and not done.ok
    child = int(pidfile.read_text())
    assert not _alive(child), "the background child survived the timeout"


def _alive(pid: int) -> bool:
    """Running (a zombie left to a non-reaping init counts as dead)."""
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_signal_text() -> None:
    assert checks.signal_text(-signal.SIGSEGV) == "killed by signal SIGSEGV"
    assert checks.signal_text(2) == "exit status 2"


def test_child_env_gpu_modes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.setenv("REPRO_VERIFY_GPU", "1")
    env = session.child_env(tmp_path / "venv", "auto")
    assert "PYTHONPATH" not in env and "REPRO_VERIFY_GPU" not in env
    assert env["PATH"].split(os.pathsep)[0] == str(tmp_path / "venv" / "bin")
    assert session.child_env(None, "off")["REPRO_VERIFY_GPU"] == "0"
    assert session.child_env(None, "on")["REPRO_VERIFY_GPU"] == "1"


# --------------------------------------------------------------------------- elfcheck


CC = shutil.which("gcc") or shutil.which("cc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler (gcc) on PATH")


def _cc(tmp_path: Path, name: str, source: str, *args: str) -> Path:
    assert CC is not None
    src = tmp_path / f"{name}.c"
    src.write_text(textwrap.dedent(source))
    out = tmp_path / f"{name}.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(src), *args], check=True, stdin=subprocess.DEVNULL)
    return out


@pytest.fixture
def libs(tmp_path: Path) -> dict[str, Path]:
    foo = _cc(tmp_path, "libfoo", "int foo_value(void) { return 42; }\n", "-Wl,-soname,libfoo.so")
    user = _cc(
        tmp_path,
        "user",
        """\
        extern int foo_value(void);
        extern int not_defined_anywhere(int);
        extern int _ZN3c1014does_not_existEi(int);
        __attribute__((weak)) extern int optional_hook(void);
        int use(int x) {
            return foo_value() + not_defined_anywhere(x) + _ZN3c1014does_not_existEi(x)
                + (optional_hook ? optional_hook() : 0);
        }
        """,
        f"-L{tmp_path}",
        "-lfoo",
        "-Wl,-rpath,$ORIGIN/../lib",
        "-Wl,--enable-new-dtags",
    )
    return {"foo": foo, "user": user}


@needs_cc
def test_read_elf_needed_runpath_and_undefined(libs: dict[str, Path]) -> None:
    info = elfcheck.read_elf(libs["user"])
    assert "libfoo.so" in info.needed
    assert info.runpath == ("$ORIGIN/../lib",)
    assert {"foo_value", "not_defined_anywhere", "_ZN3c1014does_not_existEi"} <= set(info.undefined)
    assert "optional_hook" not in info.undefined  # weak references need no definition
    assert "use" not in info.undefined
    assert not info.has_fatbin
    assert elfcheck.torch_namespace(info.undefined) == ["_ZN3c1014does_not_existEi"]
    assert elfcheck.read_elf(libs["foo"]).soname == "libfoo.so"


@needs_cc
def test_symbol_index(libs: dict[str, Path]) -> None:
    assert "foo_value" in elfcheck.defined_symbols(libs["foo"])
    index = elfcheck.SymbolIndex([libs["foo"], libs["user"]])
    assert index.provider("foo_value") == libs["foo"]
    assert index.provider("use") == libs["user"]
    assert index.missing(["foo_value", "not_defined_anywhere"]) == ["not_defined_anywhere"]


@needs_cc
def test_is_elf_and_fatbin_header(tmp_path: Path, libs: dict[str, Path]) -> None:
    assert elfcheck.is_elf(libs["foo"])
    text = tmp_path / "x.txt"
    text.write_text("hello")
    assert not elfcheck.is_elf(text)
    assert not elfcheck.is_elf(tmp_path / "missing")
    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\0" * 100 + elfcheck.FATBIN_HEADER + b"\0" * 100)
    assert elfcheck.contains_fatbin_header(blob)
    assert elfcheck.contains_fatbin_header(blob, chunk=103)  # header split across reads
    assert not elfcheck.contains_fatbin_header(libs["foo"])


def test_loader_error_parsers() -> None:
    assert elfcheck.missing_library("libfoo.so: cannot open shared object file: No such file or directory") == (
        "libfoo.so"
    )
    error = "/x/_bad.so: undefined symbol: _ZN3c1014does_not_existEi"
    assert elfcheck.undefined_symbol(error) == "_ZN3c1014does_not_existEi"
    assert elfcheck.missing_library(error) is None
    assert elfcheck.undefined_symbol("libfoo.so: cannot open shared object file") is None


@needs_cc
def test_loader_messages_match_the_parsers(libs: dict[str, Path], tmp_path: Path) -> None:
    """The parsers read what glibc's loader really says, through ctypes."""
    import ctypes

    with pytest.raises(OSError) as missing:
        ctypes.CDLL(str(libs["user"]))
    assert elfcheck.missing_library(str(missing.value)) == "libfoo.so"
    lib = tmp_path / "lib"
    lib.mkdir()
    shutil.copy(libs["foo"], lib / "libfoo.so")
    sub = tmp_path / "sub"
    sub.mkdir()
    shutil.copy(libs["user"], sub / "user.so")  # RUNPATH $ORIGIN/../lib now finds libfoo.so
    with pytest.raises(OSError) as undefined:
        ctypes.CDLL(str(sub / "user.so"))
    assert elfcheck.undefined_symbol(str(undefined.value)) in {"not_defined_anywhere", "_ZN3c1014does_not_existEi"}


# ---------------------------------------------------- import of a module loaded under another name

ALIASED_EXT = """
#include <pybind11/pybind11.h>
struct Thing { int v = 1; };
PYBIND11_MODULE(_ext, m) { pybind11::class_<Thing>(m, "Thing").def(pybind11::init<>()); }
"""

ALIAS_THEN_CHECK = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_ext", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); sys.modules["_ext"] = mod
if sys.argv[2] == "runner":
    from tasks.outside.verify_runner import _do_import
    print(_do_import("pkg._ext"))
else:
    import pkg._ext
"""


@pytest.mark.needs_headers
def test_import_check_accepts_an_extension_loaded_under_another_name(tmp_path: Path) -> None:
    """As TE loads transformer_engine_torch: a second import of the file would register its types twice."""
    pybind11 = pytest.importorskip("pybind11")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    src = tmp_path / "ext.cpp"
    src.write_text(ALIASED_EXT)
    so = tmp_path / "pkg" / f"_ext{sysconfig.get_config_var('EXT_SUFFIX')}"
    inc = [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
    subprocess.run([cxx, "-O0", "-shared", "-fPIC", "-std=c++17", *inc, str(src), "-o", str(so)], check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}

    def go(mode: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-c", ALIAS_THEN_CHECK, str(so), mode]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)

    plain = go("plain")  # what a naive second import does
    assert plain.returncode != 0 and "already registered" in plain.stderr, plain.stderr
    checked = go("runner")
    assert checked.returncode == 0, checked.stderr
    assert "already loaded as _ext" in checked.stdout


@needs_cc
def test_library_named_like_an_extension_without_pyinit_is_not_a_module(tmp_path: Path) -> None:
    # torch_memory_saver ships LD_PRELOAD hooks as top-level *.abi3.so files: importing them fails,
    # so they must be checked by dlopen only, while a real extension (PyInit_<name>) is imported.
    site = tmp_path / "site"
    (site / "pkg").mkdir(parents=True)
    hook = _cc(tmp_path, "hook", "int hook_value(void) { return 1; }\n")
    ext = _cc(tmp_path, "ext", "void *PyInit__ext(void) { return 0; }\n")
    shutil.copy(hook, site / "hook_mode_preload.abi3.so")
    shutil.copy(ext, site / "pkg" / "_ext.abi3.so")
    dist = {"location": str(site), "files": [str(p) for p in sorted(site.rglob("*.so"))], "top_level": ["pkg"]}
    installed = checks._installed(dist, [".abi3.so", ".so"])
    assert installed.extension_modules == ("pkg._ext",)
    assert {p.name for p in installed.shared_objects} == {"hook_mode_preload.abi3.so", "_ext.abi3.so"}


def test_provided_version_is_found_behind_another_copy(tmp_path: Path) -> None:
    """doit's venv may hold its own copy of a provided distribution (filelock) in front of the base's:
    the runner reports the copy of the provided version, wherever it is on the path."""
    dirs = []
    for version in ("4.2.11", "3.32.5"):
        site_dir = tmp_path / version
        info = site_dir / f"repro_fake-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: repro-fake\nVersion: {version}\n")
        (info / "RECORD").write_text(f"repro_fake-{version}.dist-info/METADATA,,\n")
        dirs.append(str(site_dir))
    request, out = tmp_path / "request.json", tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dirs)}

    def ask(versions: dict[str, str]) -> dict[str, object]:
        request.write_text(json.dumps({"dists": ["repro-fake"], "versions": versions}))
        subprocess.run([sys.executable, str(session.RUNNER), "info", str(request), str(out)], env=env, check=True)
        found: dict[str, object] = json.loads(out.read_text())["dists"]["repro-fake"]
        return found

    assert ask({})["version"] == "4.2.11"  # the first on the path
    pinned = ask({"repro-fake": "3.32.5"})
    assert pinned["version"] == "3.32.5" and pinned["location"] == os.path.realpath(dirs[1])
    assert ask({"repro-fake": "9.9"})["version"] == "4.2.11"  # no such copy: the first, and verify names the mismatch


def test_the_closing_advice_names_the_real_cause() -> None:
    """The environment, the lock's [runtime], the wheelhouse's files or the recipe: not always the recipe."""
    from tasks.verify.checks import advice

    def fail(package: str, check: str, detail: str) -> Row:
        return Row(package=package, check=check, status="FAIL", detail=detail)

    env = advice([fail("wheelhouse", "venv", "the target must provide, but the base interpreter lacks: torch "
                       "(not installed for /usr/bin/python3)")])  # fmt: skip
    assert env.startswith("The environment:") and "recipe" not in env
    runtime = advice([fail("ext", "deps", "unmet: packaging (only in /x/.venv/lib/python3.12/site-packages, ...)"),
                      fail("ext", "import", "ModuleNotFoundError: No module named 'packaging'")])  # fmt: skip
    assert runtime.startswith("The lock's [runtime]:") and "recipe" not in runtime
    assert advice([fail("wheelhouse", "pip-check", "a 1 has requirement b<2, but you have b 2")]).startswith(
        "The lock's [runtime]:"
    )
    assert "recipe or patches" in advice([fail("ext", "symbols", "undefined: _ZN3c104impl")])
    assert advice([fail("wheelhouse", "sha256", "x.whl: sha256 differs")]).startswith("The wheelhouse's files")
