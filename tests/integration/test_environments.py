"""Complete environments (issue 16): the runtime closure resolved by `doit lock`, fetched by `doit wheels`,
installed offline and verified in isolation; prebuilt wheels by URL; patches taken from a pinned source.

Real pip resolutions against the fixture index on loopback (tests/fixtures/make_fixtures.py publishes
small pure-Python wheels of our own: repro-greeting needs repro-colors and repro-shapes[round], whose
extra needs repro-round), real git repositories served over HTTP, real builds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from conftest import PURE_PROFILE, REPO, Workspace, make_workspace, venv_with_pip
from make_fixtures import RUNTIME_WHEELS, simple_index, write_wheel
from serve import FixtureServer

from tasks.core.treehash import file_sha256
from tasks.lock.lockfile import load_lock

pytestmark = pytest.mark.integration
CLOSURE = ["repro-colors", "repro-greeting", "repro-round", "repro-shapes"]


def pure_only(ws: Workspace, provided: str | None = None) -> None:
    """The example lock with a profile of its pure-Python package only; ``provided`` replaces [runtime] provided."""
    text = ws.lock.read_text()
    if provided is not None:
        text = text.replace('provided = ["torch"]', f"provided = {provided}")
    text += PURE_PROFILE
    ws.lock.write_text(text)


def manifest(ws: Workspace) -> dict[str, dict[str, object]]:
    return {w["package"]: w for w in json.loads((ws.wheels / "manifest.json").read_text())["wheels"]}


def pins(ws: Workspace) -> dict[str, str]:
    runtime = load_lock(ws.lock, require_pins=False).runtime
    assert runtime is not None
    return {p.name: p.version for p in runtime.resolved}


def test_closure_installs_offline_and_verifies_in_isolation(workspace: Workspace, tmp_path: Path) -> None:
    ws = workspace
    pure_only(ws, provided="[]")
    res = ws.doit("lock")  # the provided set changed: resolved again, with the same pins
    assert "runtime: 4 distributions" in res.stdout, res.stdout
    ws.doit("wheels", "profile=pure")
    found = manifest(ws)
    assert {name: w["origin"] for name, w in found.items()} == {
        "repro_pure": "built",
        **dict.fromkeys(CLOSURE, "fetched"),
    }
    sbom = json.loads((ws.wheels / "sbom.cdx.json").read_text())
    origins = {
        c["bom-ref"]: {p["name"]: p["value"] for p in c.get("properties", [])}.get("reprostack:origin")
        for c in sbom["components"]
    }
    assert origins["wheel:repro_colors-1.1.0-py3-none-any.whl"] == "fetched"
    assert origins["wheel:repro_pure-0.1.0-py3-none-any.whl"] == "built"
    # A bare host: a venv without any site-packages, no index.
    env_dir = tmp_path / "bare"
    venv_with_pip(env_dir)
    bare_env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    subprocess.run(
        [str(env_dir / "bin" / "python"), "-m", "pip", "install", "--no-index", "--require-hashes", "--find-links",
         str(ws.wheels), "-r", str(ws.wheels / "requirements.txt")],
        env=bare_env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    out = subprocess.run(
        [str(env_dir / "bin" / "python"), "-c", "import repro_greeting, repro_pure; print(repro_greeting.greeting())"],
        env=bare_env, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    assert out.strip() == "a blue circle"
    res = ws.doit("-s", "verify", "profile=pure", "gpu=off", "isolated=on")
    rows = {
        (r["package"], r["check"]): r
        for r in json.loads((ws.root / "build" / "verify" / "report.json").read_text())["rows"]
    }
    assert "isolated (no system site-packages)" in rows[("wheelhouse", "venv")]["detail"]
    assert rows[("closure", "deps")]["status"] == "PASS" and rows[("repro_pure", "deps")]["status"] == "PASS"
    # train=on (issue 40): the training check's preflight finds none of the stack in this venv, and says so.
    res = ws.doit("-s", "verify", "profile=pure", "gpu=off", "isolated=on", "train=on", check=False)
    assert res.returncode == 17, res.stdout + res.stderr
    report = json.loads((ws.root / "build" / "verify" / "report.json").read_text())["rows"]
    training = {r["check"]: r for r in report if r["package"] == "training"}
    assert training["train-launch"]["detail"].startswith("not launched: the venv lacks torch, transformer_engine, ")
    assert "No module named 'flash_attn_3'" in training["train-fa3-backend"]["detail"]
    assert {r["status"] for r in training.values()} == {"FAIL"} and "The training check (train=on)" in res.stderr
    (ws.wheels / "repro_round-0.1.0-py3-none-any.whl").unlink()  # the wheelhouse as delivered, one wheel short
    res = ws.doit("-s", "verify", "profile=pure", "gpu=off", "isolated=on", check=False)
    assert res.returncode == 17, res.stdout + res.stderr
    assert "repro_round-0.1.0-py3-none-any.whl: missing" in res.stdout


def test_isolated_verify_names_each_requirement_the_closure_lacks(workspace: Workspace) -> None:
    """A lock whose resolved pins lost part of the closure (a hand edit, a bad merge; resolved_from does not
    cover the pins): `doit wheels` places what is pinned, and isolated `doit verify` fails naming each
    requirement that nothing in the venv meets."""
    ws = workspace
    ws.lock.write_text(
        ws.lock.read_text().replace('provided = ["torch"]', "provided = []")
        + "\n[profiles.closure]\n"  # the closure alone: no package of ours, whose needs `doit wheels` checks
        + "".join(f"[profiles.closure.packages.{p}]\nenabled = false\n" for p in ("repro_pure", "repro_pybind",
                                                                                  "repro_cuda", "repro_torchext"))
    )  # fmt: skip
    ws.doit("lock")
    complete = ws.lock.read_text()

    def verify_without(dropped: str) -> tuple[str, dict[tuple[str, str], dict[str, str]]]:
        ws.lock.write_text(re.sub(rf'\n\s*"repro-({dropped})==[^"]*",', "", complete))
        ws.doit("wheels", "profile=closure")
        res = ws.doit("-s", "verify", "profile=closure", "gpu=off", "isolated=on", check=False)
        assert res.returncode == 17, res.stdout + res.stderr
        report = json.loads((ws.root / "build" / "verify" / "report.json").read_text())
        return res.stdout + res.stderr, {(r["package"], r["check"]): r for r in report["rows"]}

    # What an extra asks for (repro-shapes[round] needs repro-round), which pip --no-deps never looks at.
    _out, rows = verify_without("round")
    assert rows[("closure", "install")]["status"] == "PASS"  # what the wheelhouse holds installed
    assert rows[("closure", "deps")]["status"] == "FAIL"
    assert rows[("closure", "deps")]["detail"] == (
        "the closure lacks: repro-greeting needs repro-round>=0.1 (for repro-shapes[round]) (not installed) "
        "(add it to [runtime] and run `doit lock`)"
    )
    # What a closure wheel itself requires: `doit wheels` already refuses it, before wheels/ changes.
    before = (ws.wheels / "manifest.json").read_bytes()
    ws.lock.write_text(re.sub(r'\n\s*"repro-(colors|shapes|round)==[^"]*",', "", complete))
    assert sorted(pins(ws)) == ["repro-greeting"]
    res = ws.doit("wheels", "profile=closure", check=False)
    assert res.returncode == 11, res.stdout + res.stderr  # LockError
    assert (
        "does not cover itself:\n  - repro-greeting 0.3.0 requires repro-colors>=1.0 (not in the closure)\n"
        "  - repro-greeting 0.3.0 requires repro-shapes[round]>=0.2 (not in the closure)\n" in res.stderr
    ), res.stderr
    assert (ws.wheels / "manifest.json").read_bytes() == before


def test_resolved_pins_of_a_distribution_the_lock_builds_are_refused(workspace: Workspace) -> None:
    """The closure may not carry a second copy of a wheel we build (a stale resolution, a hand edit)."""
    ws = workspace
    pure_only(ws)
    ws.edit_lock("resolved = [\n", f'resolved = [\n    "repro-pure==0.1.0 --hash=sha256:{"0" * 64}",\n')
    res = ws.doit("wheels", "profile=pure", check=False)
    assert res.returncode == 11, res.stdout + res.stderr  # LockError
    assert "[runtime] resolved pins repro-pure, which this lock builds itself" in res.stderr, res.stderr
    assert "doit lock update=runtime" in res.stderr
    assert not (ws.wheels / "manifest.json").exists()


def served_copy(published: Path, dest: Path) -> Path:
    shutil.copytree(published, dest)
    return dest


def test_lock_resolves_again_only_what_changed(tmp_path: Path, published: Path) -> None:
    served = served_copy(published, tmp_path / "served")
    with FixtureServer(served) as srv:
        ws = make_workspace(tmp_path / "ws", tmp_path / "cache", srv.url)
        assert pins(ws)["repro-colors"] == "1.1.0"
        # A newer repro-colors appears on the index; a requirement is added: the earlier pin stays.
        projects: dict[str, dict[str, str]] = {}
        for project, versions in {
            **RUNTIME_WHEELS,
            "repro-colors": {**RUNTIME_WHEELS["repro-colors"], "1.2.0": ((), "COLOR = 'green'\n")},
        }.items():
            for version, (requires, code) in versions.items():
                name, digest = write_wheel(served / "packages", project, version, requires, code)
                projects.setdefault(project, {})[name] = digest
        projects["repro-cuda"] = {"repro_cuda-0.1.0.tar": file_sha256(served / "packages" / "repro_cuda-0.1.0.tar")}
        simple_index(served, projects)
        ws.edit_lock(
            'requirements = ["repro-greeting>=0.3"]', 'requirements = ["repro-greeting>=0.3", "repro-colors>=1.0"]'
        )
        res = ws.doit("lock")
        assert "added none; changed none; removed none" in res.stdout, res.stdout
        assert pins(ws)["repro-colors"] == "1.1.0"
        # Without earlier pins, the newest.
        text = ws.lock.read_text()
        ws.lock.write_text(re.sub(r"resolved = \[[^\]]*\]\nresolved_from = \"[0-9a-f]+\"\n", "", text))
        ws.doit("lock")
        assert pins(ws)["repro-colors"] == "1.2.0"
        # A requirement no index can meet: one clear error naming it, the lock left as it was.
        before = ws.lock.read_text()
        ws.edit_lock('"repro-colors>=1.0"]', '"repro-colors>=1.0", "repro-nonexistent>=1"]')
        edited = ws.lock.read_text()
        res = ws.doit("lock", check=False)
        assert res.returncode == 11, res.stdout + res.stderr
        assert "[runtime] cannot be resolved for CPython 3.11" in res.stderr and "repro-nonexistent" in res.stderr
        assert ws.lock.read_text() == edited != before


def test_built_wheel_needing_what_the_closure_lacks_is_refused(workspace: Workspace) -> None:
    ws = workspace
    pure_only(ws)
    ws.edit_lock('requirements = ["repro-greeting>=0.3"]', 'requirements = ["repro-round"]')
    ws.doit("lock")  # repro_pure is not built yet: the resolution cannot know it needs repro-colors
    assert sorted(pins(ws)) == ["repro-round"]
    res = ws.doit("wheels", "profile=pure", check=False)
    assert res.returncode == 11, res.stdout + res.stderr
    assert "package repro_pure requires repro-colors>=1.0 (not in the closure)" in res.stderr
    assert not (ws.wheels / "manifest.json").exists()


def test_patched_base_package_is_the_base_version_and_brings_no_requirements(workspace: Workspace) -> None:
    """A package the base provides, rebuilt with our patch (as SGLang in the InfiR2 image): it must be the
    base's version; its own requirements are the base's, so they are not asked of the closure."""
    ws = workspace
    pure_only(ws, provided='["torch", "repro-pure==0.1.0"]')
    ws.edit_lock('requirements = ["repro-greeting>=0.3"]', 'requirements = ["repro-round"]')
    ws.doit("lock")
    ws.doit("wheels", "profile=pure")  # repro_pure needs repro-colors, which the closure lacks: the base has it
    assert set(manifest(ws)) == {"repro_pure", "repro-round"}
    ws.edit_lock('"repro-pure==0.1.0"', '"repro-pure==0.2.0"')  # a base with another version
    ws.doit("lock")
    res = ws.doit("wheels", "profile=pure", check=False)
    assert res.returncode == 11, res.stdout + res.stderr
    assert "package repro_pure builds repro-pure 0.1.0, but the target provides 0.2.0" in res.stderr, res.stderr


def python_installation(root: Path) -> tuple[Path, Path]:
    """A Python installation at ``root`` whose site-packages is empty and ours (a base image's interpreter, on
    this host): the running interpreter's executable copied, its standard library linked. Returns the
    interpreter and the site-packages directory a ``--system-site-packages`` venv of it sees."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / version
    shutil.copy2(Path(sys._base_executable).resolve(), python)  # a copy, not a link: its prefix is ``root``
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (root / "lib" / version).mkdir(parents=True)
    for entry in stdlib.iterdir():
        if entry.name not in ("site-packages", "dist-packages"):
            (root / "lib" / version / entry.name).symlink_to(entry)
    probe = "import site, sys; print(sys.prefix); print(*site.getsitepackages(), sep='\\n')"
    prefix, *sites = subprocess.run(
        [str(python), "-I", "-c", probe], check=True, capture_output=True, text=True
    ).stdout.split()
    assert Path(prefix) == root, f"{python} found its prefix at {prefix}, not {root}"
    site_dir = Path(sites[0])
    site_dir.mkdir(parents=True, exist_ok=True)
    if subprocess.run([str(python), "-I", "-c", "import ensurepip"], capture_output=True, check=False).returncode:
        # No ensurepip (Debian without python3-venv): install-wheels.sh drives the base's own pip, as on such a base.
        import pip

        shutil.copytree(Path(pip.__file__).parent, site_dir / "pip")
    return python, site_dir


