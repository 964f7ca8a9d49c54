"""End-to-end runs of the verify stage on tiny wheelhouses built here.

The wheels are real: extension modules compiled with gcc/g++ (a C-API
module, a pybind11 module, a torch C++ extension) and nvcc (a CUDA kernel
for sm_90a, CUDA runtime linked statically), packed by ``pip wheel
--no-build-isolation --no-deps`` from setup.py packages generated in a
temporary directory. Broken wheels fail the way real ones do: a library
absent at run time, a c10 symbol torch does not define, device code left
to PTX JIT, an extension that segfaults on import.

Without a GPU the GPU smoke checks must come out SKIP, never PASS; with one
(torch.cuda.is_available()), the CUDA fixture's smoke checks must PASS.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import HAVE_HEADERS, require

from tasks.core.errors import VerifyFailed
from tasks.stages import provenance
from tasks.verify import checks, cuda
from tasks.verify.report import Report, Row
from tasks.verify.session import SMOKE_DIR

pytestmark = pytest.mark.integration

EXT = sysconfig.get_config_var("EXT_SUFFIX")
PY_INCLUDE = sysconfig.get_paths()["include"]
GXX = shutil.which("g++")
NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.access(p, os.X_OK)), None)
HAVE_TORCH = importlib.util.find_spec("torch") is not None
HAVE_PYBIND11 = importlib.util.find_spec("pybind11") is not None
GPU = HAVE_TORCH and bool(importlib.import_module("torch").cuda.is_available())
CUOBJDUMP = cuda.find_cuobjdump()

needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ is not installed")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
needs_cuobjdump = pytest.mark.skipif(
    CUOBJDUMP is None, reason="cuobjdump is not installed (pip install nvidia-cuda-cuobjdump)"
)


# --------------------------------------------------------------------------- fixture sources

SETUP_PY = """\
from setuptools import setup
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    # The extension is compiled beforehand: still a platform wheel.
    def has_ext_modules(self):
        return {binary}


setup(
    name={name!r},
    version="0.1.0",
    packages=[{package!r}],
    package_data={{{package!r}: ["*.so"]}},
    install_requires={requires!r},
    distclass=BinaryDistribution,
)
"""

VADD_CU = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cuda_runtime.h>
#include <vector>

__global__ void vadd_kernel(const double* a, const double* b, double* c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}

static PyObject* device_count(PyObject*, PyObject*) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) { cudaGetLastError(); n = 0; }
    return PyLong_FromLong(n);
}

static bool to_vector(PyObject* obj, std::vector<double>& out) {
    PyObject* seq = PySequence_Fast(obj, "vadd: expected a sequence of floats");
    if (!seq) return false;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    out.resize(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
        out[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (PyErr_Occurred()) { Py_DECREF(seq); return false; }
    }
    Py_DECREF(seq);
    return true;
}

static PyObject* fail(cudaError_t err) {
    PyErr_SetString(PyExc_RuntimeError, cudaGetErrorString(err));
    return nullptr;
}

static PyObject* vadd(PyObject*, PyObject* args) {
    PyObject *x, *y;
    if (!PyArg_ParseTuple(args, "OO", &x, &y)) return nullptr;
    std::vector<double> a, b;
    if (!to_vector(x, a) || !to_vector(y, b)) return nullptr;
    if (a.size() != b.size()) { PyErr_SetString(PyExc_ValueError, "vadd: length mismatch"); return nullptr; }
    int n = (int)a.size();
    std::vector<double> c(n);
    double *da, *db, *dc;
    size_t bytes = n * sizeof(double);
    cudaError_t err;
    if ((err = cudaMalloc(&da, bytes)) != cudaSuccess) return fail(err);
    cudaMalloc(&db, bytes);
    cudaMalloc(&dc, bytes);
    cudaMemcpy(da, a.data(), bytes, cudaMemcpyHostToDevice);
    cudaMemcpy(db, b.data(), bytes, cudaMemcpyHostToDevice);
    vadd_kernel<<<(n + 255) / 256, 256>>>(da, db, dc, n);
    err = cudaMemcpy(c.data(), dc, bytes, cudaMemcpyDeviceToHost);
    cudaFree(da); cudaFree(db); cudaFree(dc);
    if (err != cudaSuccess) return fail(err);
    PyObject* list = PyList_New(n);
    for (int i = 0; i < n; ++i) PyList_SET_ITEM(list, i, PyFloat_FromDouble(c[i]));
    return list;
}

static PyMethodDef methods[] = {
    {"vadd", vadd, METH_VARARGS, "Elementwise sum of two float lists, on the GPU."},
    {"device_count", device_count, METH_NOARGS, "Number of CUDA devices (0 without a driver)."},
    {nullptr, nullptr, 0, nullptr},
};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_vadd", nullptr, -1, methods};
PyMODINIT_FUNC PyInit__vadd(void) { return PyModule_Create(&module); }
"""

