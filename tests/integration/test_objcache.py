"""The compile-object cache with real builds: hits across build trees, wheels unchanged."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import make_workspace, object_counts

from tasks.core.treehash import file_sha256


def _wheel(cache: Path, package: str) -> Path:
    (found,) = cache.glob(f"wheels/*/*/{package}-*.whl")
    return found


@pytest.mark.needs_headers  # compiles the pybind fixture
def test_object_cache_hits_across_trees_and_keeps_wheel_bytes(tmp_path: Path, server: object) -> None:
    cache = tmp_path / "cache"
    ws = make_workspace(tmp_path / "ws", cache, server.url)  # type: ignore[attr-defined]
    # Same sources and flags under another action key: the build tree moves to another path.
    moved_profile = '\n[profiles.moved]\n[profiles.moved.packages.repro_pybind.env]\nX_UNUSED = "1"\n'
    ws.lock.write_text(ws.lock.read_text() + moved_profile)

    off = ws.doit("build:repro_pybind", "objcache=off")
    assert object_counts(off.stdout, "repro_pybind") == (0, 0)
    assert not (cache / "objects").exists()
    uncached = file_sha256(_wheel(cache, "repro_pybind"))

    shutil.rmtree(cache / "wheels")
    cold = ws.doit("build:repro_pybind")
    assert "object cache:" in cold.stdout
    # A build task named on the command line reports its package and writes the build timeline, as wheels does.
    assert "repro_pybind  built" in cold.stdout, cold.stdout
    trace = json.loads((ws.root / "build" / "trace.json").read_text())
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"} == {"repro_pybind"}
    assert object_counts(cold.stdout, "repro_pybind") == (0, 1)
    assert file_sha256(_wheel(cache, "repro_pybind")) == uncached

    shutil.rmtree(cache / "wheels")
    moved = ws.doit("build:repro_pybind", "profile=moved")
    assert object_counts(moved.stdout, "repro_pybind") == (1, 0)
    assert file_sha256(_wheel(cache, "repro_pybind")) == uncached


def test_bad_object_cache_settings_are_refused(tmp_path: Path, server: object) -> None:
    ws = make_workspace(tmp_path / "ws", tmp_path / "cache", server.url)  # type: ignore[attr-defined]
    res = ws.doit("build:repro_pure", "objcache=maybe", check=False)
    assert res.returncode != 0 and "objcache='maybe': use 'on' or 'off'" in res.stderr
    res = ws.doit("build:repro_pure", "objcache_size=lots", check=False)
    assert res.returncode != 0 and "objcache_size='lots'" in res.stderr


@pytest.mark.needs_nvcc
@pytest.mark.needs_torch  # builds the torch extension
def test_compiler_named_by_path_in_cxx_is_cached_too(tmp_path: Path, server: object) -> None:
    # The GPU host sets CXX=/opt/gcc/bin/g++: CMake and torch's cpp_extension then call it by path,
    # past the PATH masquerade. The object cache must still see those compiles.
    gxx = shutil.which("g++")
    assert gxx, "g++ is needed to build the fixtures"
    cache = tmp_path / "cache"
    ws = make_workspace(tmp_path / "ws", cache, server.url)  # type: ignore[attr-defined]
    ws.env_extra["CXX"] = str(Path(gxx).resolve())
    moved_profile = '\n[profiles.moved]\n[profiles.moved.packages.repro_torchext.env]\nX_UNUSED = "1"\n'
    ws.lock.write_text(ws.lock.read_text() + moved_profile)

    cold = ws.doit("build:repro_torchext")
    assert object_counts(cold.stdout, "repro_torchext") == (0, 1)
    log = (ws.root / "build" / "logs" / "build-repro_torchext.log").read_text()
    script = rf"/by-path/[0-9a-f]+/{re.escape(Path(gxx).resolve().name)} "
    assert re.search(script, log), "the compile did not go through the CXX script"
    built = file_sha256(_wheel(cache, "repro_torchext"))

    shutil.rmtree(cache / "wheels")
    moved = ws.doit("build:repro_torchext", "profile=moved")
    assert object_counts(moved.stdout, "repro_torchext") == (1, 0)
    assert file_sha256(_wheel(cache, "repro_torchext")) == built
