"""`doit plan` on the example lock: real doit runs in workspaces, a real HTTP remote cache on loopback."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import QUICK, REPO, Workspace, copy_cache, entries, make_workspace
from serve import FixtureServer

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
    assert doc["schema"] == "reprostack-plan/1"
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

    nothing = make_workspace(tmp_path / "nothing", tmp_path / "nothing-cache", server.url)
    res = nothing.doit("hints", "profile=quick", check=False)
    assert res.returncode == 10 and "no package of profile quick has compile units recorded" in res.stderr, res.stderr