PYBIND_CPP = r"""
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <stdexcept>
#include <vector>

static int add(int a, int b) { return a + b; }
static double dot(const std::vector<double>& a, const std::vector<double>& b) {
    if (a.size() != b.size()) throw std::invalid_argument("dot: length mismatch");
    double acc = 0.0;
    for (size_t i = 0; i < a.size(); ++i) acc += a[i] * b[i];
    return acc;
}
PYBIND11_MODULE(_core, m) {
    m.def("add", &add);
    m.def("dot", &dot);
}
"""

# An operator registered with TORCH_LIBRARY and a module whose import registers it: the headers of one
# tensor, not <torch/extension.h> (three to five times the compile time).
TORCHEXT_CPP = r"""
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <Python.h>
at::Tensor scaled_add(const at::Tensor& a, const at::Tensor& b, double alpha) {
    return a.add(b, alpha).to(at::kFloat);
}
TORCH_LIBRARY(repro_torchext, m) { m.def("scaled_add(Tensor a, Tensor b, float alpha) -> Tensor", &scaled_add); }
static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module_def); }
"""

TORCHEXT_SETUP = """\
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    name="repro-torchext",
    version="0.1.0",
    packages=["repro_torchext"],
    ext_modules=[CppExtension("repro_torchext._C", ["ext.cpp"], extra_compile_args=["-O0"])],
    cmdclass={"build_ext": BuildExtension},
)
"""


def c_module(name: str, body: str = "", init: str = "") -> str:
    """A C-API extension module ``name`` whose init runs ``init`` first."""
    return textwrap.dedent(
        f"""\
        #define PY_SSIZE_T_CLEAN
        #include <Python.h>
        #include <signal.h>
        {body}
        static struct PyModuleDef module = {{PyModuleDef_HEAD_INIT, "{name}", NULL, -1, NULL}};
        #ifdef __cplusplus
        extern "C"
        #endif
        PyObject* PyInit_{name}(void) {{ {init} return PyModule_Create(&module); }}
        """
    )


# --------------------------------------------------------------------------- building


@dataclass(frozen=True, kw_only=True)
class Built:
    package: str
    name: str
    wheel: Path


