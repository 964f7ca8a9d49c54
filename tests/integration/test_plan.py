"""`doit plan` on the example lock: real doit runs in workspaces, a real HTTP remote cache on loopback."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    PURE_PROFILE,
    QUICK,
    REPO,
    Workspace,
    built_packages,
    copy_cache,
    entries,
    make_workspace,
    object_counts,
)
from serve import FixtureServer

from tasks.core.digest import action_key
from tasks.store.remote import history_key

pytestmark = pytest.mark.integration

PATCH = "0001-patched-message.patch"


def _cache_server() -> Any:
    """scripts/cache_server.py's CacheServer: GET, HEAD and PUT of files, the Bazel layout remote= speaks."""
    spec = importlib.util.spec_from_file_location("cache_server", REPO / "scripts" / "cache_server.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cache_server"] = module
    spec.loader.exec_module(module)
    return module.CacheServer


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[str]:
    srv = _cache_server()(tmp_path / "remote").start()
    try:
        yield srv.url
    finally:
        srv.stop()


def plan(ws: Workspace, *args: str) -> dict[str, Any]:
    res = ws.doit("plan", "profile=quick", "format=json", *args)
    doc: dict[str, Any] = json.loads(res.stdout)  # stdout is the document alone
    assert doc["schema"] == "reprostack-plan/2"
    return doc


def by_package(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["package"]: p for p in doc["packages"]}


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``roots`` with its size and mtime, but doit's database and the toolchain memo (which a
    probe of a new toolchain writes, as any run does)."""
    found = {}
    for root in roots:
        for p in root.rglob("*"):
            rel = str(p.relative_to(root.parent))
            if p.is_file() and ".doit.db" not in p.name and "/toolchain/" not in rel:
                st = p.stat()
                found[rel] = (st.st_size, st.st_mtime_ns)
    return found


@pytest.fixture
def built(tmp_path: Path, quick_cache: Path, server: FixtureServer) -> Workspace:
    """A workspace whose wheels/ holds the quick profile, built into its own copy of the session's cache."""
    ws = make_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)
    ws.doit("wheels", "profile=quick")
    return ws


@pytest.mark.needs_nvcc
def test_an_unchanged_workspace_is_up_to_date_and_nothing_is_written(built: Workspace) -> None:
    before = snapshot(built.root, built.cache)
    res = built.doit("plan", "profile=quick")
    assert snapshot(built.root, built.cache) == before
    lines = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines() if line.startswith("  ")}
    assert {name: " ".join(lines.get(name, [])) for name in QUICK} == dict.fromkeys(QUICK, "up to date")
    doc = plan(built)
    assert {p["package"]: p["action"] for p in doc["packages"]} == dict.fromkeys(QUICK, "up-to-date")
    assert "forecast: nothing to build" in res.stdout


@pytest.mark.needs_nvcc
def test_nothing_to_build_is_forecast_by_the_no_op_the_last_run_measured(built: Workspace) -> None:
    # The build kept what it took besides its tasks' actions, for this lock and profile.
    record = json.loads((built.cache / "timings" / "noop.json").read_text())
    doc = plan(built)
    (key,) = [k for k in record if k.endswith(":quick")]
    assert len(key.split(":")[0]) == 64  # the lock's sha256
    assert doc["forecast"]["noop"] == "recorded"
    assert doc["forecast"]["wall_s"] == round(record[key]["seconds"], 2) > 0
    assert "took besides its tasks" in built.doit("plan", "profile=quick").stdout
    # Another record there (as a slower host's): the plan says that one, not its own time.
    record[key]["seconds"] = 7.25
    (built.cache / "timings" / "noop.json").write_text(json.dumps(record))
    assert plan(built)["forecast"]["wall_s"] == 7.25
    # A no-op run measures again and keeps its own (7.25 s is more than a quarter off it).
    built.doit("wheels", "profile=quick")
    again = json.loads((built.cache / "timings" / "noop.json").read_text())[key]["seconds"]
    assert 0 < again < 7.25
    # Without a record (or with an unreadable one): the plan's own time, and it says so.
    (built.cache / "timings" / "noop.json").write_text("{not json")
    doc = plan(built)
    assert doc["forecast"]["noop"] == "this plan" and doc["forecast"]["wall_s"] > 0
    assert "what this plan took to find it out" in built.doit("plan", "profile=quick").stdout