def test_install_script_puts_a_patched_wheel_over_the_bases_copy_of_the_same_version(tmp_path: Path) -> None:
    """docker/install-wheels.sh, as `doit image` runs it in a container of the base, here on a Python whose
    own site-packages holds repro-colors 1.1.0: the wheelhouse's patched repro-colors 1.1.0 (the SGLang case,
    pinned at the base's version) is installed into the venv and is the one imported (docs/lock.md)."""
    python, site_dir = python_installation(tmp_path / "base")
    original, _ = write_wheel(tmp_path / "original", "repro-colors", "1.1.0", (), "COLOR = 'the base'\n")
    with zipfile.ZipFile(tmp_path / "original" / original) as zf:
        zf.extractall(site_dir)  # installed in the base, as a base image's pip would leave it
    wheels = tmp_path / "wheels"
    _name, digest = write_wheel(wheels, "repro-colors", "1.1.0", (), "COLOR = 'patched'\n")
    (wheels / "requirements.txt").write_text(f"repro-colors==1.1.0 --hash=sha256:{digest}\n")
    prefix = tmp_path / "opt" / "reprostack"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LC_ALL": "C.UTF-8", "SOURCE_DATE_EPOCH": "315532800"}
    res = subprocess.run(
        ["sh", str(REPO / "docker" / "install-wheels.sh"), str(python), str(prefix), str(wheels)],
        env=env, capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    probe = "import repro_colors; print(repro_colors.COLOR); print(repro_colors.__file__)"
    out = subprocess.run(
        [str(prefix / "bin" / "python"), "-c", probe], env=env, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    assert out[0] == "patched", f"the venv imports the base's copy ({out[1]}), not the wheelhouse's:\n{res.stdout}"
    assert Path(out[1]).is_relative_to(prefix)


def test_fetched_wheel_whose_hash_differs_is_refused(workspace: Workspace, tmp_path: Path) -> None:
    ws = workspace
    pure_only(ws)
    mirror = tmp_path / "mirror" / "wheels"
    mirror.mkdir(parents=True)
    name, _digest = write_wheel(mirror, "repro-colors", "1.1.0", (), "COLOR = 'tampered'\n")
    res = ws.doit("wheels", "profile=pure", f"mirror={mirror.parent}", check=False)
    assert res.returncode == 13, res.stdout + res.stderr  # VerificationError
    assert f"{name} has sha256" in res.stderr and "which the lock does not pin" in res.stderr
    assert not list((ws.cache / "fetched").glob(f"*/{name}"))
    assert not (ws.wheels / "manifest.json").exists()


def git_repo(tmp_path: Path, served: Path, name: str, files: dict[str, str]) -> str:
    """A repository of ``files`` published for dumb HTTP under ``served``; its commit."""
    work = tmp_path / f"work-{name}"
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}  # fmt: skip
    subprocess.run(["git", "init", "-q", str(work)], check=True, env=env)
    for rel, text in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    subprocess.run(["git", "-C", str(work), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(work), "commit", "-qm", name], check=True, env=env)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(served / f"{name}.git")], check=True, env=env)
    subprocess.run(["git", "-C", str(served / f"{name}.git"), "update-server-info"], check=True, env=env)
    return subprocess.run(
        ["git", "-C", str(work), "rev-parse", "HEAD"], check=True, env=env, capture_output=True, text=True
    ).stdout.strip()


