"""Plain `doit verify`'s scratch venv sees what the tool's own venv sees, .pth lines included (real venvs).

On the GPU hosts the tool's venv sees the host's torch through a .pth line naming another venv's
site-packages; the scratch venv must see it too (a .pth line's directory is not searched for .pth
files). An editable install's .pth line names the checkout, which may hold the scratch venv itself
(build/verify/venv): that directory must not count as the tool's own environment, or every
requirement the wheelhouse meets there is called unmet (both seen on the H100 host).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

from tasks.store.manifest import Manifest, WheelSpec
from tasks.verify import checks
from tasks.verify import venv as verify_venv
from tasks.verify.session import VerifySession


def _site(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return Path(out.stdout.strip())


def test_the_scratch_venv_sees_the_tools_pth_dirs_but_not_a_checkout_holding_it(tmp_path: Path) -> None:
    host = tmp_path / "host-site"  # another venv's site-packages, as /opt/torch/.venv's on the GPU host
    (host / "repro_hostonly").mkdir(parents=True)
    (host / "repro_hostonly" / "__init__.py").write_text("")
    (host / "repro_hostonly-1.0.dist-info").mkdir()
    (host / "repro_hostonly-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: repro-hostonly\nVersion: 1.0\n"
    )
    checkout = tmp_path / "checkout"  # an editable install's line: the scratch venv lies inside it
    work = checkout / "build" / "verify"
    work.mkdir(parents=True)
    tool = tmp_path / "tool-venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(tool)
    (_site(tool / "bin" / "python") / "zz-host.pth").write_text(f"{host}\n{checkout}\n")

    session = VerifySession(
        wheel_dir=tmp_path / "wheels", work_dir=work, python=str(tool / "bin" / "python"), gpu="off",
        log_dir=tmp_path / "logs",
    )  # fmt: skip
    base = session.runner_info(session.python, [], log="base-python")
    assert isinstance(base, dict)
    row = verify_venv._make_venv(session, base)
    assert row.status == "PASS", row
    seen = subprocess.run([str(session.venv_python), "-c", "import repro_hostonly, sys; print(sys.path)"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert seen.returncode == 0, seen.stderr  # the host's package, through the tool venv's .pth line
    assert str(host) in session.foreign
    assert not any(session.venv.resolve().is_relative_to(Path(f).resolve()) for f in session.foreign), session.foreign
    assert sysconfig.get_paths()["stdlib"] not in session.foreign


def _dist(site: Path, name: str, version: str, *requires: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", *(f"Requires-Dist: {r}\n" for r in requires)]
    info.joinpath("METADATA").write_text("".join(lines))
    info.joinpath("RECORD").write_text("")


def test_pip_check_leaves_the_tools_own_pins_aside(tmp_path: Path) -> None:
    """On the GPU host, verify ran from the tool's venv, which the scratch venv sees (the base's torch comes
    through it): the wheelhouse's packaging 26.3 broke reprostack's own pin packaging==26.2, which is not
    the target's concern. Those lines are left aside and named; a requirement of anything else that the
    wheelhouse breaks still fails (tests/integration/test_guard.py: a base venv named by python=)."""
    session = VerifySession(
        wheel_dir=tmp_path / "wheels", work_dir=tmp_path / "verify", python=sys.executable, gpu="off",
        log_dir=tmp_path / "logs",
    )  # fmt: skip
    base = session.runner_info(session.python, [], log="base-python")
    assert isinstance(base, dict)
    assert verify_venv._make_venv(session, base).status == "PASS"
    assert {"reprostack", "tomlkit", "packaging"} <= session.tool_own, session.tool_own
    pinned = next(r for r in importlib.metadata.requires("reprostack") or [] if r.startswith("tomlkit"))
    _dist(_site(session.venv_python), "tomlkit", "0.0.1")  # what the wheelhouse installed, against the pin
    spec = WheelSpec(package="tk", name="tomlkit", version="0.0.1", filename="x.whl", sha256="0")
    row = checks._pip_check_row(session, Manifest(archs=(), wheels=(spec,)))
    assert row.status == "PASS", (pinned, row)
    assert "requirements of this tool's own venv left aside: reprostack" in row.detail, row

    session.tool_own = set()  # as when python= names a base that is not this tool's venv
    row = checks._pip_check_row(session, Manifest(archs=(), wheels=(spec,)))
    assert row.status == "FAIL" and "reprostack" in row.detail and "tomlkit 0.0.1" in row.detail, row