@pytest.mark.needs_nvcc
def test_a_patch_edit_names_exactly_that_package_and_that_patch(built: Workspace) -> None:
    patch = built.root / "patches" / "repro_pure" / PATCH
    patch.write_text(patch.read_text().replace('+MESSAGE = "patched"', '+MESSAGE = "patched twice"'))
    before = snapshot(built.root, built.cache)
    doc = plan(built)
    text = built.doit("plan", "profile=quick").stdout
    assert snapshot(built.root, built.cache) == before  # nothing fetched, built or written
    found = by_package(doc)
    assert [name for name, p in found.items() if p["action"] == "build"] == ["repro_pure"]
    pure = found["repro_pure"]
    assert pure["changes"] == [f"patch {PATCH} changed"]
    assert pure["nearest"]["where"] == "local"
    assert pure["nearest"]["key"] == entries(built.cache)["repro_pure"]["key"]
    assert pure["object_cache"] == "all"  # a pure-Python package: no compile units at its last build
    assert pure["forecast"]["record"] == "cache" and pure["forecast"]["wall_s"] > 0
    assert all(found[name]["action"] == "up-to-date" for name in QUICK if name != "repro_pure")
    assert f"  patch {PATCH} changed" in text and "repro_pure" in text
    # The build then prints the forecast beside what it took.
    res = built.doit("wheels", "profile=quick")
    assert "forecast:" in res.stdout and "they took" in res.stdout, res.stdout
    header = next(line for line in res.stdout.splitlines() if line.startswith("package "))
    assert header.split()[-2:] == ["forecast", "s"]


def test_a_build_says_the_time_left_by_its_forecast_and_the_summary_how_it_compared(
    tmp_path: Path, server: FixtureServer
) -> None:
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", server.url)
    ws.lock.write_text(ws.lock.read_text() + PURE_PROFILE)
    cold = ws.doit("wheels", "profile=pure")  # (its output is no terminal: whole lines)
    said = [line for line in cold.stdout.splitlines() if line.startswith("  repro_pure: ")]
    assert said and re.fullmatch(r"  repro_pure: 0m0\ds, remaining unknown \(no history\)", said[0]), cold.stdout
    assert "they took" not in cold.stdout  # no forecast, no comparison

    edit_pure_patch(ws)  # another key: it builds again, with the first build's timings, and wheels/ is assembled
    warm = ws.doit("wheels", "profile=pure")
    assert built_packages(warm.stdout) == ["repro_pure"], warm.stdout
    forecast = re.search(r"^forecast: ([\d.]+) s of wall time for 1 build\(s\) ", warm.stdout, re.M)
    assert forecast, warm.stdout
    first = next(line for line in warm.stdout.splitlines() if line.startswith("  repro_pure: "))
    left = re.fullmatch(r"  repro_pure: 0m0(\d)s, remaining (\d+)m(\d\d)s", first)
    assert left, first  # as the build starts: what the forecast said, less the seconds it has run
    seconds = int(left[2]) * 60 + int(left[3])
    assert round(float(forecast[1])) - int(left[1]) - 1 <= seconds <= round(float(forecast[1])), (first, forecast[0])
    summary = re.search(
        r"^forecast: ([\d.]+) s of wall time for the builds; they took ([\d.]+) s "
        r"\((as forecast|([\d.]+) % (over|under) the forecast)\)$",
        warm.stdout,
        re.M,
    )
    assert summary, warm.stdout
    planned, took = float(summary[1]), float(summary[2])
    if summary[4] is not None:  # (of the figures unrounded: each printed to a tenth)
        # each figure within 0.05 of its own: the percentage (took / planned - 1) within 0.05 (planned + took) /
        # planned^2 of the one they give (a loaded run that took twice its forecast moves it by twice as much)
        slack = 100 * 0.05 * (planned + took) / (planned * (planned - 0.05)) + 0.1
        assert abs(float(summary[4]) - abs(took - planned) / planned * 100) <= slack, summary[0]
        if took != planned:
            assert summary[5] == ("over" if took > planned else "under"), summary[0]


def fake_torch(root: Path, version: str, cuda: str | None, cxx11_abi: bool) -> Path:
    """A directory that, first on PYTHONPATH, makes the build interpreter import a torch of ``version``."""
    pkg = root / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        f"__version__ = {version!r}\n"
        f"class version:\n    cuda = {cuda!r}\n    git_version = ''\n"
        f"class _C:\n    _GLIBCXX_USE_CXX11_ABI = {cxx11_abi!r}\n"
    )
    info = root / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return root