def test_patch_taken_from_a_pinned_source(tmp_path: Path, published: Path) -> None:
    """A patch by path in another pinned repository (as InfiR2's docker/patch/<version>/sglang.patch)."""
    served = served_copy(published, tmp_path / "served")
    patch = (
        Path(__file__).resolve().parents[2] / "examples" / "patches" / "repro_pure" / "0001-patched-message.patch"
    ).read_text()
    commit = git_repo(tmp_path, served / "git", "recipes", {"docker/patch/latest/pure.patch": patch})
    with FixtureServer(served) as srv:
        ws = make_workspace(tmp_path / "ws", tmp_path / "cache", srv.url)
        pure_only(ws)
        ws.edit_lock(
            "[sources.repro-torchext]",
            f'[sources.recipes]\nkind = "git"\nurl = "{srv.url}/git/recipes.git"\ncommit = "{commit}"\n\n'
            "[sources.repro-torchext]",
        )
        ws.edit_lock(
            'patches = ["0001-patched-message.patch"]',
            'patches = [{ source = "recipes", path = "docker/patch/latest/pure.patch" }]',
        )
        ws.doit("lock")  # the new source's tree hash
        ws.doit("wheels", "profile=pure")
        doc = json.loads(next((ws.cache / "wheels").glob("*/*/entry.json")).read_text())
        assert doc["key_document"]["patches"][0]["name"] == "recipes:docker/patch/latest/pure.patch"
        ws.edit_lock("docker/patch/latest/pure.patch", "docker/patch/v0.0/pure.patch")
        res = ws.doit("wheels", "profile=pure", check=False)
        assert res.returncode == 14, res.stdout + res.stderr  # PatchError
        assert f"patch 'docker/patch/v0.0/pure.patch' does not exist in source recipes at {commit}" in res.stderr


