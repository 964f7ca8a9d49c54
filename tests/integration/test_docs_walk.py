"""The docs walk (scripts/docs_walk.py, issue 38): docs/real-stack.md, docs/offline.md and docs/your-package.md run
as written, a user's way: the mirror written on this host with network, from the example upstreams on loopback;
the node offline in a container with ``--network none`` of Debian trixie (Python 3.13: another Python than this
host's), the tool installed there from the mirror's tool/, the lock and its patches in a directory of their own.

The example lock stands in for sources.lock (``LOCKDIR`` holds it as ``sources.lock``, its URLs on this run's
port; ``PROFILE=quick``; its ``[runtime] python`` the node's, as sources.lock names the GPU hosts' 3.12, so
that the mirror writes the tool's wheels for the node's Python by default). Where the node's Python is not
this host's, the tool's wheels built for one Python (charset-normalizer's) come for the node's from the
package index (PyPI) into the site's find-links folder before the walk, as a mirror host's pip would fetch
them. The node stands in for a GPU host: a stand-in driver with one sm_90 GPU and a stand-in torch in its base
Python. docs/your-package.md walks a lock of our pure-Python fixture ("your own package"), its
build requirements from a folder of wheels this venv writes. ``DOCS_WALK_SUITE=bookworm`` gives the node Debian
bookworm's Python 3.11 instead.

Where docker is not usable the walk's node runs locally (the walk says so) and the example lock's provided torch
must be this host's; in CI docker is required.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLE_LOCK, REPO, ci_requires, lock_text_for, require
from serve import FixtureServer

from tasks.core.errors import FetchError
from tasks.image import selfwheels
from tasks.lock.lockfile import load_lock

pytestmark = pytest.mark.integration

WALK = REPO / "scripts" / "docs_walk.py"
SUITE = os.environ.get("DOCS_WALK_SUITE", "trixie")


def your_lock(url: str) -> str:
    """docs/your-package.md's step 2 for "your own package" (our pure-Python fixture from git, with a patch of
    the lock's patches/): no pins yet, `reprostack lock` writes them. tests/integration/test_your_package.py
    goes the same way with a C++ extension; the walk's node compiles one (docs/real-stack.md)."""
    return f"""\
format = 1
patches_dir = "patches"

[toolchain]
python = ">=3.10"
archs = ["sm_90a"]

[sources.my-package]
kind = "git"
url = "{url}/git/repro_pure.git"
ref = "v0.1.0"
license = "MIT"

[packages.repro_pure]
source = "my-package"
build_requires = ["setuptools>=61"]
patches = ["0001-patched-message.patch"]
verify = {{ imports = ["repro_pure"], smoke = "repro_pure" }}

[runtime]
requirements = ["repro-greeting>=0.3"]
python = "{sys.version_info.major}.{sys.version_info.minor}"
"""


def node_python(args: list[str]) -> str:
    """The node's CPython (``3.13``): the node image's python3, or this one's where the node runs locally."""
    if args[args.index("--node") + 1] != "docker":
        return f"{sys.version_info.major}.{sys.version_info.minor}"
    image = args[args.index("--node-image") + 1]
    res = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", image, "python3", "-c",
         "import sys; print(f'{sys.version_info.major}.{sys.version_info.minor}')"],
        capture_output=True, text=True, timeout=300, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def lock_for_node(url: str, python: str) -> str:
    """The example lock with the node's Python as its ``[runtime] python`` (its closure's ``resolved_from`` with it)."""
    text = lock_text_for(url)
    runtime = load_lock(EXAMPLE_LOCK, require_pins=False).runtime
    assert runtime is not None and f'python = "{runtime.python}"\n' in text
    moved = dataclasses.replace(runtime, python=python)
    return text.replace(f'python = "{runtime.python}"\n', f'python = "{python}"\n').replace(
        f'resolved_from = "{runtime.resolved_from}"', f'resolved_from = "{moved.digest()}"'
    )


def tool_wheels_for(python: str, dest: Path) -> None:
    """Into ``dest``: the wheels of the tool's dependencies built for one Python, for CPython ``python``, from the
    package index this host's pip uses (what a mirror host's `doit mirror` fetches for a node's other Python)."""
    if python == selfwheels.this_python():
        return
    store = dest.parent / "fetched-for-node"
    try:
        log = dest.parent / "pip.log"
        selfwheels.write_wheels(dest.parent / "scratch-tool", pythons=(python,), store=store, log=log)
    except FetchError as err:
        require(f"the tool's wheels for the node's CPython {python} need the package index: {err}")
    dest.mkdir(parents=True, exist_ok=True)
    for wheel in store.glob("*/*.whl"):
        shutil.copy2(wheel, dest / wheel.name)