@pytest.mark.needs_nvcc
def test_another_torch_names_every_package_whose_key_holds_it(built: Workspace, tmp_path: Path) -> None:
    docs = {name: meta["key_document"] for name, meta in entries(built.cache).items()}
    dependent = sorted(name for name, doc in docs.items() if "torch" in doc.get("toolchain", {}))
    assert dependent  # the toolchain's torch enters every package's key (tasks/env/toolchain.py, fingerprint)
    tool = docs[dependent[0]]["toolchain"]
    old = tool["torch"]
    path = fake_torch(tmp_path / "torch-2.99", "2.99.0+fake", tool.get("torch_cuda") or None, tool["torch_cxx11_abi"])
    built.env_extra["PYTHONPATH"] = os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    found = by_package(plan(built))
    assert sorted(name for name, p in found.items() if p["action"] == "build") == dependent
    for name in dependent:
        assert found[name]["changes"] == [f"torch {old or '(none)'} -> 2.99.0+fake"], found[name]
    text = built.doit("plan", "profile=quick").stdout
    assert text.count(f"torch {old or '(none)'} -> 2.99.0+fake") == len(dependent)


@pytest.mark.needs_nvcc
def test_a_warm_remote_and_an_empty_cache_restore_each_wheel_with_its_bytes(
    tmp_path: Path, quick_cache: Path, server: FixtureServer, remote: str
) -> None:
    a = make_workspace(tmp_path / "a", copy_cache(quick_cache, tmp_path / "cache-a"), server.url)
    res = a.doit("wheels", "profile=quick", f"remote={remote}", "remote_write=on")
    assert res.stdout.count("uploaded ") == len(QUICK), res.stdout
    sizes = {name: meta["size"] for name, meta in entries(a.cache).items()}

    b = make_workspace(tmp_path / "b", tmp_path / "cache-b", server.url)
    doc = plan(b, f"remote={remote}")
    found = by_package(doc)
    assert {name: p["action"] for name, p in found.items()} == dict.fromkeys(QUICK, "remote")
    assert {name: p["download_bytes"] for name, p in found.items()} == {name: sizes[name] for name in QUICK}
    assert doc["download_bytes"] == sum(sizes[name] for name in QUICK)
    text = b.doit("plan", "profile=quick", f"remote={remote}").stdout
    for name in QUICK:
        assert any(line.split()[:5] == [name, "restored", "from", "the", "remote"] for line in text.splitlines()), text
    # Nothing fetched or written: no wheel in the cache, no wheels/, no build/.
    assert not list((b.cache / "wheels").glob("*/*")) and not b.wheels.exists() and not (b.root / "build").exists()

    # An edit is compared with the remote's history of the package: the nearest build the remote knows.
    patch = b.root / "patches" / "repro_pure" / PATCH
    patch.write_text(patch.read_text().replace('+MESSAGE = "patched"', '+MESSAGE = "patched twice"'))
    pure = by_package(plan(b, f"remote={remote}"))["repro_pure"]
    assert pure["action"] == "build" and pure["changes"] == [f"patch {PATCH} changed"]
    assert pure["nearest"]["where"] == "remote" and pure["nearest"]["key"] == entries(a.cache)["repro_pure"]["key"]


# --------------------------------------------------------------------------- compile units and the object cache

CUDA_PATCHES = {
    # One .cu file's code: that unit compiles, the other two are hits.
    "0001-vadd-code.patch": (
        "--- a/csrc/vadd.cu\n+++ b/csrc/vadd.cu\n@@ -8,3 +8,3 @@\n"
        "     if (i < n) {\n-        out[i] = a[i] + b[i];\n+        out[i] = b[i] + a[i];\n     }\n"
    ),
    # A comment of the header two units read, in place: both are preprocessed again, and then hits.
    "0002-vadd-h-comment.patch": (
        "--- a/csrc/vadd.h\n+++ b/csrc/vadd.h\n@@ -4,3 +4,3 @@\n \n"
        "-/* Returns 0 on success; on failure writes the CUDA error string into err. */\n"
        "+/* Returns 0 on success; on failure, writes the CUDA error string into err. */\n"
        " int repro_vadd(const float* a, const float* b, float* out, size_t n, char* err, size_t errlen);\n"
    ),
    # A comment line added to that header: what follows it moves a line down, so both units compile.
    "0003-vadd-h-line.patch": (
        "--- a/csrc/vadd.h\n+++ b/csrc/vadd.h\n@@ -1,3 +1,4 @@\n #pragma once\n"
        "+/* The vector addition of the CUDA fixture. */\n \n #include <stddef.h>\n"
    ),
}