def test_prebuilt_wheel_by_url_is_pinned_placed_and_refused_when_altered(tmp_path: Path) -> None:
    served = tmp_path / "served"
    name, _ = write_wheel(served, "repro-round", "0.1.0", (), "PI = 3.14159\n")
    with FixtureServer(served) as srv:
        ws = tmp_path / "ws"
        ws.mkdir()
        lock = ws / "prebuilt.lock"
        lock.write_text(
            'format = 1\n[toolchain]\npython = ">=3.10"\narchs = ["sm_90a"]\n'
            f'[sources.round-wheel]\nkind = "wheel"\nurl = "{srv.url}/{name}"\n'
            '[packages.repro_round]\nsource = "round-wheel"\ndistribution = "repro-round"\n'
            'verify = { imports = ["repro_round"] }\n'
        )
        res = run(ws, lock, tmp_path / "cache", "lock")
        assert res.returncode == 0, res.stdout + res.stderr
        assert f'sha256 = "{file_sha256(served / name)}"' in lock.read_text()
        res = run(ws, lock, tmp_path / "cache", "wheels")
        assert res.returncode == 0 and f"placed repro_round: {name} (prebuilt" in res.stdout, res.stdout + res.stderr
        rec = json.loads((ws / "wheels" / "manifest.json").read_text())["wheels"][0]
        assert (rec["origin"], rec["url"], rec["sha256"]) == (
            "prebuilt",
            f"{srv.url}/{name}",
            file_sha256(served / name),
        )
        statement = json.loads((ws / "wheels" / "provenance" / f"{name}.intoto.json").read_text())
        assert statement["predicate"]["buildDefinition"]["buildType"].endswith("/fetched-wheel/v1")
        sbom = (ws / "wheels" / "sbom.cdx.json").read_text()
        assert '"reprostack:origin"' in sbom and "round-wheel" in sbom
        assert run(ws, lock, tmp_path / "cache", "-s", "verify", "gpu=off").returncode == 0
        write_wheel(served, "repro-round", "0.1.0", (), "PI = 3\n")  # the same URL, other bytes
        res = run(ws, lock, tmp_path / "cache2", "wheels")
        assert res.returncode == 13, res.stdout + res.stderr
        assert "but the lock pins" in res.stderr and "nothing was kept" in res.stderr


