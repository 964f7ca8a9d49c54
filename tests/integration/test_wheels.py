"""`doit wheels` end to end on the example lock: real git, real HTTP on loopback, real compilers."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    EXAMPLE_LOCK,
    REPO,
    Workspace,
    built_packages,
    copy_cache,
    lock_text_for,
    make_workspace,
    scratch_venv,
)

from tasks.core.treehash import file_sha256

pytestmark = pytest.mark.integration

QUICK = ["repro_cuda", "repro_pure", "repro_pybind"]


def find_cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    for base in sys.path:
        cand = Path(base) / "nvidia" / "cu13" / "bin" / "cuobjdump"
        if cand.is_file():
            return str(cand)
    return None


def manifest(ws: Workspace) -> dict[str, object]:
    doc: dict[str, object] = json.loads((ws.wheels / "manifest.json").read_text())
    return doc


@pytest.mark.needs_nvcc
@pytest.mark.needs_torch
def test_full_example_lock_builds_installs_and_is_reused(workspace: Workspace, tmp_path: Path) -> None:
    ws = workspace
    # The torch extension's build (pip, torch's import, g++) needs far more than this per job.
    text = ws.lock.read_text()
    ws.lock.write_text(
        text.replace(
            'build_requires = ["setuptools>=61", "torch"]\n',
            'build_requires = ["setuptools>=61", "torch"]\nmem_per_job_gb = 0.05\n',
            1,
        )
    )
    res = ws.doit("wheels")
    assert sorted(built_packages(res.stdout)) == sorted([*QUICK, "repro_torchext"])
    warned = re.findall(
        r"^warning: (\w+): its largest process used ([\d.]+) GB, more than mem_per_job_gb = 0.05 GB",
        res.stdout,
        flags=re.M,
    )
    assert [name for name, _ in warned] == ["repro_torchext"], res.stdout
    assert "raise mem_per_job_gb for repro_torchext in the lock" in res.stdout
    doc = manifest(ws)
    wheels = {w["package"]: w for w in doc["wheels"] if w["origin"] != "fetched"}  # type: ignore[attr-defined]
    assert set(wheels) == {"repro_pure", "repro_pybind", "repro_cuda", "repro_torchext"}
    for w in wheels.values():
        assert file_sha256(ws.wheels / w["filename"]) == w["sha256"]
        assert len(w["action_key"]) == 64 and w["sources"][0]["tree_sha256"]
    # The CUDA kernel was compiled to sm_90a machine code.
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        pytest.fail("cuobjdump not found: pip install nvidia-cuda-cuobjdump (see pyproject's example extra)")
    unpacked = tmp_path / "unpacked"
    shutil.unpack_archive(ws.wheels / wheels["repro_cuda"]["filename"], unpacked, format="zip")
    so = next(unpacked.glob("repro_cuda/_vadd*.so"))
    listing = subprocess.run([cuobjdump, "--list-elf", str(so)], capture_output=True, text=True, check=True).stdout
    assert "sm_90a" in listing
    # Offline install, hash-checked, into a fresh environment that sees torch from this one.
    py = scratch_venv(tmp_path / "venv")
    pip_env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--find-links",
            str(ws.wheels),
            "--require-hashes",
            "-r",
            str(ws.wheels / "requirements.txt"),
        ],
        check=True,
        env=pip_env,
    )
    out = subprocess.run(
        [
            py,
            "-c",
            "import repro_pure, repro_pybind, repro_torchext, torch, repro_cuda\n"
            "print(repro_pure.MESSAGE, repro_pybind.add(2, 3),"
            " repro_torchext.scaled_add(torch.ones(2), torch.ones(2), 2.0).tolist(),"
            " repro_cuda.device_count() >= 0)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["patched", "5", "[3.0,", "3.0]", "True"]
    # ... and through the PEP 503 index.
    subprocess.run(
        [
            py,
            "-m",
            "pip",
            "install",
            "-q",
            "--force-reinstall",
            "--no-deps",
            "--index-url",
            (ws.wheels / "simple").as_uri(),
            "repro-pure",
        ],
        check=True,
        env=pip_env,
    )
    # The run's timeline: one row per package, translation units of the ninja-built torch extension.
    trace = json.loads((ws.root / "build" / "trace.json").read_text())
    rows = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert rows == {"repro_pure", "repro_pybind", "repro_cuda", "repro_torchext"}
    assert any(e["cat"] == "compile" and e["name"].endswith(".o") for e in trace["traceEvents"] if e["ph"] == "X")
    assert "repro_torchext  built" in res.stdout
    # Each compile's memory, recorded for the next build's admission (docs/building.md, "Memory per unit"):
    # the torch extension's g++ holds torch's headers, far more than the 0.05 GB the lock states.
    memory = json.loads((ws.cache / "timings" / "repro_torchext.memory.json").read_text())
    unit = memory["scaled_add.o"]
    assert unit["peak_in"] == "cc1plus" and 200 < unit["peak_mb"] < 8000 and unit["seconds"] > 0, memory
    units_log = (ws.root / "build" / "logs" / "units.log").read_text()
    assert re.search(r" start repro_torchext scaled_add\.o expect=51MB ", units_log), units_log
    assert " end repro_torchext scaled_add.o " in units_log
    # doit verify on the wheelhouse: every check passes or, for the GPU ones here, is skipped.
    report = ws.doit("verify").stdout
    assert re.search(r"^\d+ passed, 0 failed, \d+ skipped$", report, flags=re.M), report
    assert "smoke:scaled_add    PASS" in report and "arch                PASS" in report
    # 4 built and the 4 of the runtime closure
    assert re.search(r"^wheelhouse\s+provenance\s+PASS\s+8 wheels", report, flags=re.M), report
    # Nothing is rebuilt on a second run, nor after doit's state file is deleted.
    assert built_packages(ws.doit("wheels").stdout) == []
    for state in ws.root.glob(".doit.db*"):
        state.unlink()
    again = ws.doit("wheels")
    assert built_packages(again.stdout) == []
    assert manifest(ws) == doc
    # A run that built nothing keeps the cold build's timeline.
    assert json.loads((ws.root / "build" / "trace.json").read_text()) == trace


@pytest.mark.needs_nvcc
def test_a_b_a_switch_rebuilds_nothing_the_second_time(quick_cache: Path, tmp_path: Path, server: object) -> None:
    ws = make_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    ws.lock.write_text(
        ws.lock.read_text() + "\n[profiles.variant]\n[profiles.variant.packages.repro_cuda.env]\n"
        'REPRO_CUDA_VARIANT = "b"\n[profiles.variant.packages.repro_torchext]\nenabled = false\n'
    )
    assert built_packages(ws.doit("wheels", "profile=quick").stdout) == []
    a = manifest(ws)
    assert built_packages(ws.doit("wheels", "profile=variant").stdout) == ["repro_cuda"]
    b = manifest(ws)
    assert {w["package"] for w in b["wheels"] if w["origin"] != "fetched"} == set(QUICK)  # type: ignore[attr-defined]
    assert built_packages(ws.doit("wheels", "profile=quick").stdout) == []
    assert manifest(ws)["wheels"] == a["wheels"]


def test_tampered_archive_is_refused_and_nothing_is_cached(tmp_path: Path, published: Path) -> None:
    from serve import FixtureServer

    served = tmp_path / "served"
    shutil.copytree(published, served)
    tar = served / "archives" / "repro_pybind-0.1.0.tar"
    data = bytearray(tar.read_bytes())
    data[600] ^= 0x01
    tar.write_bytes(bytes(data))
    with FixtureServer(served, port=0) as srv:
        ws = make_workspace(tmp_path / "ws", tmp_path / "cache", srv.url)
        res = ws.doit("fetch:repro-pybind", check=False)
    assert res.returncode != 0
    text = res.stdout + res.stderr
    assert "VerificationError: source repro-pybind: archive from" in text
    assert file_sha256(tar) in text and "3fa033486ba7b3405943c45f1a38a3865decb5015a16f261ad0a864ad32181c4" in text
    assert "Traceback" not in text
    assert not any((ws.cache / "sources").iterdir())
    assert not any((ws.cache / "tmp").iterdir())


def test_wrong_tree_hash_is_refused(workspace: Workspace) -> None:
    ws = workspace
    good = "042cd46d42fec8c7870dc4caff656067ed3ebf3a21a6d56d64284f5528af94e2"
    ws.edit_lock(good, "0" * 64)
    res = ws.doit("wheels", "profile=quick", check=False)
    assert res.returncode != 0
    text = res.stdout + res.stderr
    assert f"source repro-pure: tree hash {good}" in text and "0" * 64 in text
    assert not (ws.cache / "sources" / ("0" * 64)).exists()
    assert not (ws.cache / "sources" / good).exists()
    assert not (ws.wheels / "manifest.json").exists()


def test_patch_that_does_not_apply_names_patch_and_hunk(workspace: Workspace) -> None:
    ws = workspace
    patch = ws.root / "patches" / "repro_pure" / "0001-patched-message.patch"
    patch.write_text(patch.read_text().replace('-MESSAGE = "unpatched"', '-MESSAGE = "something else"'))
    res = ws.doit("build:repro_pure", check=False)
    assert res.returncode != 0
    text = res.stdout + res.stderr
    assert f"PatchError: patch {patch} does not apply" in text
    assert "failing hunk: repro_pure/__init__.py: @@ -1,6 +1,6 @@" in text
    assert "Traceback" not in text
    stage = ws.root / "build" / "stage"
    assert not stage.exists() or not any(stage.iterdir())


def test_malformed_lock_reports_every_problem(workspace: Workspace) -> None:
    ws = workspace
    ws.edit_lock('kind = "url"', 'kind = "url"\nsha = "abc"')
    ws.edit_lock('source = "repro-pure"', 'source = "repro-pur"')
    ws.edit_lock('commit = "df2a08ea1349bfb47e7940d56c8a2c5c9135f354"', 'commit = "df2a08e"')
    res = ws.doit("list", check=False)
    assert res.returncode == 11
    err = res.stderr
    assert "3 problems in the lock file" in err
    assert "[sources.repro-pybind] unknown key 'sha' (perhaps you meant 'sha256'?)" in err
    assert (
        "[packages.repro_pure] source 'repro-pur' is not defined under [sources] (perhaps you meant 'repro-pure'?)"
        in err
    )
    assert "[sources.repro-pure] commit must be a full 40-character lowercase hex commit, got 'df2a08e'" in err
    assert "Traceback" not in err


def test_corrupted_cache_entry_is_discarded_and_rebuilt(quick_cache: Path, tmp_path: Path, server: object) -> None:
    ws = make_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    ws.doit("wheels", "profile=quick")
    entry = next(p for p in (ws.cache / "wheels").glob("*/*/repro_pybind-*.whl"))
    good = file_sha256(entry)
    with entry.open("r+b") as fh:
        fh.seek(100)
        fh.write(b"garbage")
    shutil.rmtree(ws.wheels)
    res = ws.doit("wheels", "profile=quick")
    assert "corrupted wheel cache entry" in res.stderr
    assert built_packages(res.stdout) == ["repro_pybind"]
    rebuilt = next(w for w in manifest(ws)["wheels"] if w["package"] == "repro_pybind")  # type: ignore[attr-defined]
    assert rebuilt["sha256"] == good  # same inputs, same bytes


@pytest.mark.needs_nvcc
def test_concurrent_runs_share_one_cache(tmp_path: Path, server: object) -> None:
    url = server.url  # type: ignore[attr-defined]
    cache = tmp_path / "cache"
    one = make_workspace(tmp_path / "one", cache, url)
    two = make_workspace(tmp_path / "two", cache, url)
    procs = [one.popen("wheels", "profile=quick"), two.popen("wheels", "profile=quick")]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    built = built_packages(outputs[0]) + built_packages(outputs[1])
    assert sorted(built) == QUICK  # each package compiled exactly once
    assert manifest(one)["wheels"] == manifest(two)["wheels"]
    assert not any((cache / "tmp").iterdir())


@pytest.mark.needs_nvcc
def test_sigint_during_build_leaves_nothing_partial(workspace: Workspace) -> None:
    ws = workspace
    proc = ws.popen("build:repro_torchext")
    log = ws.root / "build" / "logs" / "build-repro_torchext.log"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (log.exists() and "pip" in log.read_text()):
        time.sleep(0.2)
    time.sleep(3)  # well inside the compile
    assert proc.poll() is None, "the build finished before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "interrupted" in log.read_text()
    assert not list((ws.cache / "wheels").glob("*/*/repro_torchext*"))
    assert not any((ws.cache / "tmp").iterdir())
    assert not (ws.root / "wheels").exists()
    stage = ws.root / "build" / "stage"
    assert not stage.exists() or not any(stage.iterdir())
    # No compiler left running in the background.
    time.sleep(1)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(ws.root) not in ps
    ws.doit("wheels")


@pytest.mark.needs_nvcc
def test_mirror_serves_an_offline_host(quick_cache: Path, tmp_path: Path, server: object) -> None:
    ws = make_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    mirror = tmp_path / "mirror"
    ws.doit("wheels", "profile=quick")
    ws.doit("mirror", f"mirror={mirror}")
    index = json.loads((mirror / "index.json").read_text())
    assert set(index) == {"repro-pure", "repro-torchext", "repro-pybind", "repro-cuda"}
    # A fresh cache, and every URL pointing at a port where nothing listens.
    offline = make_workspace(tmp_path / "offline", tmp_path / "cache2", "http://127.0.0.1:9")
    os.chmod(mirror, 0o555)
    try:
        res = offline.doit("wheels", "profile=quick", f"mirror={mirror}")
    finally:
        os.chmod(mirror, 0o755)
    assert sorted(built_packages(res.stdout)) == QUICK
    # Same inputs, same action keys, and the same bytes: built again from scratch in another
    # directory, later, the wheels (the CUDA one included) are identical.
    keys = {w["package"]: (w["action_key"], w["sha256"]) for w in manifest(ws)["wheels"]}  # type: ignore[attr-defined]
    assert {w["package"]: (w["action_key"], w["sha256"]) for w in manifest(offline)["wheels"]} == keys  # type: ignore[attr-defined]


def test_lock_resolves_refs_and_fills_hashes(workspace: Workspace) -> None:
    ws = workspace
    text = ws.lock.read_text()
    stripped = "\n".join(
        line
        for line in text.splitlines()
        if not line.startswith(("commit = ", "tree_sha256 = ", "sha256 = ", "filename = ", '"third_party/minihdr"'))
        and line != "[sources.repro-torchext.submodules]"
    )
    ws.lock.write_text(stripped + "\n")
    res = ws.doit("wheels", check=False)
    assert res.returncode != 0 and "Run `doit lock` first" in res.stdout + res.stderr
    ws.doit("lock")
    relocked = ws.lock.read_text()
    expected = lock_text_for(ws.index_url.removesuffix("/simple"), EXAMPLE_LOCK)
    for line in expected.splitlines():
        if line.startswith(("commit = ", "tree_sha256 = ", "sha256 = ", "filename = ", '"third_party/minihdr"')):
            # The stripped submodule line took its license with it: `doit lock` restores url and commit.
            line = line.replace(', license = "MIT"', "")
            assert line.replace(" ", "") in relocked.replace(" ", ""), line


@pytest.mark.needs_nvcc
def test_toolchain_mismatch_is_a_clear_error(workspace: Workspace) -> None:
    """A torch the lock does not expect fails the packages that build against torch, naming them (exit 16);
    the others build."""
    ws = workspace
    ws.edit_lock('torch = ">=2.4"', 'torch = "==1.0.*"')
    ws.edit_lock("optional = true  # left out, with one line saying why, where torch is not installed\n", "")
    res = ws.doit("--continue", "wheels", check=False)  # the other builds run to the end, whatever fails first
    assert res.returncode == 16, res.stdout + res.stderr
    assert "ToolchainError: package repro_torchext: the build toolchain does not match" in res.stderr
    assert "does not satisfy '==1.0.*'" in res.stderr
    assert sorted(built_packages(res.stdout)) == QUICK


def test_list_info_clean(workspace: Workspace) -> None:
    ws = workspace
    listing = ws.doit("list", "--all").stdout
    for name in ("lock", "fetch", "mirror", "build", "wheels", "verify", "stage"):
        assert name in listing
    started = time.monotonic()
    ws.doit("list")
    assert time.monotonic() - started < 30
    info = ws.doit("info", "wheels", check=False).stdout  # exit status 1: the task would run
    assert "WheelhouseCurrent" in info and "status     : run" in info
    ws.doit("wheels", "profile=quick")
    assert (ws.wheels / "manifest.json").exists()
    assert "status     : up-to-date" in ws.doit("info", "wheels", "profile=quick").stdout
    ws.doit("clean", "wheels", "profile=quick")
    assert not ws.wheels.exists()
    assert REPO.is_dir()