def use_patches(ws: Workspace, *names: str) -> None:
    """The workspace's lock gives repro_cuda these patches of :data:`CUDA_PATCHES`, in order."""
    folder = ws.root / "patches" / "repro_cuda"
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_text(CUDA_PATCHES[name])
    text = ws.lock.read_text()
    head = '[packages.repro_cuda]\nsource = "repro-cuda"\n'
    assert head in text
    before, after = text.split(head, 1)
    if after.startswith("patches = "):
        after = after.split("\n", 1)[1]
    listed = ", ".join(f'"{n}"' for n in names)
    ws.lock.write_text(before + head + f"patches = [{listed}]\n" + after)


def cuda_units(ws: Workspace, *args: str) -> dict[str, Any]:
    """repro_cuda's entry of the plan (JSON), which must build and know its units."""
    cuda = by_package(plan(ws, *args))["repro_cuda"]
    assert cuda["action"] == "build", cuda
    assert cuda["units"] is not None, cuda
    return cuda


def outcomes(cuda: dict[str, Any]) -> dict[str, str]:
    return {u["unit"]: u["outcome"] for u in cuda["units"]["list"]}


def last_run_units(ws: Workspace) -> tuple[list[str], list[str]]:
    """The compiles and the preprocessor runs of repro_cuda that the last run's gate started (units.log)."""
    text = (ws.root / "build" / "logs" / "units.log").read_text()
    run = text.rsplit("\n# ", 1)[-1]
    started = [line.split()[3] for line in run.splitlines() if line.split()[1:3] == ["start", "repro_cuda"]]
    return sorted(u for u in started if u.endswith(".o")), sorted(u for u in started if u.endswith(".E"))


@pytest.mark.needs_nvcc
def test_the_plan_counts_the_units_the_object_cache_will_answer_and_the_build_agrees(built: Workspace) -> None:
    # An edit to one .cu file: that unit compiles, the others hit.
    use_patches(built, "0001-vadd-code.patch")
    before = snapshot(built.root, built.cache)
    cuda = cuda_units(built)  # (the patch applied in a scratch directory outside the workspace and the cache)
    assert snapshot(built.root, built.cache) == before
    assert outcomes(cuda) == {"vadd.o": "compile", "device.o": "hit", "module.o": "hit"}, cuda["units"]
    assert cuda["units"]["counts"] == {"compile": 1, "preprocessed": 0, "hit": 2, "remote": 0}
    (vadd,) = [u for u in cuda["units"]["list"] if u["outcome"] == "compile"]
    assert vadd["why"] == "csrc/vadd.cu changed" and vadd["seconds"] > 0
    text = built.doit("plan", "profile=quick").stdout
    assert "object cache: of 3 unit(s), 1 compiles, 2 hit" in text, text
    assert "vadd.o compiles (about" in text and "csrc/vadd.cu changed" in text
    res = built.doit("wheels", "profile=quick")
    assert object_counts(res.stdout, "repro_cuda") == (2, 1)
    assert last_run_units(built) == (["vadd.o"], ["vadd.cu.E"])

    # A comment of the header that two units read, changed in place: both are preprocessed, then hit.
    use_patches(built, "0001-vadd-code.patch", "0002-vadd-h-comment.patch")
    cuda = cuda_units(built)
    assert outcomes(cuda) == {"vadd.o": "preprocessed", "device.o": "hit", "module.o": "preprocessed"}
    assert {u["why"] for u in cuda["units"]["list"] if u["why"]} == {"csrc/vadd.h changed in its comments only"}
    res = built.doit("wheels", "profile=quick")
    assert object_counts(res.stdout, "repro_cuda") == (3, 0)
    assert last_run_units(built) == ([], ["module.cpp.E", "vadd.cu.E"])

    # A comment line added to it: the lines after it move, and the preprocessor's output with them: both compile.
    use_patches(built, "0001-vadd-code.patch", "0002-vadd-h-comment.patch", "0003-vadd-h-line.patch")
    cuda = cuda_units(built)
    assert outcomes(cuda) == {"vadd.o": "compile", "device.o": "hit", "module.o": "compile"}
    assert {u["why"] for u in cuda["units"]["list"] if u["why"]} == {"csrc/vadd.h changed"}
    res = built.doit("wheels", "profile=quick")
    assert object_counts(res.stdout, "repro_cuda") == (1, 2)
    assert last_run_units(built) == (["module.o", "vadd.o"], ["module.cpp.E", "vadd.cu.E"])


