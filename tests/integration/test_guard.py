"""Wheels that refuse to go where they cannot work (issue 31): the torch a wheel was compiled against is in
its metadata, and plain pip, offline, refuses to install it beside another torch."""

from __future__ import annotations

import json
import os
import re
import shutil
import site as site_module
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, Workspace, make_workspace, venv_with_pip
from fake_wheels import make_wheel
from make_fixtures import RUNTIME_WHEELS, simple_index, write_wheel
from serve import FixtureServer

from tasks.core.treehash import file_sha256
from tasks.lock.lockfile import load_lock

pytestmark = pytest.mark.integration


def _torch_version() -> str:
    """The installed torch distribution's version: what pip compares a Requires-Dist with."""
    import importlib.metadata

    return importlib.metadata.version("torch")


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return zf.read(name).decode()


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pip as a user on an offline node runs it: no configuration of this machine (its find-links, its index)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return subprocess.run([str(python), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, check=False, env=env)  # fmt: skip


@pytest.mark.needs_torch
def test_the_torch_extension_pins_its_torch_and_pip_refuses_another(workspace: Workspace, tmp_path: Path) -> None:
    ws = workspace
    res = ws.doit("build:repro_torchext")
    wheel = next((ws.cache / "wheels").glob("*/*/repro_torchext-*.whl"))
    built_with = _torch_version()  # this interpreter's torch: the one the build compiled against
    assert f"Requires-Dist: torch=={built_with}\n" in _metadata(wheel), res.stdout
    log = (ws.root / "build" / "logs" / "build-repro_torchext.log").read_text()
    assert f"added to the wheel's METADATA: Requires-Dist: torch=={built_with}" in log

    # Offline, as a user installs: a find-links directory with our wheel and a torch of another version.
    links = tmp_path / "links"
    links.mkdir()
    (links / wheel.name).write_bytes(wheel.read_bytes())
    public = built_with.split("+")[0]
    other = f"{public}+cu999" if "+" in built_with else f"{public}+cpu"  # same public version, other label
    make_wheel(tmp_path / "torches", "torch", other, "py3-none-any", {"torch/__init__.py": b""})
    env = tmp_path / "env"
    venv_with_pip(env)
    python = env / "bin" / "python"
    assert _pip(python, "install", "--no-index", "--find-links", str(tmp_path / "torches"), "torch").returncode == 0
    refused = _pip(python, "install", "--no-index", "--find-links", str(links), "repro_torchext")
    assert refused.returncode != 0
    assert f"torch=={built_with}" in refused.stdout + refused.stderr, refused.stderr
    assert _pip(python, "show", "repro_torchext").returncode != 0  # nothing installed
    # Beside the torch it was built against (a fixture of that exact version), pip installs it.
    same = make_wheel(tmp_path / "same", "torch", built_with, "py3-none-any", {"torch/__init__.py": b""})
    assert _pip(python, "install", "--no-index", str(same)).returncode == 0
    done = _pip(python, "install", "--no-index", "--find-links", str(links), "repro_torchext")
    assert done.returncode == 0, done.stderr


def _profile_without(ws: Workspace, name: str, *left_out: str) -> None:
    ws.lock.write_text(ws.lock.read_text() + f"\n[profiles.{name}]\n" + "".join(
        f"[profiles.{name}.packages.{p}]\nenabled = false\n" for p in left_out))  # fmt: skip


@pytest.mark.needs_torch
def test_preflight_checks_the_node_against_the_wheelhouse_it_ships_in(workspace: Workspace, tmp_path: Path) -> None:
    """`doit wheels` ships the checker; `doit preflight` and the shipped copy (no checkout, plain Python) agree."""
    ws = workspace
    _profile_without(ws, "guard", "repro_pybind", "repro_cuda")
    ws.doit("wheels", "profile=guard")
    spec = json.loads((ws.wheels / "preflight.json").read_text())
    assert spec["archs"] == ["sm_90a"] and spec["build"]["torch"] == _torch_version()
    assert (ws.wheels / "preflight.py").read_bytes() == (REPO / "tasks" / "outside" / "preflight.py").read_bytes()
    ws.doit("verify", "profile=guard")  # what doit wheels writes is the wheelhouse's own (the contents row)

    ws.env_extra["REPRO_LIBCUDA"] = str(tmp_path / "no-driver" / "libcuda.so.1")  # no driver, whatever the host
    res = ws.doit("preflight", "profile=guard", check=False)
    assert res.returncode == 21, res.stdout + res.stderr
    said = [ln for ln in res.stdout.splitlines() if "no NVIDIA driver" in ln]
    assert len(said) == 1 and said[0].startswith("FAIL  driver"), res.stdout
    for name in ("python", "glibc", "torch", "provided"):
        assert re.search(rf"^PASS  {name} ", res.stdout, flags=re.M), res.stdout
    report = json.loads((ws.root / "build" / "preflight" / "report.json").read_text())
    assert report["ok"] is False and [c["check"] for c in report["checks"] if c["status"] == "FAIL"] == ["driver"]
    assert "PreflightFailed: this node cannot take the wheels" in res.stderr
    assert ws.doit("preflight", "profile=guard", "gpu=off").returncode == 0
    assert spec["format"] == 3 and spec["provided"] == ["torch"], spec
    assert {w["package"]: w["needs"] for w in spec["wheels"]}["repro_torchext"] == [f"torch=={_torch_version()}"], spec
    res = ws.doit("preflight", "profile=guard", "gpu=off", "--strict")  # every provided distribution: torch
    assert "needed: every provided distribution (1) at its captured version (--strict)" in res.stdout, res.stdout

    # On a node: the shipped copy alone, outside any checkout, under an isolated interpreter.
    node = tmp_path / "node"
    shutil.copytree(ws.wheels, node / "wheels")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REPRO_", "PYTHON"))}
    env["REPRO_LIBCUDA"] = ws.env_extra["REPRO_LIBCUDA"]
    shipped = [sys.executable, "-I", "wheels/preflight.py", "--json", "report.json"]
    res2 = subprocess.run(shipped, cwd=node, env=env, capture_output=True, text=True, check=False)
    assert res2.returncode == 21 and "no NVIDIA driver found" in res2.stdout, res2.stdout + res2.stderr
    res3 = subprocess.run([*shipped, "--gpu", "off"], cwd=node, env=env, capture_output=True, text=True, check=False)
    assert res3.returncode == 0, res3.stdout + res3.stderr
    assert json.loads((node / "report.json").read_text())["ok"] is True


# The huggingface-hub case of issue 31, in small: the base holds repro-sentence 6.0.1, which requires
# repro-hub<2.0.0,>=1.3.0; a closure resolved without regard for it brings repro-hub 2.4.0.
HUB_WHEELS: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "repro-hub": {"1.5.0": ((), "V = 1\n"), "2.4.0": ((), "V = 2\n")},
    "repro-sentence": {"6.0.1": (("repro-hub<2.0.0,>=1.3.0",), "S = 1\n")},
    "repro-hubuser": {"1.0.0": (("repro-hub",), "U = 1\n")},  # takes the newest hub it finds
    "repro-newthing": {"1.0.0": (("repro-hub>=2",), "N = 1\n")},  # needs the new hub
}