def node_mode() -> list[str]:
    """The walk's node arguments: docker with the stand-ins where it answers, else local (skipped or failed in CI)."""
    res = None
    if shutil.which("docker"):
        res = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if res is not None and res.returncode == 0:
        made = subprocess.run(
            ["bash", str(REPO / "scripts" / "make-base-image.sh"), "node"], env={**os.environ, "SUITE": SUITE},
            capture_output=True, text=True, timeout=1800, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if made.returncode != 0:
            pytest.fail(f"scripts/make-base-image.sh node failed:\n{made.stderr[-3000:]}", pytrace=False)
        image = made.stdout.strip().splitlines()[-1]
        return ["--node", "docker", "--node-image", image, "--fake-gpu", "9.0", "--fake-torch", "2.11.0"]
    why = res.stderr.strip()[-200:] if res is not None else "no docker command"
    if ci_requires():
        pytest.fail(f"CI needs docker for the docs walk's offline node: {why}", pytrace=False)
    probe = subprocess.run(["python3", "-c", "import torch"], capture_output=True, check=False)
    if probe.returncode != 0:
        require(f"no docker ({why}), and this host's python3 has no torch for the example lock's provided set")
    return ["--node", "local", "--fake-gpu", "9.0"]


def walk_env(site: Path, server: FixtureServer) -> dict[str, str]:
    """The mirror host's environment (this host's, its pip pointed at the example index) and the pages' variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "REPRO_"))}
    env.update(
        HOME=str(site / "mirror-home"),
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=f"{server.url}/simple",
        PIP_FIND_LINKS=str(site / "shared" / "build-requirements"),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        REPRO_CACHE=str(site / "mirror-cache"),
        PYTHONUNBUFFERED="1",
        # The pages' variables (docs/development.md, "The docs walk").
        MIRROR=str(site / "shared" / "mirror"),
        LOCKDIR=str(site / "shared" / "lockdir"),
        PROFILE="quick",
        WHEELS=str(site / "node-home" / "stack" / "wheels"),
        PYTHON=str(site / "node-home" / "stack-env" / "bin" / "python"),
        DEST=str(site / "shared" / "mirror"),
        DIR=str(site / "shared" / "mirror"),
        MYSTACK=str(site / "shared" / "my-stack"),
        BUILD_REQUIRES="setuptools wheel",
    )
    return env


def make_site(site: Path, server: FixtureServer, python: str) -> dict[str, str]:
    """The walk's givens: the example lock as sources.lock in a directory of its own (for the node's ``python``),
    your lock, build requirements and the tool's wheels for the node's Python (the site's find-links)."""
    shared = site / "shared"
    lockdir = shared / "lockdir"
    lockdir.mkdir(parents=True)
    (lockdir / "sources.lock").write_text(lock_for_node(server.url, python))
    shutil.copytree(REPO / "examples" / "patches", lockdir / "patches")
    shutil.copytree(REPO / "bases", lockdir / "bases")  # as this repository has them beside sources.lock
    mine = shared / "my-stack"
    shutil.copytree(REPO / "examples" / "patches" / "repro_pure", mine / "patches" / "repro_pure")
    (mine / "sources.lock").write_text(your_lock(server.url))
    selfwheels.write_wheels(shared / "build-requirements", ("setuptools", "wheel"))
    tool_wheels_for(python, shared / "build-requirements")
    (site / "mirror-home").mkdir()
    return walk_env(site, server)


def walk(args: list[str], env: dict[str, str], timeout: float = 1800) -> tuple[int, str, dict[str, Any]]:
    report = Path(env["HOME"]).parent / f"walk-{len(args)}.json"
    res = subprocess.run(
        [sys.executable, str(WALK), *args, "--json", str(report)], env=env, capture_output=True, text=True,
        timeout=timeout, stdin=subprocess.DEVNULL, check=False,
    )  # fmt: skip
    out = res.stdout + res.stderr
    doc = json.loads(report.read_text()) if report.is_file() else {}
    return res.returncode, out, doc


@pytest.fixture(scope="module")
def node_args() -> list[str]:
    return node_mode()


@pytest.fixture(scope="module")
def node_py(node_args: list[str]) -> str:
    return node_python(node_args)


def test_the_pages_walk_on_the_example_lock(
    tmp_path: Path, server: FixtureServer, node_args: list[str], node_py: str
) -> None:
    site = tmp_path / "site"
    env = make_site(site, server, node_py)
    status, out, doc = walk(["--scratch", str(site), *node_args], env)
    assert status == 0, out[-6000:]
    rows = doc["results"]
    ran = [r for r in rows if r["status"] not in ("skipped", "not run")]
    assert ran and all(r["status"] == "0" for r in ran), rows
    pages = {r["page"] for r in ran}
    assert pages == {"docs/real-stack.md", "docs/offline.md", "docs/your-package.md"}, pages
    assert {r["role"] for r in ran if r["page"] == "docs/real-stack.md"} == {"mirror", "node"}
    # The documented steps, each as the pages promise: the tool from tool/, the build offline, verify isolated,
    # preflight with the node's interpreter, the plain install and pip check; your package locked, built, repro'd.
    assert "mirror written to" in out and "built repro_pybind in" in out and "built repro_pure in" in out, out[-6000:]
    assert out.count("preflight: this node can take the wheels") == 2, out[-6000:]
    assert "No broken requirements found." in out and "identical" in out, out[-6000:]
    assert "| docs/real-stack.md |" in out  # the summary table
    facts = "\n".join(doc["facts"])
    if "--node" in node_args and node_args[node_args.index("--node") + 1] == "docker":
        assert "--network none" in facts, facts
        mirror_py = next(f for f in doc["facts"] if f.startswith("mirror:")).rsplit("python3 ", 1)[1]
        node_py = next(f for f in doc["facts"] if f.startswith("node:")).rsplit("python3 ", 1)[1]
        if SUITE == "trixie":
            assert node_py.startswith("3.13") and mirror_py != node_py, facts
    else:
        assert "the node runs locally" in out, out[:2000]
    # Nothing of this checkout's venv stood in: the node's tool is its own venv's.
    assert (site / "node-home" / "reprostack" / "bin" / "reprostack").is_file()


def test_an_altered_command_fails_the_walk_naming_it(
    tmp_path: Path, server: FixtureServer, node_args: list[str], node_py: str
) -> None:
    """A copy of docs/real-stack.md with the node's first command broken: the walk fails there, naming the page,
    the block and the command, and runs nothing after it."""
    site = tmp_path / "site"
    env = make_site(site, server, node_py)
    page = tmp_path / "real-stack.md"
    good = "python3 -m venv --system-site-packages ~/reprostack"
    text = (REPO / "docs" / "real-stack.md").read_text()
    assert text.count(good) == 1
    broken = good.replace("~/reprostack", "--no-such-option ~/reprostack")
    page.write_text(text.replace(good, broken))
    line = next(n for n, t in enumerate(page.read_text().splitlines(), 1) if "--no-such-option" in t)
    status, out, doc = walk([str(page), "--roles", "node", "--scratch", str(site), *node_args], env, timeout=600)
    assert status == 1, out[-4000:]
    (failure,) = doc["failures"]
    assert failure.startswith(f"FAILED at {page}:"), failure
    assert "(block 3, host=node)" in failure and f"line {line}:" in failure, failure
    assert f"`{broken}` exited 2" in failure, failure
    assert f"docs walk: {failure}" in out
    statuses = [(r["line"], r["role"], r["status"]) for r in doc["results"]]
    assert ("skipped" in {s for _, _, s in statuses}) and statuses[-1][2] == "not run", statuses


def test_a_failure_inside_a_command_list_stops_the_walk(tmp_path: Path) -> None:
    """`a && b && c` where b fails: set -e alone would go on; the walk stops at that line. A host keeps its
    directory and variables from block to block; the page's variables come from the walk's environment."""
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```bash host=node\nNAME=${NAME:-default}\nmkdir -p ~/here && cd ~/here\n```\n\n"
        "```text\nnot run: output\n```\n\n"
        '```bash host=node\ntest "$PWD" = "$HOME/here" && test "$NAME" = given\n'
        "mkdir -p ~/there && cp ~/missing ~/there/ && cd ~/there   # the cp fails\n"
        "echo not-reached\n```\n"
    )
    env = {**os.environ, "NAME": "given"}
    res = subprocess.run(
        [sys.executable, str(WALK), str(page), "--node", "local", "--scratch", str(tmp_path / "site")],
        env=env, capture_output=True, text=True, timeout=300, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    assert f"FAILED at {page}:12 (block 3, host=node), line 14: `mkdir -p ~/there && cp ~/missing" in out, out
    assert "| not-reached" not in out, out


def walk_tiny(page: Path, tmp_path: Path) -> tuple[int, str, dict[str, Any]]:
    """The walk of a small page on a local node: exit status, output and the JSON report."""
    report = tmp_path / "walk.json"
    res = subprocess.run(
        [sys.executable, str(WALK), str(page), "--node", "local", "--scratch", str(tmp_path / "site"),
         "--json", str(report)],
        capture_output=True, text=True, timeout=300, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    return res.returncode, res.stdout + res.stderr, json.loads(report.read_text()) if report.is_file() else {}


@pytest.mark.parametrize(
    ("stop", "why"),
    [
        ("exit 0", "line 6 and after never ran"),
        ("exec true", "line 6 and after never ran"),
        ("exit 3", ""),
    ],
)
def test_a_block_whose_shell_ends_early_fails_at_that_line(tmp_path: Path, stop: str, why: str) -> None:
    """A block passes only when its shell ran past its last line: one that ends before (`exit 0`, `exec` of
    another program, `exit 3`) fails at the line where it stopped, and the host's next block does not run."""
    page = tmp_path / "page.md"
    page.write_text(
        f"# A page\n\n```bash host=node\necho first\n{stop}\ntouch ~/ran\nfalse\n```\n\n"
        "```bash host=node\necho second\n```\n"
    )
    status, out, doc = walk_tiny(page, tmp_path)
    assert status == 1, out
    ended = "exited 3" if stop == "exit 3" else "ended the shell (status 0)"
    expected = f"FAILED at {page}:3 (block 1, host=node), line 5: `{stop}` {ended}" + (f"; {why}" if why else "")
    assert doc["failures"] == [expected], out
    assert f"docs walk: {expected}" in out
    assert [r["status"] for r in doc["results"]] == ["3" if stop == "exit 3" else "ended early", "not run"], out
    assert "  | first\n" in out and "  | second\n" not in out, out
    assert not (tmp_path / "site" / "node-home" / "ran").exists()


def test_a_block_that_ends_with_exec_of_a_login_shell_fails(tmp_path: Path) -> None:
    """`exec "$SHELL" -l` after an install step, an install page's way, as a block's last line: the walk's shell
    is gone before it keeps the host's state, so the block fails there."""
    page = tmp_path / "page.md"
    page.write_text('# A page\n\n```bash host=node\nX=1\nexec "$SHELL" -l\n```\n')
    status, out, doc = walk_tiny(page, tmp_path)
    assert status == 1, out
    assert doc["failures"] == [
        f'FAILED at {page}:3 (block 1, host=node), line 5: `exec "$SHELL" -l` ended the shell (status 0); '
        "before the walk kept its state for the host's next block"
    ], out


def test_a_block_that_runs_to_its_end_passes_with_its_state(tmp_path: Path) -> None:
    """Exits and execs that do not end the block's shell (a subshell's, another bash's) pass, and the host's next
    block starts in the directory and with the variables the block left."""
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```bash host=node\n( exit 0 )\nbash -c 'exec true'\nmkdir -p ~/here && cd ~/here\n"
        'X=1\n```\n\n```bash host=node\ntest "$PWD" = "$HOME/here" && test "$X" = 1\necho second\n```\n'
    )
    status, out, doc = walk_tiny(page, tmp_path)
    assert status == 0, out
    assert [r["status"] for r in doc["results"]] == ["0", "0"], out
    assert "  | second\n" in out and "2 blocks run, 0 failed" in out, out


def test_a_shell_block_without_its_role_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n```bash\necho hello\n```\n\n```bash host=gpu\necho\n```\n")
    res = subprocess.run([sys.executable, str(WALK), str(page), "--list"], capture_output=True, text=True, check=False)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"{page}:3: a bash block needs exactly one of host=mirror, host=node, host=both, no-walk" in res.stderr
    assert f"{page}:7: host=gpu: the roles are mirror, node and both" in res.stderr