@pytest.mark.needs_nvcc
def test_a_flag_or_an_emptied_object_cache_compiles_every_unit_and_says_why(built: Workspace) -> None:
    built.edit_lock('REPRO_CUDA_ARCHS = "{archs_semicolon}"', 'REPRO_CUDA_ARCHS = "sm_90a;sm_100a"')
    cuda = cuda_units(built)
    assert set(outcomes(cuda).values()) == {"compile"}
    whys = {u["unit"]: u["why"] for u in cuda["units"]["list"]}
    # The flag that carries the old value on each .cu unit's command line; the C++ unit has none of it.
    change = "env REPRO_CUDA_ARCHS {archs_semicolon} -> sm_90a;sm_100a"  # (the key holds the lock's text)
    assert whys["vadd.o"] == f"flag arch=compute_90a,code=sm_90a ({change})", whys
    assert whys["device.o"] == whys["vadd.o"]
    assert whys["module.o"] == f"{change}: the command lines may change", whys
    built.edit_lock('REPRO_CUDA_ARCHS = "sm_90a;sm_100a"', 'REPRO_CUDA_ARCHS = "{archs_semicolon}"')

    use_patches(built, "0001-vadd-code.patch")
    shutil.rmtree(built.cache / "objects")
    cuda = cuda_units(built)
    assert set(outcomes(cuda).values()) == {"compile"}
    # No entry of the package in the object cache: every unit compiles, and the plan stages no tree to say
    # which of them changed (the cold build with another's records, issue 39's slow plan).
    assert {u["why"] for u in cuda["units"]["list"]} == {"not in the object cache (evicted or cleared)"}
    res = built.doit("wheels", "profile=quick")
    assert object_counts(res.stdout, "repro_cuda") == (0, 3)


@pytest.mark.needs_nvcc
def test_units_on_the_remote_object_cache_count_as_remote_hits(built: Workspace, remote: str) -> None:
    # A build with an empty object cache compiles every unit and shares them through the remote.
    init = built.root / "patches" / "repro_cuda" / "0001-init.patch"
    init.parent.mkdir(parents=True)

    def touch_init(line: str) -> None:  # a file no unit compiles: another key, the same units
        init.write_text(
            "--- a/repro_cuda/__init__.py\n+++ b/repro_cuda/__init__.py\n@@ -3,3 +3,4 @@\n"
            f' from ._vadd import device_count, vadd\n \n __all__ = ["device_count", "vadd"]\n+# {line}\n'
        )

    touch_init("first")
    built.edit_lock('[packages.repro_cuda]\nsource = "repro-cuda"\n',
                    '[packages.repro_cuda]\nsource = "repro-cuda"\npatches = ["0001-init.patch"]\n')  # fmt: skip
    shutil.rmtree(built.cache / "objects")
    res = built.doit("wheels", "profile=quick", f"remote={remote}", "remote_write=on")
    assert object_counts(res.stdout, "repro_cuda") == (0, 3)

    # Another key, the object cache here emptied again: the units are on the remote.
    touch_init("second")
    shutil.rmtree(built.cache / "objects")
    without = cuda_units(built)
    assert set(outcomes(without).values()) == {"compile"}
    cuda = cuda_units(built, f"remote={remote}")
    assert set(outcomes(cuda).values()) == {"remote"}, cuda["units"]
    assert cuda["units"]["remote"] == "checked"
    assert all(u["seconds"] < 5 for u in cuda["units"]["list"])
    res = built.doit("wheels", "profile=quick", f"remote={remote}")
    assert object_counts(res.stdout, "repro_cuda") == (3, 0)
    assert last_run_units(built) == ([], [])


# --------------------------------------------------------------------------- records a real build wrote, damaged


def edit_pure_patch(ws: Workspace) -> None:
    patch = ws.root / "patches" / "repro_pure" / PATCH
    patch.write_text(patch.read_text().replace('+MESSAGE = "patched"', '+MESSAGE = "patched twice"'))


