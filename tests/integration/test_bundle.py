"""Air-gapped delivery with real builds: doit bundle, then doit unbundle verifies before anything is used."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

from conftest import Workspace, copy_cache, make_workspace, venv_with_pip
from fake_wheels import publish_fake_toolchain
from serve import FixtureServer

from tasks.core.treehash import file_sha256
from tasks.lock.lockfile import load_lock


def _bundle(ws_root: Path) -> Path:
    (found,) = (ws_root / "build" / "bundle").glob("reprostack-*-quick.tar")
    return found


def _retar(src: Path, dest: Path, *, change: str | None = None, add: str | None = None) -> None:
    """Copy a bundle, altering one member's bytes or adding one member."""
    with tarfile.open(src) as tin, tarfile.open(dest, "w", format=tarfile.GNU_FORMAT) as tout:
        for member in tin.getmembers():
            data = tin.extractfile(member).read() if member.isfile() else None  # type: ignore[union-attr]
            if data is not None and member.name == change:
                data = data[:-1] + bytes([data[-1] ^ 1])
            if data is None:
                tout.addfile(member)
            else:
                import io

                tout.addfile(member, io.BytesIO(data))
        if add:
            import io

            info = tarfile.TarInfo(add)
            info.size = 4
            tout.addfile(info, io.BytesIO(b"evil"))