def _hub_index(
    published: Path, dest: Path, wheels: dict[str, dict[str, tuple[tuple[str, ...], str]]] = HUB_WHEELS
) -> Path:
    """The published fixtures plus the hub projects (or ``wheels``), on one index."""
    shutil.copytree(published, dest)
    projects: dict[str, dict[str, str]] = {}
    for project, versions in {**RUNTIME_WHEELS, **wheels}.items():
        for version, (requires, code) in versions.items():
            name, digest = write_wheel(dest / "packages", project, version, requires, code)
            projects.setdefault(project, {})[name] = digest
    projects["repro-cuda"] = {"repro_cuda-0.1.0.tar": file_sha256(dest / "packages" / "repro_cuda-0.1.0.tar")}
    simple_index(dest, projects)
    return dest


def _base(root: Path, index: Path, *dists: str) -> Path:
    """A base interpreter (a venv with pip) holding ``dists`` (name==version), installed offline from ``index``."""
    venv_with_pip(root)
    python = root / "bin" / "python"
    if dists:
        res = _pip(python, "install", "--no-index", "--no-deps", "--find-links", str(index / "packages"), *dists)
        assert res.returncode == 0, res.stderr
    return python


def _runtime(ws: Workspace, body: str) -> None:
    """The example lock's [runtime] replaced by ``body``, with a profile of its pure-Python package only."""
    text = re.sub(r"\n\[runtime\]\n.*?\n(?=\n\[profiles\.quick\])", "\n[runtime]\n" + body, ws.lock.read_text(),
                  flags=re.S)  # fmt: skip
    ws.lock.write_text(text)
    _profile_without(ws, "pure", "repro_pybind", "repro_cuda", "repro_torchext")


