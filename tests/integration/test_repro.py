"""Bit-for-bit wheels, `doit repro`, and the wheelhouse's SBOM and provenance, on the example lock."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest
from conftest import REPO, built_packages, copy_cache, make_workspace, require
from cyclonedx.schema import SchemaVersion
from cyclonedx.validation.json import JsonStrictValidator

from tasks.core import proc
from tasks.core.treehash import file_sha256
from tasks.env import reproducible
from tasks.env.toolchain import nvcc_takes_seed
from tasks.lock.lockfile import load_lock
from tasks.stages import provenance

pytestmark = pytest.mark.integration

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").is_file() else None)

# A patch that makes repro_pure's build embed the time it ran: what an upstream
# version script stamping the build date does.
STAMP_PATCH = """Embed the time of the build in the package: a deliberately non-reproducible build.

--- /dev/null
+++ b/setup.py
@@ -0,0 +1,15 @@
+import os
+import time
+
+from setuptools import setup
+from setuptools.command.build_py import build_py
+
+
+class StampedBuild(build_py):
+    def run(self):
+        super().run()
+        with open(os.path.join(self.build_lib, "repro_pure", "_stamp.py"), "w") as fh:
+            fh.write("BUILD_TIME_NS = %d\\n" % time.time_ns())
+
+
+setup(cmdclass={"build_py": StampedBuild})
"""


def nvcc_release() -> str:
    assert NVCC is not None
    out = subprocess.run([NVCC, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+\.\d+)", out)
    assert found, out
    return found.group(1)


@pytest.mark.needs_nvcc
@pytest.mark.needs_torch
def test_example_lock_rebuilds_bit_for_bit_with_sbom_and_provenance(
    quick_cache: Path, tmp_path: Path, server: object
) -> None:
    # The quick packages come from a cache built by another workspace, in another directory, earlier.
    ws = make_workspace(tmp_path / "checkout", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    assert built_packages(ws.doit("wheels").stdout) == ["repro_torchext"]
    res = ws.doit("repro")
    assert "4 of 4 wheel(s) identical" in res.stdout, res.stdout
    report = json.loads((ws.root / "build" / "repro" / "report.json").read_text())
    manifest = json.loads((ws.wheels / "manifest.json").read_text())
    built = {w["package"]: w["sha256"] for w in manifest["wheels"] if w["origin"] != "fetched"}
    rebuilt = {r["package"]: r["rebuilt_sha256"] for r in report["results"]}
    assert (
        report["ok"]
        and rebuilt == built
        and set(built)
        == {
            "repro_pure",
            "repro_pybind",
            "repro_cuda",
            "repro_torchext",
        }
    )
    assert not (ws.root / "build" / "repro" / "repro_cuda-rebuild").exists()  # the second stage is removed

    # The SBOM: valid CycloneDX 1.6 naming every wheel, source (with its license), patch and tool.
    text = (ws.wheels / "sbom.cdx.json").read_text()
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text, all_errors=True) is None
    doc = json.loads(text)
    comps = {c["bom-ref"]: c for c in doc["components"]}
    for w in manifest["wheels"]:
        assert comps[f"wheel:{w['filename']}"]["hashes"] == [{"alg": "SHA-256", "content": w["sha256"]}]
    lock = load_lock(ws.lock)
    for name, src in lock.sources.items():
        assert comps[f"source:{name}"]["licenses"][0]["license"]["id"] == src.license
    assert comps["source:repro-pure"]["version"] == lock.sources["repro-pure"].commit
    assert comps["source:repro-cuda"]["hashes"][0]["content"] == lock.sources["repro-cuda"].sha256
    patch = "patches/repro_pure/0001-patched-message.patch"
    assert comps[f"patch:{patch}"]["hashes"][0]["content"] == file_sha256(ws.root / patch)
    tools = {c["name"]: c["version"] for c in doc["components"] if c.get("group") == "toolchain"}
    import torch

    assert tools["python"] == platform.python_version() and tools["torch"] == torch.__version__
    assert tools["nvcc"] == nvcc_release()

    # Provenance: one statement per wheel, naming its sha256 and its materials.
    filenames = [w["filename"] for w in manifest["wheels"]]
    assert provenance.check_statements(ws.wheels, filenames) == []
    cuda = next(w for w in manifest["wheels"] if w["package"] == "repro_cuda")
    statement = json.loads(provenance.statement_path(ws.wheels, cuda["filename"]).read_text())
    deps = {d["name"]: d for d in statement["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert deps["source:repro-cuda"]["digest"] == {"sha256": lock.sources["repro-cuda"].sha256}
    assert nvcc_release() in deps["toolchain"]["annotations"]["nvcc"]
    params = statement["predicate"]["buildDefinition"]["internalParameters"]
    assert params["action_key"] == cuda["action_key"] and params["workdir"] == "/tmp/reprostack-build/repro_cuda"
    pure = next(w for w in manifest["wheels"] if w["package"] == "repro_pure")
    statement = json.loads(provenance.statement_path(ws.wheels, pure["filename"]).read_text())
    deps = {d["name"]: d for d in statement["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert deps["source:repro-pure"]["digest"] == {"gitCommit": lock.sources["repro-pure"].commit}
    assert deps[patch]["digest"] == {"sha256": file_sha256(ws.root / patch)}

    # A wheel changed after the build no longer matches its statement.
    house = shutil.copytree(ws.wheels, tmp_path / "tampered")
    wheel = house / cuda["filename"]
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 0x01
    wheel.write_bytes(bytes(data))
    problems = provenance.check_statements(house, filenames)
    assert len(problems) == 1 and problems[0].startswith(f"{cuda['filename']}: sha256 ")


def test_a_build_that_embeds_its_time_fails_doit_repro_with_a_report(
    quick_cache: Path, tmp_path: Path, server: object
) -> None:
    ws = make_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    (ws.root / "patches" / "repro_pure" / "0002-embed-build-time.patch").write_text(STAMP_PATCH)
    ws.edit_lock(
        'patches = ["0001-patched-message.patch"]',
        'patches = ["0001-patched-message.patch", "0002-embed-build-time.patch"]',
    )
    res = ws.doit("repro", "profile=quick", "pkgs=repro_pure", check=False)
    assert built_packages(res.stdout) == ["repro_pure"]  # doit wheels first: a new patch, a new key
    assert res.returncode == 18, res.stdout + res.stderr
    assert "ReproMismatch: doit repro: 0 of 1 wheel(s) identical; not reproducible: repro_pure." in res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    out = ws.root / "build" / "repro"
    report = (out / "report.txt").read_text()
    assert "repro_pure           DIFFERENT" in report
    assert re.search(r"^    repro_pure/_stamp\.py: size 36 -> 36, sha256 ", report, flags=re.M), report
    assert re.search(r"^        -BUILD_TIME_NS = \d+$", report, flags=re.M)
    assert re.search(r"^        \+BUILD_TIME_NS = \d+$", report, flags=re.M)
    assert "repro_pure-0.1.0.dist-info/RECORD" in report
    kept = json.loads((out / "report.json").read_text())["results"][0]["kept"]
    assert Path(kept).is_file() and file_sha256(Path(kept)) != file_sha256(ws.wheels / Path(kept).name)
    # Only the packages asked for are rebuilt, and a misspelt one is named.
    res = ws.doit("repro", "profile=quick", "pkgs=repro_pur", check=False)
    assert res.returncode == 10
    assert "unknown package(s) 'repro_pur' (perhaps you meant 'repro_pure'?)" in res.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (put the CUDA toolkit's bin/ on PATH)")
def test_nvcc_objects_differ_without_the_reproducibility_settings(tmp_path: Path) -> None:
    """The mechanism, on the CUDA fixture with -lineinfo, in two directories: plain nvcc differs, ours does not."""
    if reproducible.method() != "mount-namespace":
        require("unshare --mount is not permitted on this host; -lineinfo builds then keep their directory")
    assert NVCC is not None
    include = sysconfig.get_paths()["include"]
    cmd = [NVCC, "-shared", "-O2", "-lineinfo", "-std=c++17", "-cudart", "static", "-Xcompiler", "-fPIC",
           "-gencode", "arch=compute_90a,code=sm_90a", "-I", include, "csrc/vadd.cu", "csrc/module.cpp",
           "-o", "out.so"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in reproducible.FLAG_VARIABLES}
    outputs: dict[tuple[str, str], bytes] = {}
    mountpoint = Path(str(reproducible.canonical_dir("reprostack-nvcc-test")))
    for where in ("one", "second-checkout"):
        for mode in ("plain", "reproducible"):
            stage = tmp_path / where / mode
            shutil.copytree(REPO / "tests" / "fixtures" / "src" / "repro_cuda" / "csrc", stage / "csrc")
            log = tmp_path / f"{where}-{mode}.log"
            if mode == "plain":
                proc.run(cmd, env=env, cwd=stage, log=log)
            else:
                place = reproducible.placement("reprostack-nvcc-test", stage)
                proc.run(place.command(cmd, stage), env=reproducible.apply(env, place), cwd=stage, log=log)
            outputs[where, mode] = (stage / "out.so").read_bytes()
    with contextlib.suppress(OSError):
        mountpoint.rmdir()  # the empty mount point on the host
    assert outputs["one", "plain"] != outputs["second-checkout", "plain"]
    assert outputs["one", "reproducible"] == outputs["second-checkout", "reproducible"]
    assert b"tmpxft_" in outputs["one", "plain"] and b"tmpxft_" not in outputs["one", "reproducible"]
    assert str(tmp_path).encode() in outputs["one", "plain"]
    assert str(tmp_path).encode() not in outputs["one", "reproducible"]


# A translation unit with no plain external function: cudafe++ builds the module id of its
# internal-linkage names (CCCL's cuda::std objects, an anonymous namespace) from the process id.
INTERNAL_NAMES_CU = """#include <cuda/std/utility>
namespace { __device__ int hidden_counter; }
template <int N> __global__ void kernel(int* out) {
  auto p = cuda::std::make_pair(N, 2);
  out[0] = p.first + hidden_counter;
}
template __global__ void kernel<3>(int*);
"""


def test_nvcc_internal_names_do_not_depend_on_the_process(tmp_path: Path) -> None:
    if not NVCC:
        require("nvcc not found: the test compiles CUDA")
    assert nvcc_takes_seed(NVCC), f"{NVCC} has no -frandom-seed"
    src = tmp_path / "internal.cu"
    src.write_text(INTERNAL_NAMES_CU)

    def build(name: str, *, seed: bool) -> bytes:
        flags = reproducible.flags([], nvcc_seed=seed)["NVCC_APPEND_FLAGS"]
        env = {**os.environ, "NVCC_APPEND_FLAGS": " ".join(flags)}
        out = tmp_path / name
        cmd = [NVCC, "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", str(src), "-o", str(out)]
        subprocess.run(cmd, env=env, cwd=tmp_path, check=True, capture_output=True)
        return out.read_bytes()

    # Without the seed, two compiles in two processes differ (the module id carries the process id) ...
    assert build("plain1.so", seed=False) != build("plain2.so", seed=False)
    # ... with the flags every build gets, they are identical.
    assert build("seeded1.so", seed=True) == build("seeded2.so", seed=True)


def unit_spans(units_log: str) -> list[tuple[str, str, float, float]]:
    """(package, unit, start, end) of every compile the last run's broker admitted, from its units.log."""
    run = units_log.rsplit("\n# ", 1)[-1]  # the log grows by run; each starts with a "# <time> run" line
    started: dict[tuple[str, str], list[float]] = {}
    spans = []
    for line in run.splitlines():
        words = line.split()
        if len(words) < 4 or line.startswith("#"):
            continue
        at, event, package, unit = float(words[0]), words[1], words[2], words[3]
        if event in ("start", "retry"):
            started.setdefault((package, unit), []).append(at)
        elif event == "end" and started.get((package, unit)):
            spans.append((package, unit, started[package, unit].pop(0), at))
    return spans