def _run(cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"


def _pip_wheel(src: Path, out: Path) -> Path:
    before = set(out.glob("*.whl"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(out), "."], src)
    (wheel,) = set(out.glob("*.whl")) - before
    return wheel


def _package(
    root: Path,
    package: str,
    *,
    init: str = "",
    binaries: Mapping[str, list[str]] | None = None,
    sources: Mapping[str, str] | None = None,
    requires: Iterable[str] = (),
) -> Path:
    """Generate a setup.py package; ``binaries`` maps an output file in the
    package to the compiler command that makes it (``{out}`` replaced)."""
    src = root / package
    (src / package).mkdir(parents=True)
    (src / package / "__init__.py").write_text(init)
    for name, text in (sources or {}).items():
        (src / name).write_text(text)
    for filename, cmd in (binaries or {}).items():
        _run([part.replace("{out}", str(src / package / filename)) for part in cmd], src)
    (src / "setup.py").write_text(
        SETUP_PY.format(name=package.replace("_", "-"), package=package, binary=bool(binaries), requires=list(requires))
    )
    return src


def _cc(*args: str) -> list[str]:
    assert GXX is not None
    return [GXX, "-shared", "-fPIC", "-O1", f"-I{PY_INCLUDE}", "-o", "{out}", *args]


def _nvcc(gencode: str, source: str) -> list[str]:
    assert NVCC is not None
    return [
        NVCC, "-shared", "-Xcompiler", "-fPIC", "-cudart", "static", "-gencode", gencode,
        f"-I{PY_INCLUDE}", "-o", "{out}", source,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    """Every fixture wheel, built once for this module."""
    if not HAVE_HEADERS:
        require("Python's C headers (Python.h) are not installed (apt-get install python3-dev): the fixtures compile")
    root = tmp_path_factory.mktemp("src")
    out = tmp_path_factory.mktemp("dist")
    wheels: dict[str, Built] = {}

    def add(package: str, src: Path) -> None:
        wheels[package] = Built(package=package, name=package.replace("_", "-"), wheel=_pip_wheel(src, out))

    add("repro_pure", _package(root, "repro_pure", init='def greet(name):\n    return "hello, " + name\n'))
    if GXX is not None and HAVE_PYBIND11:
        import pybind11

        add(
            "repro_pybind",
            _package(
                root,
                "repro_pybind",
                init="from ._core import add, dot\n",
                sources={"core.cpp": PYBIND_CPP},
                binaries={f"_core{EXT}": _cc("-std=c++17", f"-I{pybind11.get_include()}", "core.cpp")},
            ),
        )
    if NVCC is not None:
        add(
            "repro_cuda",
            _package(
                root,
                "repro_cuda",
                sources={"vadd.cu": VADD_CU},
                binaries={f"_vadd{EXT}": _nvcc("arch=compute_90a,code=sm_90a", "vadd.cu")},
            ),
        )
        add(
            "repro_ptx",
            _package(
                root,
                "repro_ptx",
                sources={"vadd.cu": VADD_CU.replace("_vadd", "_ptx")},
                binaries={f"_ptx{EXT}": _nvcc("arch=compute_90a,code=compute_90a", "vadd.cu")},
                requires=["repro-absent-dependency>=1.0"],
            ),
        )
    if GXX is not None:
        libfoo = root / "libfoo" / "libfoo.so"
        libfoo.parent.mkdir()
        (libfoo.parent / "foo.c").write_text("int foo_value(void) { return 42; }\n")
        _run([GXX, "-x", "c", "-shared", "-fPIC", "-o", str(libfoo), "foo.c"], libfoo.parent)
        add(
            "repro_missinglib",
            _package(
                root,
                "repro_missinglib",
                sources={"m.c": c_module("_m", "int foo_value(void);\nint answer(void) { return foo_value(); }")},
                # Linked against libfoo.so, which the wheel does not ship.
                binaries={f"_m{EXT}": _cc("-x", "c", "m.c", f"-L{libfoo.parent}", "-lfoo")},
            ),
        )
        add(
            "repro_badsym",
            _package(
                root,
                "repro_badsym",
                sources={
                    "b.cpp": c_module(
                        "_b",
                        "namespace c10 { int does_not_exist(int); }\nint use(int x) { return c10::does_not_exist(x); }",
                    )
                },
                # A shared object may leave symbols undefined: the loader catches it.
                binaries={f"_b{EXT}": _cc("b.cpp", "-Wl,--unresolved-symbols=ignore-all")},
            ),
        )
        add(
            "repro_crash",
            _package(
                root,
                "repro_crash",
                sources={"boom.c": c_module("_boom", init="raise(SIGSEGV);"), "fine.c": c_module("_fine")},
                binaries={f"_boom{EXT}": _cc("-x", "c", "boom.c"), f"_fine{EXT}": _cc("-x", "c", "fine.c")},
            ),
        )
    if GXX is not None and HAVE_TORCH:
        src = root / "repro_torchext"
        (src / "repro_torchext").mkdir(parents=True)
        (src / "repro_torchext" / "__init__.py").write_text(
            "import torch\n\nfrom . import _C  # noqa: F401\n\nscaled_add = torch.ops.repro_torchext.scaled_add\n"
        )
        (src / "ext.cpp").write_text(TORCHEXT_CPP)
        (src / "setup.py").write_text(TORCHEXT_SETUP)
        add("repro_torchext", src)
    return wheels


def wheelhouse(
    dest: Path,
    wheels: Iterable[Built],
    *,
    archs: Iterable[str] = ("sm_90a",),
    cuda: Iterable[str] = ("repro_cuda", "repro_ptx"),
    verify_: Mapping[str, Mapping[str, object]] | None = None,
) -> Path:
    """A wheelhouse as ``doit wheels`` writes it: wheels, manifest.json, requirements.txt, provenance/."""
    dest.mkdir(parents=True)
    cuda_packages = set(cuda)
    entries: list[dict[str, object]] = []
    requirements: list[str] = []
    for w in sorted(wheels, key=lambda w: w.package):
        shutil.copy(w.wheel, dest / w.wheel.name)
        sha = hashlib.sha256(w.wheel.read_bytes()).hexdigest()
        default: dict[str, object] = {
            "imports": [],
            "smoke": w.package if (SMOKE_DIR / f"{w.package}.py").exists() else None,
        }
        entries.append(
            {
                "package": w.package,
                "name": w.name,
                "version": "0.1.0",
                "filename": w.wheel.name,
                "sha256": sha,
                "action_key": "0" * 64,
                "sources": [],
                "cuda": w.package in cuda_packages,
                "verify": dict((verify_ or {}).get(w.package, default)),
            }
        )
        requirements.append(f"{w.name}==0.1.0 --hash=sha256:{sha}")
        statement = {
            "_type": provenance.STATEMENT_TYPE,
            "subject": [{"name": w.wheel.name, "digest": {"sha256": sha}}],
            "predicateType": provenance.PREDICATE_TYPE,
            "predicate": {},
        }
        path = provenance.statement_path(dest, w.wheel.name)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(statement))
    manifest = {
        "format": 1,
        "lock": "sources.lock",
        "lock_sha256": "0" * 64,
        "profile": "test",
        "archs": list(archs),
        "wheels": entries,
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (dest / "requirements.txt").write_text("\n".join(requirements) + "\n")
    return dest


def rows_of(report: Report, package: str) -> dict[str, Row]:
    return {row.check: row for row in report.rows if row.package == package}


def pick(built: Mapping[str, Built], *names: str) -> list[Built]:
    missing = [n for n in names if n not in built]
    if missing:
        require(f"fixture wheels not buildable here: {', '.join(missing)}")
    return [built[n] for n in names]


# --------------------------------------------------------------------------- tests


@pytest.mark.needs_nvcc
@needs_cuobjdump
def test_good_wheelhouse_passes(built: dict[str, Built], tmp_path: Path) -> None:
    names = ["repro_pure", "repro_pybind", "repro_cuda"] + (["repro_torchext"] if "repro_torchext" in built else [])
    house = wheelhouse(
        tmp_path / "wheels",
        pick(built, *names),
        verify_={"repro_cuda": {"imports": ["repro_cuda", "repro_cuda._vadd"], "smoke": "repro_cuda"}},
    )
    report = checks.verify_wheelhouse(house, tmp_path / "work")
    text = report.render()
    assert report.ok, text
    assert {row.status for row in report.rows} <= {"PASS", "SKIP"}

    cuda = rows_of(report, "repro_cuda")
    assert cuda["import"].status == "PASS" and "repro_cuda._vadd" in cuda["import"].detail
    assert cuda["libs"].status == "PASS"
    assert cuda["symbols"].status == "PASS"
    assert cuda["arch"].status == "PASS" and "SASS sm_90a" in cuda["arch"].detail
    if GPU:  # the kernel really ran on the GPU
        assert cuda["smoke:vadd"].status == cuda["smoke:device_count"].status == "PASS"
    else:  # no GPU: the GPU smoke checks are skipped with the reason, never passed
        assert cuda["smoke:vadd"].status == "SKIP"
        assert "torch.cuda.is_available() is False" in cuda["smoke:vadd"].detail

    pure = rows_of(report, "repro_pure")
    assert pure["import"].detail == "1 module: repro_pure"  # default: top-level packages
    assert pure["smoke:greet"].status == "PASS"
    assert {pure["libs"].status, pure["symbols"].status, pure["arch"].status} == {"SKIP"}

    pybind = rows_of(report, "repro_pybind")
    assert "repro_pybind._core" in pybind["import"].detail  # extension modules are found by suffix
    assert pybind["smoke:add"].status == pybind["smoke:dot"].status == "PASS"
    assert pybind["arch"].status == "SKIP"

    if "repro_torchext" in built:
        torchext = rows_of(report, "repro_torchext")
        assert torchext["smoke:scaled_add"].status == "PASS"
        assert "c10/at/torch references resolved" in torchext["symbols"].detail

    saved = json.loads((tmp_path / "work" / "report.json").read_text())
    assert Report.from_dict(saved) == report
    assert (tmp_path / "work" / "report.txt").read_text() == text
    assert text.splitlines()[-1] == report.summary()
    assert (tmp_path / "work" / "logs" / "install.log").is_file()


@needs_cuobjdump
def test_wrong_archs_and_bad_smoke_fail(
    built: dict[str, Built], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    smoke = tmp_path / "smoke"
    smoke.mkdir()
    shutil.copy(SMOKE_DIR / "repro_cuda.py", smoke)
    shutil.copy(SMOKE_DIR / "_harness.py", smoke)
    (smoke / "slow.py").write_text("import time\nprint('starting', flush=True)\ntime.sleep(60)\n")
    (smoke / "silent.py").write_text("import os\nos.abort()\n")
    monkeypatch.setattr(checks, "SMOKE_DIR", smoke)
    house = wheelhouse(
        tmp_path / "wheels",
        pick(built, "repro_pure", "repro_pybind", "repro_cuda"),
        archs=["sm_90a", "sm_80"],
        cuda=["repro_cuda", "repro_pure"],
        verify_={
            "repro_pure": {"smoke": "slow"},
            "repro_pybind": {"smoke": "silent"},
            "repro_cuda": {"smoke": "repro_cuda"},
        },
    )
    with pytest.raises(VerifyFailed) as info:
        checks.run_verify(house, tmp_path / "work", gpu="off", smoke_timeout=5)
    assert str(tmp_path / "work" / "report.txt") in str(info.value)
    report = Report.from_dict(json.loads((tmp_path / "work" / "report.json").read_text()))

    cuda = rows_of(report, "repro_cuda")
    assert cuda["arch"].status == "FAIL"
    assert "no SASS for sm_80" in cuda["arch"].detail and "SASS sm_90a" in cuda["arch"].detail
    assert cuda["smoke:vadd"].status == "SKIP" and "REPRO_VERIFY_GPU=0" in cuda["smoke:vadd"].detail

    pure = rows_of(report, "repro_pure")
    assert pure["arch"].status == "FAIL" and "no shared object carries a CUDA fatbinary" in pure["arch"].detail
    assert pure["smoke"].status == "FAIL" and "timed out after 5 s" in pure["smoke"].detail

    pybind = rows_of(report, "repro_pybind")
    assert pybind["smoke"].status == "FAIL" and "SIGABRT" in pybind["smoke"].detail


@needs_gxx
@needs_nvcc
@needs_cuobjdump
def test_broken_wheels_fail_with_reasons(built: dict[str, Built], tmp_path: Path) -> None:
    house = wheelhouse(
        tmp_path / "wheels",
        pick(built, "repro_missinglib", "repro_badsym", "repro_ptx", "repro_crash"),
        verify_={"repro_crash": {"imports": ["repro_crash"]}},
    )
    report = checks.verify_wheelhouse(house, tmp_path / "work")
    assert not report.ok

    missing = rows_of(report, "repro_missinglib")
    assert missing["libs"].status == "FAIL"
    assert "needs libfoo.so, not found" in missing["libs"].detail
    assert missing["import"].status == "FAIL" and "libfoo.so" in missing["import"].detail

    badsym = rows_of(report, "repro_badsym")
    assert badsym["symbols"].status == "FAIL"
    assert "undefined symbol c10::does_not_exist(int)" in badsym["symbols"].detail
    assert badsym["libs"].status == "PASS"  # every NEEDED library is there
    if HAVE_TORCH:  # the ELF check names it too, against the installed torch's libraries
        assert "1 torch symbols not defined by" in badsym["symbols"].detail

    ptx = rows_of(report, "repro_ptx")
    assert ptx["arch"].status == "FAIL"
    assert "no SASS for sm_90a" in ptx["arch"].detail and "left to PTX JIT" in ptx["arch"].detail
    assert ptx["deps"].status == "FAIL" and "repro-absent-dependency>=1.0 (not installed)" in ptx["deps"].detail

    # A segfault on import costs that module only: the rest ran in a new process.
    crash = rows_of(report, "repro_crash")
    assert crash["import"].status == "FAIL"
    assert "repro_crash._boom: crashed" in crash["import"].detail and "SIGSEGV" in crash["import"].detail
    assert "_fine" not in crash["import"].detail
    assert crash["libs"].status == "PASS"  # both objects dlopen (init functions do not run)


@needs_nvcc
def test_arch_fails_without_cuobjdump(built: dict[str, Built], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checks, "find_cuobjdump", lambda *a, **k: None)
    house = wheelhouse(tmp_path / "wheels", pick(built, "repro_cuda"))
    report = checks.verify_wheelhouse(house, tmp_path / "work", gpu="off")
    arch = rows_of(report, "repro_cuda")["arch"]
    assert arch.status == "FAIL"
    assert "pip install nvidia-cuda-cuobjdump" in arch.detail


def test_install_failure_is_reported_with_log(built: dict[str, Built], tmp_path: Path) -> None:
    house = wheelhouse(tmp_path / "wheels", pick(built, "repro_pure"))
    # A requirements file whose hash does not match: pip must refuse.
    (house / "requirements.txt").write_text(f"repro-pure==0.1.0 --hash=sha256:{'0' * 64}\n")
    report = checks.verify_wheelhouse(house, tmp_path / "work", log_dir=tmp_path / "logs")
    install = rows_of(report, "wheelhouse")["install"]
    assert install.status == "FAIL"
    assert str(tmp_path / "logs" / "install.log") in install.detail
    assert "HASH" in install.detail.upper()
    assert not any(row.package == "repro_pure" for row in report.rows)
