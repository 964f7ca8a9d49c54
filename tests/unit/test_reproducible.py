"""What every build gets for bit-for-bit output: flags, environment, the canonical path, the key."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path, PurePosixPath

import pytest
from conftest import require

from tasks.core import proc
from tasks.core.digest import action_key
from tasks.env import reproducible
from tasks.env.reproducible import Placement
from tasks.lock.keys import RECIPE_FORMAT, key_document
from tasks.lock.lockfile import Package, Source


def in_place(stage: Path) -> Placement:
    return Placement(stage=stage, seen=PurePosixPath("/tmp/reprostack-build/pkg"), method="prefix-map")


def test_flags_come_after_the_recipes_own(tmp_path: Path) -> None:
    stage = tmp_path / "stage"
    env = reproducible.apply(
        {"CFLAGS": "-O2 -g", "NVCC_APPEND_FLAGS": "--threads 2", "PATH": "/bin"},
        in_place(stage),
    )
    assert env["PATH"] == "/bin"
    assert env["PYTHONHASHSEED"] == "0" and env["TZ"] == "UTC"
    assert env["CFLAGS"].startswith("-O2 -g ")
    assert f"-ffile-prefix-map={stage}=/tmp/reprostack-build/pkg" in env["CFLAGS"].split()
    assert env["CXXFLAGS"].split()[-1] == f"-ffile-prefix-map={stage}=/tmp/reprostack-build/pkg"
    assert env["LDFLAGS"] == "-Xlinker --discard-all"  # understood by gcc and by nvcc
    nvcc = env["NVCC_APPEND_FLAGS"].split()
    assert nvcc[:2] == ["--threads", "2"] and nvcc[-1] == "-Xlinker=--discard-all"
    assert f"-Xcompiler=-ffile-prefix-map={stage}=/tmp/reprostack-build/pkg" in nvcc


def test_prefix_maps_put_the_most_specific_last(tmp_path: Path) -> None:
    # gcc applies the last matching map: a stage inside the venv must still map to the stage's path.
    venv = tmp_path / "venv"
    place = in_place(venv / "build" / "stage")
    maps = reproducible.prefix_maps(place, prefix=str(venv), base_prefix="/usr")
    assert maps == [(str(venv), reproducible.CANONICAL_VENV), (str(place.stage), str(place.seen))]
    assert reproducible.prefix_maps(place, prefix="/usr", base_prefix="/usr") == [(str(place.stage), str(place.seen))]
    spaced = in_place(tmp_path / "with space")
    assert reproducible.prefix_maps(spaced, prefix="/usr", base_prefix="/usr") == []  # flags split on spaces


def test_key_section_names_no_path_of_this_machine() -> None:
    for method in ("mount-namespace", "prefix-map"):
        text = json.dumps(reproducible.key_section(method))  # type: ignore[arg-type]
        assert sys.prefix not in text and os.getcwd() not in text and str(Path.home()) not in text
    assert reproducible.key_section("mount-namespace") != reproducible.key_section("prefix-map")


def test_reproducibility_settings_enter_the_action_key() -> None:
    src = Source(name="s", kind="git", url="u", commit="a" * 40, tree_sha256="t" * 64)
    pkg = Package(name="p", source="s")

    def key(section: dict[str, object] | None) -> str:
        doc = key_document(
            pkg,
            sources={"s": src},
            patches=[],
            toolchain={},
            archs=["sm_90a"],
            build_requires={},
            reproducible=section,
        )
        assert doc["recipe_format"] == RECIPE_FORMAT
        return action_key(doc)

    mounted = key(reproducible.key_section("mount-namespace"))
    assert mounted != key(reproducible.key_section("prefix-map"))
    assert mounted != key(None)
    changed = reproducible.key_section("mount-namespace")
    changed["flags"]["LDFLAGS"] = []
    assert key(changed) != mounted


def test_a_build_sees_its_stage_at_the_canonical_path(tmp_path: Path) -> None:
    if reproducible.method() != "mount-namespace":
        require("unshare --mount is not permitted on this host (builds fall back to -ffile-prefix-map)")
    stage = tmp_path / "somewhere" / "stage"
    (stage / "sub").mkdir(parents=True)
    (stage / "sub" / "marker").write_text("staged here\n")
    place = reproducible.placement("reprostack-unit-test", stage)
    log = tmp_path / "log"
    try:
        proc.run(
            place.command(["sh", "-c", "pwd; cat marker; touch made-here"], stage / "sub"),
            env=dict(os.environ),
            cwd=stage / "sub",
            log=log,
        )
    finally:
        with contextlib.suppress(OSError):
            Path(place.seen).rmdir()  # the empty mount point on the host
    lines = log.read_text().splitlines()
    assert lines[-2:] == ["/tmp/reprostack-build/reprostack-unit-test/sub", "staged here"]
    assert (stage / "sub" / "made-here").is_file()  # writes land in the stage
    assert place.path(stage / "sub") == "/tmp/reprostack-build/reprostack-unit-test/sub"


def test_a_refused_mount_is_remembered_and_said_once_until_the_kernels_switches_change(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where unshare is refused (a container without privileges), a no-op neither probes again nor says it again
    (a note, not a warning: the ordinary unprivileged case)."""
    reproducible.method.cache_clear()
    if reproducible._probe_memo() is None or not reproducible._mountpoint(reproducible.CANONICAL_ROOT):
        require("no /proc/self/ns here, or /tmp/reprostack-build cannot be made")
    memo = tmp_path / "method-memo"  # not the host's own: builds beside this test keep theirs
    monkeypatch.setattr(reproducible, "_probe_memo", lambda: memo)
    switch = tmp_path / "max_user_namespaces"
    switch.write_text("0\n")
    monkeypatch.setattr(reproducible, "_USERNS_SWITCHES", (str(switch),))
    monkeypatch.setattr(reproducible, "_unshare_prefix", lambda: ["false", "--"])  # the probe fails, for real
    try:
        assert reproducible.method() == "prefix-map"
        said = capsys.readouterr()
        assert "note: building in place with -ffile-prefix-map (unshare --mount is not permitted here)" in said.out
        assert "WARNING" not in said.err
        assert memo.read_text() == "prefix-map 0"
        real_query = proc.query

        def no_process(*args: object, **kwargs: object) -> str:
            raise AssertionError("probed again")

        monkeypatch.setattr(proc, "query", no_process)
        reproducible.method.cache_clear()
        assert reproducible.method() == "prefix-map"
        assert capsys.readouterr() == ("", "")  # said once
        # An administrator allows user namespaces: the switches read otherwise, so the host is probed again.
        switch.write_text("15000\n")
        monkeypatch.setattr(proc, "query", real_query)
        reproducible.method.cache_clear()
        assert reproducible.method() == "prefix-map" and memo.read_text() == "prefix-map 15000"
    finally:
        reproducible.method.cache_clear()


def test_the_namespace_probe_is_remembered(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A no-op computes every key, and each key holds the method: once probed, no process is started for it."""
    reproducible.method.cache_clear()
    if reproducible._probe_memo() is None:
        require("no /proc/self/ns here")
    # Not the host's own memo: the builds and no-ops of other tests beside this one read it (a no-op's record
    # holds its stat), and removing it there made each of them probe and write it again.
    memo = tmp_path / "method-memo"
    monkeypatch.setattr(reproducible, "_probe_memo", lambda: memo)
    if reproducible.method() != "mount-namespace":
        require("unshare --mount is not permitted on this host (builds fall back to -ffile-prefix-map)")
    assert memo.read_text() == "mount-namespace"

    def no_process(*args: object, **kwargs: object) -> str:
        raise AssertionError("probed again")

    monkeypatch.setattr(proc, "query", no_process)
    reproducible.method.cache_clear()
    assert reproducible.method() == "mount-namespace"
    reproducible.method.cache_clear()