@pytest.mark.needs_nvcc
def test_doit_repro_rebuilds_packages_at_once_on_the_runs_job_budget(
    quick_cache: Path, tmp_path: Path, server: object
) -> None:
    """The rebuilds run at once, their compiles admitted by the run's one broker (units.log), and still compare."""
    ws = make_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    res = ws.doit("repro", "profile=quick", "jobs=4")
    assert built_packages(res.stdout) == []  # the wheels are the cache's: nothing but the rebuilds compiles
    assert "3 of 3 wheel(s) identical" in res.stdout, res.stdout
    assert len(re.findall(r"^job budget: 4 \(jobs=4\b.*; jobserver with 4 slots", res.stdout, flags=re.M)) == 1
    for name in ("repro_pure", "repro_pybind", "repro_cuda"):
        assert re.search(rf"^rebuilt {name} in [\d.]+s: identical$", res.stdout, flags=re.M), res.stdout
        assert (ws.root / "build" / "logs" / f"repro-{name}.log").is_file()  # each rebuild has its own log
    # Every compile of the two compiled packages ran (no object cache) through the run's broker ...
    spans = unit_spans((ws.root / "build" / "logs" / "units.log").read_text())
    packages = {p for p, *_ in spans}
    assert packages == {"repro_pybind", "repro_cuda"}, spans
    # ... and at some moment units of both were in flight: the rebuilds overlapped.
    overlapping = [(a, b) for a in spans for b in spans if a[0] < b[0] and max(a[2], b[2]) < min(a[3], b[3])]
    assert overlapping, f"no compile of one package ran while one of another did: {spans}"
    report = json.loads((ws.root / "build" / "repro" / "report.json").read_text())
    assert report["ok"] and [r["package"] for r in report["results"]] == ["repro_pure", "repro_pybind", "repro_cuda"]


@pytest.mark.needs_nvcc
def test_sigint_during_parallel_repro_stops_every_rebuild(quick_cache: Path, tmp_path: Path, server: object) -> None:
    ws = make_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    ws.doit("wheels", "profile=quick")
    proc = ws.popen("repro", "profile=quick", "jobs=4")
    logs = [ws.root / "build" / "logs" / f"repro-{name}.log" for name in ("repro_pybind", "repro_cuda")]
    units = ws.root / "build" / "logs" / "units.log"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (
        all(log.exists() and "pip" in log.read_text() for log in logs)
        and units.exists()
        and " start " in units.read_text()
    ):
        time.sleep(0.1)
    assert proc.poll() is None, "the rebuilds finished before they could be interrupted"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    assert "Traceback" not in out
    assert any("interrupted" in log.read_text() for log in logs), out
    assert not (ws.root / "build" / "repro" / "report.txt").exists()
    repro_dir = ws.root / "build" / "repro"
    assert not any(p.name.endswith("-rebuild") for p in repro_dir.iterdir()), list(repro_dir.iterdir())
    assert not any((ws.cache / "tmp").iterdir())
    time.sleep(1)  # no compiler left running in the background
    assert str(ws.root) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