def test_the_closure_keeps_the_base_whole(tmp_path: Path, published: Path) -> None:
    """`doit lock` captures the provided set from the base's interpreter and resolves around every requirement
    of what the base holds: it keeps the base's hub, and refuses a closure that needs a hub the base cannot
    take, naming both distributions and versions."""
    index = _hub_index(published, tmp_path / "served")
    with FixtureServer(index) as srv:
        ws = make_workspace(tmp_path / "ws", tmp_path / "cache", srv.url)
        base = _base(tmp_path / "base", index, "repro-sentence==6.0.1", "repro-hub==1.5.0")
        _runtime(ws, f'requirements = ["repro-hubuser", "repro-greeting>=0.3"]\nbase_python = "{base}"\n')
        res = ws.doit("lock")
        runtime = load_lock(ws.lock, require_pins=False).runtime
        assert runtime is not None
        provided = dict(runtime.provided)
        assert provided["repro-sentence"] == "6.0.1" and provided["repro-hub"] == "1.5.0", res.stdout
        assert runtime.python == f"{sys.version_info[0]}.{sys.version_info[1]}"  # written: the base's
        assert "repro-hub" not in {p.name for p in runtime.resolved}  # the base's 1.5.0 stays, untouched
        assert "repro-hubuser" in {p.name for p in runtime.resolved}

        # A requirement that needs the new hub: refused, naming both distributions and versions.
        ws.edit_lock('requirements = ["repro-hubuser",', 'requirements = ["repro-newthing",')
        before = ws.lock.read_text()
        res = ws.doit("lock", check=False)
        assert res.returncode == 11, res.stdout + res.stderr
        said = res.stderr
        assert "repro-newthing 1.0.0 depends on repro-hub>=2" in said, said
        assert "repro-sentence 6.0.1 (installed in the base) requires repro-hub<2.0.0,>=1.3.0" in said
        assert "the base holds repro-hub 1.5.0, which the closure may not replace" in said
        assert ws.lock.read_text() == before  # nothing pinned