def _listing(root: Path) -> dict[str, str]:
    """Every file under ``root`` and its sha256."""
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def test_bundle_unbundle_and_refusal_of_altered_bundles(quick_cache: Path, tmp_path: Path, server: object) -> None:
    ws = make_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    ws.doit("wheels", "profile=quick")
    res_bundle = res = ws.doit("bundle", "profile=quick", "bundle_mirror=on")
    bundle = _bundle(ws.root)
    assert f"sha256 {file_sha256(bundle)}" in res.stdout
    assert (bundle.with_name(bundle.name + ".sha256")).read_text().split()[0] == file_sha256(bundle)

    # The same inputs give the same bundle, byte for byte.
    first = file_sha256(bundle)
    ws.doit("bundle", "profile=quick", "bundle_mirror=on")
    assert file_sha256(bundle) == first

    dest = tmp_path / "site" / "stack"
    res = ws.doit("unbundle", f"bundle={bundle}", f"dest={dest}")
    assert "verified" in res.stdout and "parts: wheels, mirror, tool" in res.stdout
    manifest = json.loads((dest / "wheels" / "manifest.json").read_text())
    for wheel in manifest["wheels"]:
        assert file_sha256(dest / "wheels" / wheel["filename"]) == wheel["sha256"]
    assert (dest / "wheels" / "sbom.cdx.json").is_file()
    assert (dest / "mirror" / "index.json").is_file()
    # The bundle's mirror is what `doit mirror` writes: the profile's sources and the runtime closure's wheels.
    closure = [w for w in manifest["wheels"] if w["origin"] == "fetched"]
    assert len(closure) == 4, manifest["wheels"]  # repro-colors, -greeting, -round, -shapes
    for wheel in closure:
        assert file_sha256(dest / "mirror" / "wheels" / wheel["filename"]) == wheel["sha256"], wheel["filename"]
    mirror = tmp_path / "mirror"
    ws.doit("mirror", "profile=quick", f"mirror={mirror}")
    # The tool's own wheels: in the mirror's tool/ and the bundle's, the same bytes (tasks/image/selfwheels.py).
    in_mirror = _listing(mirror)
    tool = {k.removeprefix("tool/"): v for k, v in in_mirror.items() if k.startswith("tool/")}
    assert tool == _listing(dest / "tool") and "requirements.txt" in tool
    assert any(name.startswith("reprostack-") and name.endswith(".whl") for name in tool), tool
    assert _listing(dest / "mirror") == {k: v for k, v in in_mirror.items() if not k.startswith("tool/")}
    assert (dest / "lock" / "example.lock").read_text() == ws.lock.read_text()

    # Refused: a changed wheel, an extra file, a truncated transfer; nothing is left behind.
    (wheel_name,) = [w["filename"] for w in manifest["wheels"] if w["package"] == "repro_pure"]
    cases = {
        "changed": dict(change=f"reprostack-bundle/wheels/{wheel_name}"),
        "added": dict(add="reprostack-bundle/wheels/extra.whl"),
    }
    for name, how in cases.items():
        bad = tmp_path / f"{name}.tar"
        _retar(bundle, bad, **how)  # type: ignore[arg-type]
        out = tmp_path / "site" / name
        res = ws.doit("unbundle", f"bundle={bad}", f"dest={out}", check=False)
        assert res.returncode == 20, res.stdout + res.stderr  # BundleError's status (docs/tasks.md)
        assert "the bundle was altered or is incomplete; nothing was unpacked" in res.stdout + res.stderr
        assert not out.exists()
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{name}.")]
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(bundle.read_bytes()[: bundle.stat().st_size // 2])
    (tmp_path / "truncated.tar.sha256").write_text(bundle.with_name(bundle.name + ".sha256").read_text())
    res = ws.doit("unbundle", f"bundle={truncated}", f"dest={tmp_path / 'site' / 't'}", check=False)
    assert res.returncode == 20 and "differs from truncated.tar.sha256" in res.stdout + res.stderr

    # Without doit or the checkout, as on a host that has only python3: the instruction `doit bundle` printed,
    # run by an interpreter that sees the standard library alone, from the bundle's directory.
    (printed,) = [line for line in res_bundle.stdout.splitlines() if "with only python3" in line]
    words = shlex.split(printed.split(": ", 1)[1].replace(" DIR", f" {tmp_path / 'plain'}"))
    assert words[:2] == ["python3", "-c"], words
    plain = subprocess.run(
        [sys.executable, "-I", "-S", *words[1:]],
        cwd=bundle.parent,
        env={"PATH": os.defpath},
        capture_output=True,
        text=True,
        check=False,
    )
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert (tmp_path / "plain" / "wheels" / wheel_name).is_file()
    assert "install the tool: python3 -m venv" in plain.stdout
    # ... and the tool installs there from the bundle's own wheels, with no index at all, and runs.
    site = tmp_path / "plain"
    venv_with_pip(site / "venv")
    offline = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "REPRO_"))}
    offline.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1")
    install = [str(site / "venv" / "bin" / "pip"), "install", "-q", "--find-links", str(site / "tool")]
    install += ["--require-hashes", "-r", str(site / "tool" / "requirements.txt")]
    subprocess.run(install, env=offline, cwd=site, capture_output=True, text=True, timeout=600, check=True)
    again = subprocess.run(  # the installed tool, in a directory of its own: unbundle the bundle once more
        [str(site / "venv" / "bin" / "reprostack"), "unbundle", f"bundle={bundle}", "dest=again"],
        env=offline,
        cwd=site,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert again.returncode == 0 and "verified" in again.stdout, again.stdout + again.stderr
    assert (site / "again" / "wheels" / wheel_name).is_file()


HERMETIC_LOCK = """\
format = 1
[toolchain]
archs = ["sm_90a"]
[toolchain.hermetic]
requirements = ["fake-cuda-tool==1.0", "fake-cuda-rt==2.0"]
[sources]
[packages]
"""


def test_the_bundles_mirror_carries_the_hermetic_toolchain_from_the_mirror_it_is_given(tmp_path: Path) -> None:
    """bundle_mirror=on with mirror=DIR (a `doit mirror` directory): its toolchain wheels go into the bundle,
    taken from DIR, so the bundle is made with no index at all."""
    served = tmp_path / "index"
    wheels = publish_fake_toolchain(served)
    ws = Workspace(root=tmp_path / "ws", cache=tmp_path / "cache", index_url="")
    ws.root.mkdir()
    ws.lock.write_text(HERMETIC_LOCK)
    mirror = tmp_path / "mirror"
    with FixtureServer(served) as server:
        ws.index_url = f"{server.url}/simple"
        ws.doit("lock")
        ws.doit("mirror", f"mirror={mirror}")
    ws.index_url = "http://127.0.0.1:9/simple"  # the server is gone: nothing can be downloaded
    ws.doit("wheels")
    ws.doit("bundle", f"mirror={mirror}", "bundle_mirror=on")
    (bundle,) = (ws.root / "build" / "bundle").glob("*.tar")
    ws.doit("unbundle", f"bundle={bundle}", f"dest={tmp_path / 'site'}")
    assert _listing(tmp_path / "site" / "mirror" / "wheels") == _listing(mirror / "wheels")
    pinned = {h for pin in load_lock(ws.lock).toolchain.hermetic for h in pin.hashes}
    assert set(_listing(mirror / "wheels").values()) == pinned and wheels["rt"].name in _listing(mirror / "wheels")