def damage(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old, text[:300])
    path.write_text(text.replace(old, new, 1))


@pytest.mark.needs_nvcc
@pytest.mark.parametrize(
    ("record", "old", "new", "warning"),
    [
        ("repro_cuda.build.json", '"wall_s": ', '"wall_s": "12", "was": ', "wall_s is not a number of seconds"),
        ("repro_cuda.build.json", '"wall_s": ', '"wall_s": 1e999, "was": ', "wall_s is not a number of seconds"),
        ("repro_cuda.build.json", '"slots": ', '"slots": [2], "was": ', "slots is not a number of job slots"),
        ("repro_cuda.units.json", '"time":', '"time":1e20,"was":', "time is not a date"),
        ("repro_cuda.units.json", '"seconds":', '"seconds":NaN,"was":', "is not a number of seconds (nan)"),
        ("repro_cuda.units.json", '"inputs":[', '"inputs":["x",', "are not indexes of its files"),
        ("repro_cuda.memory.json", '"seconds": ', '"seconds": 1e999, "was": ', ""),
        ("repro_cuda.memory.json", '"peak_mb": ', '"peak_mb": "big", "was": ', ""),
        ("repro_cuda.json", ": ", ': NaN, "x": ', ""),
        ("repro_cuda.json", ": ", ': [1e999], "x": ', ""),
    ],
)
def test_the_cache_s_records_damaged_are_no_record_and_the_plan_still_answers(
    built: Workspace, record: str, old: str, new: str, warning: str
) -> None:
    use_patches(built, "0001-vadd-code.patch")  # repro_cuda builds: the plan reads every record of it
    damage(built.cache / "timings" / record, old, new)
    res = built.doit("plan", "profile=quick", "format=json", check=False)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    cuda = by_package(json.loads(res.stdout))["repro_cuda"]
    assert cuda["action"] == "build" and math.isfinite(cuda["forecast"]["wall_s"] or 0.0)
    if warning:
        (line,) = [x for x in res.stderr.splitlines() if record in x]
        assert warning in line and "ignored" in line, res.stderr
    if record.endswith(".units.json"):
        assert cuda["units"] is None  # no record of its units: every unit counted as compiling
    else:
        assert cuda["units"]["counts"]["compile"] == 1
    text = built.doit("plan", "profile=quick")
    assert "Traceback" not in text.stderr and "repro_cuda    built" in text.stdout


@pytest.mark.needs_nvcc
@pytest.mark.parametrize("how", ["entry.json not JSON", "wheel file gone", "filename out of the entry"])
def test_a_wheel_cache_entry_the_build_would_discard_is_a_build_in_the_plan(built: Workspace, how: str) -> None:
    (meta,) = [
        p for p in built.cache.glob("wheels/*/*/entry.json") if json.loads(p.read_text())["package"] == "repro_pybind"
    ]
    doc = json.loads(meta.read_text())
    if how == "entry.json not JSON":
        meta.write_text(meta.read_text()[:-20])
    elif how == "wheel file gone":
        (meta.parent / doc["filename"]).unlink()
    else:
        meta.write_text(json.dumps({**doc, "filename": "../../../../" + doc["filename"]}))
    shutil.rmtree(built.wheels)  # wheels/ to assemble again: `doit wheels` reads every entry
    found = by_package(plan(built))["repro_pybind"]
    assert found["action"] == "build", found
    assert "wheel cache entry" in found["discarded"]
    text = built.doit("plan", "profile=quick").stdout
    assert "repro_pybind  built" in text and "its wheel cache entry would be discarded:" in text
    assert "repro_pybind  restored from the local cache" not in text
    assert meta.exists()  # the plan discards nothing
    res = built.doit("wheels", "profile=quick")
    assert "repro_pybind" in built_packages(res.stdout)  # what the plan said