def test_a_capture_made_on_the_node_keeps_its_base_whole(tmp_path: Path, published: Path) -> None:
    """A base this host cannot run (a cluster node, offline): tasks/outside/capture_base.py, run there with the node's
    Python and nothing else, writes what it holds; `doit lock` reads that file (base_capture) as it would
    the interpreter, and keeps the base's hub. A capture outside the lock's folder, or not a capture, is
    refused in one line."""
    index = _hub_index(published, tmp_path / "served")
    base = _base(tmp_path / "base", index, "repro-sentence==6.0.1", "repro-hub==1.5.0")
    node = tmp_path / "node"  # what a node has: its interpreter and the one script, copied there alone
    node.mkdir()
    shutil.copy(REPO / "tasks" / "outside" / "capture_base.py", node / "capture_base.py")
    with FixtureServer(index) as srv:
        ws = make_workspace(tmp_path / "ws", tmp_path / "cache", srv.url)
        (ws.root / "bases").mkdir()
        made = subprocess.run([str(base), "-I", str(node / "capture_base.py"), str(ws.root / "bases" / "node.json")],
                              capture_output=True, text=True, check=False, cwd=node)  # fmt: skip
        assert made.returncode == 0, made.stderr
        _runtime(ws, 'requirements = ["repro-hubuser", "repro-greeting>=0.3"]\nbase_capture = "bases/node.json"\n')
        res = ws.doit("lock")
        runtime = load_lock(ws.lock, require_pins=False).runtime
        assert runtime is not None
        provided = dict(runtime.provided)
        assert provided["repro-sentence"] == "6.0.1" and provided["repro-hub"] == "1.5.0", res.stdout
        assert "repro-hub" not in {p.name for p in runtime.resolved}
        assert "repro-hubuser" in {p.name for p in runtime.resolved}
        assert "installed in bases/node.json" in res.stdout, res.stdout

        ws.edit_lock('requirements = ["repro-hubuser",', 'requirements = ["repro-newthing",')
        res = ws.doit("lock", check=False)
        assert res.returncode == 11 and "repro-sentence 6.0.1 (installed in the base)" in res.stderr, res.stderr

        (ws.root / "bases" / "bad.json").write_text('{"python": "3.12"}')
        for given, said in {
            "../outside.json": "must be a path inside the lock's folder",
            "bases/bad.json": "is not a capture of tasks/outside/capture_base.py",
            "bases/missing.json": "cannot be read",
        }.items():
            ws.edit_lock(re.search(r'base_capture = "[^"]*"', ws.lock.read_text()).group(0),  # type: ignore[union-attr]
                         f'base_capture = "{given}"')  # fmt: skip
            res = ws.doit("lock", check=False)
            assert res.returncode != 0 and said in res.stderr, (given, res.stderr)
            assert "Traceback" not in res.stderr


@pytest.mark.needs_nvcc  # as test_image's: the base image's fixture
def test_a_base_image_is_captured_in_the_image(tmp_path: Path, published: Path, base_id: str) -> None:
    """base_image: `doit lock` runs the capture in the image (no network, the script mounted read-only) and
    resolves around what the image's python3 holds."""
    index = _hub_index(published, tmp_path / "served")
    ctx = tmp_path / "image"
    site = ctx / "site"
    for wheel in ("repro_sentence-6.0.1", "repro_hub-1.5.0"):
        with zipfile.ZipFile(next((index / "packages").glob(f"{wheel}-*.whl"))) as zf:
            zf.extractall(site)
    (ctx / "Dockerfile").write_text(f"FROM {base_id}\nCOPY site/ /usr/lib/python3/dist-packages/\n")
    tag = f"reprostack-test-base-capture:{os.getpid()}"
    built = subprocess.run(["docker", "build", "--network", "none", "-q", "-t", tag, str(ctx)], capture_output=True,
                           text=True, check=False)  # fmt: skip
    assert built.returncode == 0, built.stderr
    try:
        with FixtureServer(index) as srv:
            ws = make_workspace(tmp_path / "ws", tmp_path / "cache", srv.url)
            _runtime(ws, f'requirements = ["repro-hubuser", "repro-greeting>=0.3"]\nbase_image = "{tag}"\n')
            res = ws.doit("lock")
            runtime = load_lock(ws.lock, require_pins=False).runtime
            assert runtime is not None
            provided = dict(runtime.provided)
            assert provided["repro-sentence"] == "6.0.1" and provided["repro-hub"] == "1.5.0", res.stdout
            assert "repro-hub" not in {p.name for p in runtime.resolved}
            image_python = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", tag,
                                           "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
            assert runtime.python == image_python
    finally:
        subprocess.run(["docker", "image", "rm", "--force", tag], capture_output=True, check=False)