def run(root: Path, lock: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "REPRO_"))} | {
        "PIP_CONFIG_FILE": os.devnull
    }
    repo = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-m", "doit", "-f", str(repo / "dodo.py"), "-d", str(root), *args, f"lock={lock}",
         f"cache={cache}"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def local_torch_wheel() -> Path | None:
    """A torch wheel for this Python in pip's find-links (this machine's /opt/wheels has a CPU build)."""
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    for folder in [*os.environ.get("PIP_FIND_LINKS", "").split(), "/opt/wheels"]:
        found = sorted(Path(folder).glob(f"torch-*-{tag}-{tag}-*x86_64.whl")) if Path(folder).is_dir() else []
        if found:
            return found[-1]
    return None


def test_a_pinned_torch_wheel_is_the_torch_builds_compile_against(tmp_path: Path, published: Path) -> None:
    """[toolchain.hermetic] wheels = [...]: a torch wheel by URL and sha256 installed into the build's toolchain."""
    wheel = local_torch_wheel()
    if wheel is None:
        pytest.skip("no torch wheel file for this Python on this machine (pip find-links); downloading one is too big")
    served = served_copy(published, tmp_path / "served")
    (served / "torch").mkdir()
    (served / "torch" / wheel.name).symlink_to(wheel)
    with FixtureServer(served) as srv:
        ws = make_workspace(tmp_path / "ws", tmp_path / "cache", srv.url)
        ws.edit_lock(
            "[sources.repro-pure]",
            f'[sources.pinned-torch]\nkind = "wheel"\nurl = "{srv.url}/torch/{wheel.name.replace("+", "%2B")}"\n'
            f'sha256 = "{file_sha256(wheel)}"\n\n[sources.repro-pure]',
        )
        ws.edit_lock('archs = ["sm_90a"]', 'archs = ["sm_90a"]\n\n[toolchain.hermetic]\nwheels = ["pinned-torch"]')
        ws.doit("build:repro_torchext")
        doc = next(json.loads(p.read_text()) for p in (ws.cache / "wheels").glob("*/*/entry.json"))
        assert doc["key_document"]["hermetic_toolchain"]["wheels"] == [
            f"{wheel.name} --hash=sha256:{file_sha256(wheel)}"
        ]
        log = (ws.root / "build" / "logs" / "build-repro_torchext.log").read_text()
        assert re.search(r"toolchains/[0-9a-f]{64}/site/torch/include", log), (
            "the build did not compile against the pinned torch"
        )