@pytest.mark.needs_nvcc
def test_a_remote_history_with_entries_of_other_types_or_dates_is_read_around(
    tmp_path: Path, quick_cache: Path, server: FixtureServer, remote: str
) -> None:
    a = make_workspace(tmp_path / "a", copy_cache(quick_cache, tmp_path / "cache-a"), server.url)
    a.doit("wheels", "profile=quick", f"remote={remote}", "remote_write=on")
    store = tmp_path / "remote" / "ac" / history_key("repro_pure")
    history = json.loads(store.read_text())
    (real,) = history["history"]
    odd = {"sources": "not a map", "patches": [1, "x", {"name": 2}], "toolchain": [], "recipe": {"env": 7}}
    hostile = [
        {**real, "time": 1e20},
        {**real, "time": math.nan},
        {**real, "time": "yesterday"},
        {**real, "key_document": odd, "key": action_key(odd), "time": 1.0},  # well formed: compared as data
        {"key": 12, "time": 2.0, "key_document": []},
        "junk",
    ]
    store.write_text(json.dumps({**history, "history": [*hostile, real]}))  # (NaN as Python writes it)
    b = make_workspace(tmp_path / "b", tmp_path / "cache-b", server.url)
    edit_pure_patch(b)
    res = b.doit("plan", "profile=quick", "format=json", f"remote={remote}", check=False)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    pure = by_package(json.loads(res.stdout))["repro_pure"]
    # The real entry is the nearest; the one of other types is compared as data (it differs in more inputs).
    assert pure["nearest"]["key"] == real["key"] and pure["changes"] == [f"patch {PATCH} changed"]
    (warning,) = [line for line in res.stderr.splitlines() if "history" in line]
    assert "5 malformed entries of repro_pure's history ignored" in warning, res.stderr
    text = b.doit("plan", "profile=quick", f"remote={remote}")
    assert "Traceback" not in text.stderr and f"patch {PATCH} changed" in text.stdout


@pytest.mark.needs_nvcc
def test_hints_written_from_a_builds_records_forecast_a_fresh_host(
    tmp_path: Path, quick_cache: Path, server: FixtureServer
) -> None:
    """`doit hints` writes the quick profile's unit hints into the lock's patches/ from the records a real build
    left in the cache (times, memory and when each peak came); a workspace with those patches and an empty
    cache forecasts its builds from them."""
    built = make_workspace(tmp_path / "built", copy_cache(quick_cache, tmp_path / "cache"), server.url)
    res = built.doit("hints", "profile=quick")
    assert "review them with the lock" in res.stdout, res.stdout
    written = sorted(p.relative_to(built.root).as_posix() for p in (built.root / "patches").glob("*/unit-*.quick.json"))
    assert "patches/repro_cuda/unit-times.quick.json" in written, written
    times = json.loads((built.root / "patches" / "repro_cuda" / "unit-times.quick.json").read_text())
    memory = json.loads((built.root / "patches" / "repro_cuda" / "unit-memory.quick.json").read_text())
    assert times and set(memory) <= set(times) and all(found["peak_mb"] > 0 for found in memory.values())

    fresh = make_workspace(tmp_path / "fresh", tmp_path / "empty-cache", server.url)
    fresh_before = plan(fresh)
    shutil.rmtree(fresh.root / "patches")
    shutil.copytree(built.root / "patches", fresh.root / "patches")
    doc = plan(fresh)
    cuda = by_package(doc)["repro_cuda"]["forecast"]
    assert cuda["record"] == "hints" and cuda["range_s"] is not None, cuda
    assert by_package(fresh_before)["repro_cuda"]["forecast"]["record"] == "none"
    # A profile without hints of its own reads the plain files, which the quick profile's did not change.
    assert not (built.root / "patches" / "repro_cuda" / "unit-times.json").exists()

    # The cold build on that host forecasts itself by the same hints, as `doit plan` did: its progress says the
    # time left (a floor, where a package has neither record nor hints), its summary how it compared.
    cold = fresh.doit("wheels", "profile=quick")
    assert re.search(r"^forecast: [\d.]+ s of wall time for \d+ build\(s\), without a record of .*repro_cuda.* "
                     r"\(their compiles by the lock's hints, if any\)", cold.stdout, re.M), cold.stdout  # fmt: skip
    said = [line for line in cold.stdout.splitlines() if line.startswith("  repro_cuda: ")]
    assert said and all(re.search(r", remaining (at least )?\d+m\d\ds", line) for line in said), cold.stdout
    assert re.search(r"^forecast: [\d.]+ s of wall time for the builds; they took [\d.]+ s", cold.stdout, re.M)

    nothing = make_workspace(tmp_path / "nothing", tmp_path / "nothing-cache", server.url)
    res = nothing.doit("hints", "profile=quick", check=False)
    assert res.returncode == 10 and "no package of profile quick has compile units recorded" in res.stderr, res.stderr