def test_verify_runs_pip_check_over_base_and_wheelhouse(tmp_path: Path, published: Path) -> None:
    """The old way (a hand-written provided set) brings repro-hub 2.4.0 beside a base holding repro-sentence:
    verify's pip check over base plus wheelhouse fails, naming both."""
    from tasks.verify.checks import verify_wheelhouse

    index = _hub_index(published, tmp_path / "served")
    with FixtureServer(index) as srv:
        ws = make_workspace(tmp_path / "ws", tmp_path / "cache", srv.url)
        _runtime(ws, 'requirements = ["repro-hubuser", "repro-greeting>=0.3"]\nprovided = []\npython = "3.11"\n')
        ws.doit("lock")
        ws.doit("wheels", "profile=pure")
    base = _base(tmp_path / "base", index, "repro-sentence==6.0.1", "repro-hub==1.5.0")
    report = verify_wheelhouse(ws.wheels, tmp_path / "verify", python=str(base), gpu="off")
    row = next(r for r in report.rows if r.check == "pip-check")
    assert row.status == "FAIL", report.render()
    assert "repro-sentence 6.0.1 has requirement repro-hub<2.0.0,>=1.3.0, but you have repro-hub 2.4.0" in row.detail


def test_plain_verify_does_not_count_the_tools_own_venv(tmp_path: Path, published: Path) -> None:
    """Without [runtime], a wheel needing what only doit's own venv has (packaging) is not passed: the
    wheelhouse's own install command would not find it offline."""
    index = _hub_index(published, tmp_path / "served")
    with FixtureServer(index) as srv:
        ws = make_workspace(tmp_path / "ws", tmp_path / "cache", srv.url)
        text = re.sub(r"\n\[runtime\]\n.*?\n(?=\n\[profiles\.quick\])", "\n", ws.lock.read_text(), flags=re.S)
        patches = 'patches = ["0001-patched-message.patch", "0002-needs-tomlkit.patch"]'
        ws.lock.write_text(text.replace('patches = ["0001-patched-message.patch"]', patches))
        # repro_pure then needs tomlkit, which only this tool's own venv holds here (not the base interpreter).
        (ws.root / "patches" / "repro_pure" / "0002-needs-tomlkit.patch").write_text(
            '--- a/pyproject.toml\n+++ b/pyproject.toml\n@@ -9,5 +9,5 @@\n requires-python = ">=3.8"\n'
            " # What it needs at run time comes from the example lock's runtime closure "
            "(tests/fixtures/make_fixtures.py).\n"
            '-dependencies = ["repro-colors>=1.0"]\n+dependencies = ["tomlkit"]\n \n [tool.setuptools]\n'
        )
        _profile_without(ws, "pure", "repro_pybind", "repro_cuda", "repro_torchext")
        ws.doit("wheels", "profile=pure")
    res = ws.doit("verify", "profile=pure", "gpu=off", check=False)
    assert res.returncode == 17, res.stdout + res.stderr
    assert re.search(r"repro_pure\s+deps\s+FAIL\s+unmet: tomlkit \(only in ", res.stdout), res.stdout
    # the whole detail: the table cuts it at the width of a line, where a long checkout path moves the cut
    rows = json.loads((ws.root / "build" / "verify" / "report.json").read_text())["rows"]
    (failed,) = [r for r in rows if r["status"] == "FAIL"]
    assert re.search(r"unmet: tomlkit \(only in \S+, the verifying tool's own environment", failed["detail"]), failed
    assert "The lock's [runtime]: add what is missing" in res.stderr
    assert "recipe or patches" not in res.stderr