def test_a_profile_with_its_own_environment_and_checks(workspace: Workspace) -> None:
    """[profiles.NAME.runtime] replaces the lock's environment for that profile; [runtime] verify checks it whole."""
    ws = workspace
    pure_only(ws, provided="[]")
    ws.lock.write_text(
        ws.lock.read_text()
        + '\n[profiles.pure.runtime]\nrequirements = ["repro-colors"]\npython = "3.11"\n'
        + 'verify = { imports = ["repro_colors"], smoke = "repro_pure" }\n'
    )
    res = ws.doit("lock")
    assert "runtime: 4 distributions" in res.stdout, res.stdout
    assert "profiles.pure.runtime (profile pure): 1 distributions" in res.stdout, res.stdout
    ws.doit("wheels", "profile=pure")
    assert {n: w["origin"] for n, w in manifest(ws).items()} == {"repro_pure": "built", "repro-colors": "fetched"}
    ws.doit("-s", "verify", "profile=pure", "gpu=off", "isolated=on")
    report = ws.root / "build" / "verify" / "report.json"
    rows = {(r["package"], r["check"]): r["status"] for r in json.loads(report.read_text())["rows"]}
    assert rows[("environment", "import")] == "PASS"
    assert rows[("environment", "smoke:greet")] == "PASS"
    # The lock's own environment (repro-greeting) is not this profile's: importing it fails the check.
    ws.lock.write_text(ws.lock.read_text().replace('imports = ["repro_colors"]', 'imports = ["repro_greeting"]'))
    ws.doit("wheels", "profile=pure")
    res = ws.doit("-s", "verify", "profile=pure", "gpu=off", "isolated=on", check=False)
    assert res.returncode == 17, res.stdout + res.stderr
    rows = {(r["package"], r["check"]): r for r in json.loads(report.read_text())["rows"]}
    assert rows[("environment", "import")]["status"] == "FAIL"
    assert "repro_greeting" in rows[("environment", "import")]["detail"]