# The typing-extensions case of issue 38, in small: the base holds repro-typing 4.16.0, with repro-torchy that
# needs it and repro-inspect that names it repro_typing; this tool's own venv holds 4.15.0 (its pin), first on the
# path; the closure's repro-pydant needs >=4.16.0. The base also holds repro-uvlike, which nothing needs.
TYPING_WHEELS: dict[str, dict[str, tuple[tuple[str, ...], str]]] = {
    "repro-typing": {"4.15.0": ((), "V = 15\n"), "4.16.0": ((), "V = 16\n")},
    "repro-torchy": {"1.0.0": (("repro-typing>=4.10",), "T = 1\n")},
    "repro-inspect": {"0.9.0": (("repro_typing>=3.7",), "I = 1\n")},
    "repro-pydant": {"2.14.4": (("repro-typing>=4.16.0",), "P = 1\n")},
    "repro-uvlike": {"0.11.15": ((), "U = 1\n")},
}


def _site_of(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return Path(out.stdout.strip())


def _tool_venv(root: Path, index: Path, base: Path) -> Path:
    """This tool installed in a venv of its own that sees the base (as on the GPU host: a .pth line naming the
    base's site-packages), holding repro-typing 4.15.0, its own pin, in front of the base's copy."""
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site = _site_of(python)
    with zipfile.ZipFile(next((index / "packages").glob("repro_typing-4.15.0-*.whl"))) as zf:
        zf.extractall(site)
    # The base, then the tool's code and what it runs with (this interpreter's site directories).
    tool = [str(_site_of(base)), str(REPO), sysconfig.get_paths()["purelib"], *site_module.getsitepackages()]
    (site / "zz-base-and-tool.pth").write_text("".join(f"{line}\n" for line in tool))
    return python


def _verify_from(tool: Path, wheels: Path, work: Path, *, isolated: bool) -> dict[tuple[str, str], dict[str, str]]:
    """`doit verify` (its verify_wheelhouse) run by the tool installed in ``tool``'s venv: the report's rows."""
    code = (
        "import sys; from pathlib import Path; from tasks.verify.checks import verify_wheelhouse; "
        "verify_wheelhouse(Path(sys.argv[1]), Path(sys.argv[2]), gpu='off', isolated=sys.argv[3] == 'on')"
    )
    res = subprocess.run([str(tool), "-c", code, str(wheels), str(work), "on" if isolated else "off"],
                         capture_output=True, text=True, check=False, cwd=work.parent, timeout=900)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads((work / "report.json").read_text())["rows"]
    return {(r["package"], r["check"]): r for r in rows}


def test_verify_never_takes_the_tools_own_copy_for_the_bases(tmp_path: Path, published: Path) -> None:
    """Isolated verify sees the base's provided set and the wheelhouse, never a distribution of this tool's own
    venv, though the base interpreter sees the tool's older pin first; the plain verify's pip check likewise.
    A base distribution no wheel needs, gone from the node, is a note; a needed one gone fails, naming it."""
    index = _hub_index(published, tmp_path / "served", TYPING_WHEELS)
    base_dists = ("repro-typing==4.16.0", "repro-torchy==1.0.0", "repro-inspect==0.9.0", "repro-uvlike==0.11.15")
    base = _base(tmp_path / "base", index, *base_dists)
    with FixtureServer(index) as srv:
        ws = make_workspace(tmp_path / "ws", tmp_path / "cache", srv.url)
        _runtime(ws, f'requirements = ["repro-pydant", "repro-colors"]\nbase_python = "{base}"\n')
        ws.doit("lock")
        runtime = load_lock(ws.lock, require_pins=False).runtime
        assert runtime is not None and dict(runtime.provided)["repro-typing"] == "4.16.0"
        assert "repro-typing" not in {p.name for p in runtime.resolved}  # the base's, not the closure's
        ws.doit("wheels", "profile=pure")
    needs = {w["package"]: w["needs"] for w in json.loads((ws.wheels / "preflight.json").read_text())["wheels"]}
    assert needs["repro-pydant"] == ["repro-typing>=4.16.0"] and needs["repro_pure"] == [], needs
    assert _pip(base, "uninstall", "-y", "repro-uvlike").returncode == 0  # the node lacks what nothing needs
    tool = _tool_venv(tmp_path / "tool", index, base)
    seen = subprocess.run([str(tool), "-c", "import repro_typing; print(repro_typing.V)"], capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert seen.stdout.strip() == "15"  # the tool's pin is what its interpreter imports

    rows = _verify_from(tool, ws.wheels, tmp_path / "isolated", isolated=True)
    failed = {k: r["detail"] for k, r in rows.items() if r["status"] == "FAIL"}
    assert not failed, failed
    assert rows[("closure", "deps")]["status"] == "PASS" and rows[("wheelhouse", "pip-check")]["status"] == "PASS"
    venv_row = rows[("wheelhouse", "venv")]["detail"]
    assert f"this tool's own venv {_site_of(tool).resolve()} kept apart" in venv_row, venv_row
    assert "note: 1 distribution of the captured base differs where the wheels do not care: " \
        "repro-uvlike==0.11.15 (not installed for" in venv_row, venv_row  # fmt: skip

    rows = _verify_from(tool, ws.wheels, tmp_path / "shared", isolated=False)
    failed = {k: r["detail"] for k, r in rows.items() if r["status"] == "FAIL"}
    assert not failed, failed
    assert rows[("wheelhouse", "pip-check")]["status"] == "PASS" and rows[("closure", "deps")]["status"] == "PASS"

    preflight = [sys.executable, "-I", str(ws.wheels / "preflight.py"), "--gpu", "off", "--python", str(base)]
    res = subprocess.run(preflight, capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "which the wheels' needs allow: repro-uvlike not installed" in res.stdout, res.stdout

    assert _pip(base, "uninstall", "-y", "repro-typing").returncode == 0  # now the node lacks a needed one
    res = subprocess.run(preflight, capture_output=True, text=True, check=False)
    assert res.returncode == 21, res.stdout + res.stderr
    assert "-- repro-typing not installed (needed by repro_pydant-2.14.4-py3-none-any.whl)" in res.stdout, res.stdout
    rows = _verify_from(tool, ws.wheels, tmp_path / "lacking", isolated=True)
    venv_row = rows[("wheelhouse", "venv")]
    assert venv_row["status"] == "FAIL", venv_row
    assert "the wheels need, but the base interpreter lacks: repro-typing==4.16.0 (not installed for " in \
        venv_row["detail"], venv_row  # fmt: skip
    assert "this tool's own venv has one, which does not count) needed by repro_pydant-2.14.4" in \
        venv_row["detail"], venv_row  # fmt: skip


def test_a_runtime_without_requirements_or_python_takes_the_wheels_requirements(workspace: Workspace) -> None:
    """[runtime] python defaults to this interpreter's (written by `doit lock`); with requirements = [] the
    built wheels' Requires-Dist are the closure's requirements."""
    ws = workspace
    _runtime(ws, 'requirements = []\nprovided = ["torch"]\n')
    res = ws.doit("lock")
    runtime = load_lock(ws.lock, require_pins=False).runtime
    assert runtime is not None and runtime.python == f"{sys.version_info[0]}.{sys.version_info[1]}", res.stdout
    assert "this interpreter's" in res.stdout and runtime.resolved == ()
    res = ws.doit("wheels", "profile=pure", check=False)  # repro_pure needs repro-colors: not pinned yet
    assert res.returncode == 11 and "repro_pure requires repro-colors>=1.0 (not in the closure)" in res.stderr
    assert "Run `doit lock` (it takes the built wheels' requirements into the resolution)" in res.stderr
    res = ws.doit("lock")  # its wheel is in the cache now: its requirements enter the resolution
    assert "resolved again: the built wheels need repro-colors>=1.0" in res.stdout, res.stdout
    runtime = load_lock(ws.lock, require_pins=False).runtime
    assert runtime is not None and [p.name for p in runtime.resolved] == ["repro-colors"]
    ws.doit("wheels", "profile=pure")
    assert "pinned (1 distributions)" in ws.doit("lock").stdout
