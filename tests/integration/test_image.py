"""`doit image`, `doit verify_image`, `doit export` and the image side of `doit lock`, end to end.

Real docker daemon, real base image (Debian packages, made by
scripts/make-base-image.sh, or the one .ci/run made: REPRO_TEST_BASE), real
wheels of the example lock's ``quick`` profile (the torch extension is left
out: the plain Debian base has no torch), a real registry where one is
installed (Debian's docker-registry).

Without a docker daemon these tests fail with the reason when CI is set
(.ci/run sets it), and are skipped with the reason otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, Workspace, built_packages, copy_cache, make_workspace, require

from tasks.core.treehash import file_sha256

pytestmark = [pytest.mark.integration, pytest.mark.needs_nvcc]

IMAGE_NAME = "reprostack-test"
QUICK = ("repro_cuda", "repro_pure", "repro_pybind")


def _docker(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
    )
    if check and res.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return res


def image_table(base: str = "localhost/reprostack-base:bookworm") -> str:
    """The example lock's [image] table as the tests use it: their image name, a copy of docker/."""
    return f'[image]\nbase = "{base}"\nname = "{IMAGE_NAME}"\ndocker_dir = "docker"\n'


def image_workspace(root: Path, cache: Path, url: str, table: str | None = None) -> Workspace:
    """A workspace of the example lock whose [image] table is ``table`` (by default the example's own)."""
    ws = make_workspace(root, cache, url)
    shutil.copytree(REPO / "docker", ws.root / "docker")  # a copy, so tests may edit it
    head, sep, _ = ws.lock.read_text().partition("[image]\n")
    assert sep, "examples/example.lock has no [image] table"
    ws.lock.write_text(head + (table or image_table()))
    return ws


def labelled_images() -> list[str]:
    """IDs of every image carrying an image-key label (ours)."""
    out = _docker("image", "ls", "--quiet", "--no-trunc", "--filter", "label=org.reprostack.image.key").stdout
    return sorted(set(out.split()))


@pytest.fixture(scope="module", autouse=True)
def _remove_labelled_images() -> Iterator[None]:
    yield
    if shutil.which("docker") is None:
        return
    tags = _docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}", IMAGE_NAME, check=False).stdout.split()
    if tags:
        _docker("image", "rm", "--force", *tags, check=False)


@pytest.fixture(scope="module")
def built(
    docker_ready: None, base_id: str, quick_cache: Path, server: object, tmp_path_factory: pytest.TempPathFactory
) -> Workspace:
    """A workspace whose quick-profile wheelhouse is built (from the session's cache)."""
    root = tmp_path_factory.mktemp("image")
    ws = image_workspace(root / "ws", copy_cache(quick_cache, root / "cache"), server.url)  # type: ignore[attr-defined]
    ws.env_extra["REPRO_PROFILE"] = "quick"
    ws.doit("wheels")
    return ws


def labels_of(ref: str) -> dict[str, str]:
    info = json.loads(_docker("image", "inspect", ref).stdout)[0]
    return dict(info["Config"]["Labels"])


def image_tag(output: str) -> str:
    """The tag a `doit image` run built, or found up to date (with -a)."""
    m = re.search(rf"^(?:built image|image) ({IMAGE_NAME}:[0-9a-f]{{12}}) ", output, flags=re.M)
    assert m, output
    return m.group(1)


def test_image_build_labels_noop_verify_export(built: Workspace, base_id: str, tmp_path: Path) -> None:
    ws = built
    res = ws.doit("image", f"base={base_id}")
    tag = image_tag(res.stdout)
    labels = labels_of(tag)
    manifest = json.loads((ws.wheels / "manifest.json").read_text())
    lock_sha = file_sha256(ws.lock)
    assert labels["org.reprostack.lock.sha256"] == lock_sha == manifest["lock_sha256"]
    assert tag.endswith(labels["org.reprostack.image.key"][:12])
    assert labels["org.reprostack.base.id"] == base_id
    for wheel in manifest["wheels"]:
        pkg = wheel["package"].replace("_", "-")
        assert labels[f"org.reprostack.wheel.{pkg}.sha256"] == wheel["sha256"]
    lock_text = ws.lock.read_text()
    assert labels["org.reprostack.source.repro-pure.commit"] == "df2a08ea1349bfb47e7940d56c8a2c5c9135f354"
    assert labels["org.reprostack.source.repro-pybind.sha256"] in lock_text
    assert labels["org.reprostack.source.repro-cuda.sha256"] in lock_text
    # The wheels are in the image's venv, first on PATH; the wheel files themselves are not in any layer.
    probe = "import sys, repro_pure as p, repro_pybind as b, repro_cuda; print(sys.prefix, p.MESSAGE, b.add(2, 3))"
    out = _docker("run", "--rm", "--network", "none", tag, "python", "-c", probe).stdout.split()
    assert out == ["/opt/reprostack", "patched", "5"]
    # One layer on the base, made at the fixed time; its history entry says what it holds, not how it was made.
    info = json.loads(_docker("image", "inspect", tag).stdout)[0]
    base_layers = json.loads(_docker("image", "inspect", base_id).stdout)[0]["RootFS"]["Layers"]
    assert info["RootFS"]["Layers"][:-1] == base_layers and info["Created"] == "1980-01-01T00:00:00Z"
    history = _docker("image", "history", "--no-trunc", "--format", "{{.CreatedBy}}", tag).stdout
    # 3 of ours and the 4 of the runtime closure
    assert history.splitlines()[0] == "doit image: 7 wheels from the wheelhouse into the venv /opt/reprostack"
    assert "/reprostack/wheels" not in history and "install-wheels" not in history
    leftovers = _docker("run", "--rm", "--network", "none", tag, "find", "/opt/reprostack", "/tmp", "-name", "*.whl")
    assert leftovers.stdout == ""

    # Nothing changed: doit skips the task; nothing is built; the log says where the build's output went.
    again = ws.doit("image", f"base={base_id}")
    assert "-- image" in again.stdout and "built image" not in again.stdout
    assert (ws.root / "build" / "logs" / "image.log").is_file()

    # doit verify inside the image: everything passes, and the GPU checks are skipped, never passed.
    report = ws.doit("verify_image", f"base={base_id}").stdout
    assert re.search(r"^\d+ passed, 0 failed, \d+ skipped$", report, flags=re.M), report
    assert re.search(r"^image\s+gpu\s+SKIP\s", report, flags=re.M), report
    assert re.search(r"^wheelhouse\s+installed\s+PASS\s+checking what /opt/reprostack/bin/python", report, re.M)
    for check in ("import", "libs", "symbols"):
        assert re.search(rf"^repro_pybind\s+{check}\s+PASS", report, flags=re.M), report
    assert re.search(r"^repro_cuda\s+arch\s+PASS\s.*sm_90a", report, flags=re.M), report
    assert re.search(r"^repro_cuda\s+smoke:vadd\s+SKIP", report, flags=re.M), report
    saved = json.loads((ws.root / "build" / "verify-image" / "report.json").read_text())
    assert not [
        r for r in saved["rows"] if r["check"].startswith("smoke") and "vadd" in r["check"] and r["status"] == "PASS"
    ]
    # train=on (issue 40): the training check runs in the container too; this image has no torch, nor the stack.
    trained = ws.doit("verify_image", f"base={base_id}", "train=on", check=False)
    assert trained.returncode == 17, trained.stdout + trained.stderr
    rows = json.loads((ws.root / "build" / "verify-image" / "report.json").read_text())["rows"]
    training = {r["check"]: r for r in rows if r["package"] == "training"}
    assert training["train-launch"]["detail"].startswith("not launched: the venv lacks torch, "), training
    assert {r["status"] for r in training.values()} == {"FAIL"}

    # doit export: a docker-archive and an OCI layout, with their sha256s; both load back.
    ws.doit("export", f"base={base_id}")
    export = ws.root / "build" / "export"
    record = json.loads((export / f"{tag.replace(':', '-')}.json").read_text())
    archive = export / record["docker_archive"]["path"]
    assert file_sha256(archive) == record["docker_archive"]["sha256"]
    sums = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=export, capture_output=True, text=True, check=False)
    assert sums.returncode == 0, sums.stdout + sums.stderr
    layout = export / record["oci_layout"]["path"]
    raw = subprocess.run(["skopeo", "inspect", "--raw", f"oci:{layout}:{tag}"], capture_output=True, check=True).stdout
    assert "sha256:" + hashlib.sha256(raw).hexdigest() == record["oci_layout"]["manifest_digest"]
    config = json.loads(
        subprocess.run(["skopeo", "inspect", "--config", f"oci:{layout}:{tag}"], capture_output=True, check=True).stdout
    )
    assert config["config"]["Labels"]["org.reprostack.image.key"] == labels["org.reprostack.image.key"]
    _docker("image", "rm", tag)
    loaded = _docker("load", "--input", str(archive)).stdout
    assert tag in loaded
    assert labels_of(tag)["org.reprostack.image.key"] == labels["org.reprostack.image.key"]
    # A second export of the same image is up to date.
    assert "-- export" in ws.doit("export", f"base={base_id}").stdout
    # The air-gapped bundle carries the exported image; unbundled, it is the same archive and layout.
    ws.doit("bundle", f"base={base_id}", "bundle_image=on")
    (bundle,) = (ws.root / "build" / "bundle").glob("*.tar")
    site = tmp_path / "site"
    assert "parts: wheels, image" in ws.doit("unbundle", f"bundle={bundle}", f"dest={site}").stdout
    assert file_sha256(site / "image" / archive.name) == record["docker_archive"]["sha256"]
    assert (site / "image" / layout.name / "index.json").read_bytes() == (layout / "index.json").read_bytes()


def image_digests(ref: str) -> dict[str, Any]:
    """What identifies an image: its ID (the config's sha256), its layers' diff_ids, and its config."""
    info = json.loads(_docker("image", "inspect", ref).stdout)[0]
    return {"id": info["Id"], "layers": info["RootFS"]["Layers"], "created": info["Created"], "config": info["Config"]}


def first_difference(first: dict[str, Any], second: dict[str, Any]) -> str:
    """'' when the two images are the same; else the first thing that differs, with both values."""
    if first["id"] == second["id"]:
        return ""
    lines = [f"image IDs differ:\n  first:  {first['id']}\n  second: {second['id']}"]
    for i, (a, b) in enumerate(zip(first["layers"], second["layers"], strict=False)):
        if a != b:
            lines.append(f"layer {i + 1} of {len(first['layers'])} differs:\n  first:  {a}\n  second: {b}")
            break
    else:
        if len(first["layers"]) != len(second["layers"]):
            lines.append(f"layer counts differ: {len(first['layers'])} vs {len(second['layers'])}")
    for key in ("created", *sorted(set(first["config"]) | set(second["config"]))):
        a = first.get(key, first["config"].get(key))
        b = second.get(key, second["config"].get(key))
        if a != b:
            lines.append(f"{key} differs:\n  first:  {a!r}\n  second: {b!r}")
            break
    return "\n".join(lines)


def test_two_builds_of_the_same_inputs_give_the_same_image(
    built: Workspace, base_id: str, quick_cache: Path, server: object, tmp_path: Path
) -> None:
    first_tag = image_tag(built.doit("-a", "image", f"base={base_id}").stdout)
    first = image_digests(first_tag)
    # Elsewhere, from a copy of the cache (the same wheels), after the first image is gone: built again.
    _docker("image", "rm", first_tag)
    other = image_workspace(tmp_path / "elsewhere", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    other.env_extra["REPRO_PROFILE"] = "quick"
    other.doit("wheels")
    res = other.doit("image", f"base={base_id}")
    assert "built image" in res.stdout, res.stdout
    second = image_digests(image_tag(res.stdout))
    assert image_tag(res.stdout) == first_tag
    difference = first_difference(first, second)
    assert not difference, f"two builds of {first_tag} from the same inputs differ:\n{difference}"
    assert second["layers"] == first["layers"] and second["created"] == "1980-01-01T00:00:00Z"
    # Had they differed, the report names both sides: here, against the base.
    report = first_difference(first, image_digests(base_id))
    assert report.startswith(f"image IDs differ:\n  first:  {first['id']}\n  second: {base_id}"), report
    assert "layer counts differ: 2 vs 1" in report, report


def test_inputs_that_change_the_image_and_switching_back(built: Workspace, base_id: str) -> None:
    ws = built
    first = labels_of(image_tag(ws.doit("-s", "-a", "image", f"base={base_id}").stdout))
    script = ws.root / "docker" / "install-wheels.sh"
    original = script.read_text()
    script.write_text(original + "# an edit of docker/\n")
    second = image_tag(ws.doit("image", f"base={base_id}").stdout)
    assert labels_of(second)["org.reprostack.image.key"] != first["org.reprostack.image.key"]
    assert labels_of(second)["org.reprostack.docker.tree-sha256"] != first["org.reprostack.docker.tree-sha256"]
    # Back to the first docker/: that image still exists, so nothing is built.
    script.write_text(original)
    back = ws.doit("image", f"base={base_id}")
    assert "built image" not in back.stdout and "-- image" in back.stdout, back.stdout


def test_the_locks_env_and_volumes_are_in_the_image(built: Workspace, base_id: str) -> None:
    """[image] env and volumes (the improve-muon recipe's torch.compile cache): set in the image's config."""
    ws = built
    before = ws.lock.read_text()
    try:
        ws.lock.write_text(
            before + 'env = { TORCHINDUCTOR_CACHE_DIR = "/var/cache/torch-compile/inductor" }\n'
            'volumes = ["/var/cache/torch-compile"]\n'
        )
        tag = image_tag(ws.doit("image", f"base={base_id}").stdout)
        config = json.loads(_docker("image", "inspect", tag).stdout)[0]["Config"]
        assert config["Volumes"] == {"/var/cache/torch-compile": {}}
        out = _docker("run", "--rm", "--network", "none", tag, "sh", "-c", "echo $TORCHINDUCTOR_CACHE_DIR $VIRTUAL_ENV")
        assert out.stdout.split() == ["/var/cache/torch-compile/inductor", "/opt/reprostack"]
    finally:
        ws.lock.write_text(before)


def test_base_must_be_pinned_and_present(built: Workspace, base_id: str) -> None:
    ws = built
    before = labelled_images()
    res = ws.doit("image", check=False)  # the lock's base has no digest, and no base= is given
    text = res.stdout + res.stderr
    assert res.returncode != 0 and "has no digest" in text and "base=<image ID>" in text, text
    assert "Traceback" not in text
    ws.edit_lock('name = "reprostack-test"', 'name = "reprostack-test"\ndigest = "sha256:' + "0" * 64 + '"')
    try:
        res = ws.doit("image", check=False)
        text = res.stdout + res.stderr
        assert res.returncode != 0, text
        assert (
            "is not in the local docker daemon" in text and "docker pull localhost/reprostack-base@sha256:0000" in text
        )
        res = ws.doit("image", "base=" + "f" * 64, check=False)
        text = res.stdout + res.stderr
        assert res.returncode != 0 and "no such image in the local docker daemon" in text, text
        res = ws.doit("image", "base=reprostack-base:latest", check=False)
        assert res.returncode != 0 and "give a local image by ID" in res.stdout + res.stderr
    finally:
        ws.edit_lock('\ndigest = "sha256:' + "0" * 64 + '"', "")
    # A base with ONBUILD triggers: docker build would run them, doit image does not, so it refuses the base.
    onbuild = f"reprostack-test-onbuild:{base_id[7:19]}"
    res = subprocess.run(
        ["docker", "build", "--quiet", "--tag", onbuild, "-"],
        input=f"FROM {base_id}\nONBUILD RUN touch /onbuild-ran\n",
        capture_output=True,
        text=True,
        env=dict(os.environ, DOCKER_BUILDKIT="0"),
        check=False,
    )
    assert res.returncode == 0, res.stderr
    try:
        res = ws.doit("image", f"base={res.stdout.strip()}", check=False)
        text = res.stdout + res.stderr
        assert res.returncode != 0 and "has ONBUILD triggers (['RUN touch /onbuild-ran'])" in text, text
    finally:
        _docker("image", "rm", onbuild, check=False)
    assert labelled_images() == before


def test_wheelhouse_that_does_not_match_is_refused(built: Workspace, base_id: str) -> None:
    ws = built
    ws.doit("wheels")  # the lock is as it was, but earlier tests left the wheelhouse of an edited one
    _docker("image", "rm", image_tag(ws.doit("-a", "image", f"base={base_id}").stdout))
    before = labelled_images()
    manifest = json.loads((ws.wheels / "manifest.json").read_text())
    wheel = ws.wheels / next(w["filename"] for w in manifest["wheels"] if w["package"] == "repro_pure")
    original = wheel.read_bytes()
    try:
        # Same size, other bytes: `doit wheels` (which compares sizes) lets it through, `doit image` does not.
        wheel.write_bytes(original[:-1] + bytes([original[-1] ^ 0x01]))
        res = ws.doit("image", f"base={base_id}", check=False)
        text = res.stdout + res.stderr
        assert res.returncode != 0 and f"{wheel.name}: sha256 differs from manifest.json" in text, text
        assert "doit wheels" in text and "Traceback" not in text
    finally:
        wheel.write_bytes(original)
    # A wheelhouse of another lock: the lock changed, the image task alone (-s) must refuse it.
    lock_text = ws.lock.read_text()
    try:
        ws.lock.write_text(lock_text + "\n# an edit after `doit wheels`\n")
        res = ws.doit("-s", "image", f"base={base_id}", check=False)
        text = res.stdout + res.stderr
        assert res.returncode != 0 and "manifest.json was written for a lock with sha256" in text, text
    finally:
        ws.lock.write_text(lock_text)
    assert labelled_images() == before


REQUIRES_PY_PATCH = "".join(
    [
        "Test only: a wheel that no Python of today accepts.\n\n",
        "--- a/pyproject.toml\n+++ b/pyproject.toml\n@@ -7,6 +7,6 @@\n",
        ' version = "0.1.0"\n description = "Pure-Python test fixture package"\n',
        '-requires-python = ">=3.8"\n+requires-python = ">=3.99"\n',
        " # What it needs at run time comes from the example lock's runtime closure",
        " (tests/fixtures/make_fixtures.py).\n",
        ' dependencies = ["repro-colors>=1.0"]\n \n',
    ]
)


def test_wheel_that_fails_to_install_names_the_step(
    docker_ready: None, base_id: str, quick_cache: Path, server: object, tmp_path: Path
) -> None:
    ws = image_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    (ws.root / "patches" / "repro_pure" / "0002-requires-python.patch").write_text(REQUIRES_PY_PATCH)
    ws.edit_lock(
        'patches = ["0001-patched-message.patch"]',
        'patches = ["0001-patched-message.patch", "0002-requires-python.patch"]\n'
        'pip_args = ["--ignore-requires-python"]',
    )
    ws.env_extra["REPRO_PROFILE"] = "quick"
    before = labelled_images()
    # The image stage's own containers (tasks/image/image.py names them): a container another test file's worker
    # runs meanwhile on the same daemon (the docs walk's `docker run --rm`) is none of this build's.
    ours = ("ps", "--all", "--quiet", "--no-trunc", "--filter", "name=reprostack-install-")
    containers = _docker(*ours).stdout.split()
    res = ws.doit("image", f"base={base_id}", check=False)
    text = res.stdout + res.stderr
    assert res.returncode != 0, text
    assert "install-wheels.sh in a container of the base failed (exit status 1) at install step " in text, text
    assert "install step 'pip install --no-index --require-hashes" in text, text
    assert "requires a different Python" in text and "No image was tagged" in text, text
    assert str(ws.root / "build" / "logs" / "image.log") in text
    assert labelled_images() == before
    assert _docker(*ours).stdout.split() == containers  # no failed build's container


def test_lock_without_a_registry_says_so(tmp_path: Path, server: object) -> None:
    ws = image_workspace(
        tmp_path / "ws",
        tmp_path / "cache",
        server.url,  # type: ignore[attr-defined]
        image_table(base="registry.invalid/reprostack/base:1"),
    )
    res = ws.doit("lock")
    assert "[image] registry.invalid/reprostack/base:1: left without a digest: cannot reach registry" in res.stdout
    assert "base=<image ID>" in res.stdout and "Traceback" not in res.stdout + res.stderr
    assert "digest" not in ws.lock.read_text().split("[image]", 1)[1]
    asked = ws.doit("lock", "update=image", check=False)
    assert asked.returncode != 0 and "cannot reach registry registry.invalid" in asked.stdout + asked.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def registry(docker_ready: None, tmp_path: Path) -> Iterator[str]:
    """A real registry (Debian's docker-registry, the CNCF distribution server) on loopback."""
    binary = shutil.which("docker-registry")
    if binary is None:
        require("docker-registry is not installed (apt-get install docker-registry)")
    port = _free_port()
    config = tmp_path / "registry.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {tmp_path / 'registry'}\nhttp:\n  addr: 127.0.0.1:{port}\n"
    )
    log = (tmp_path / "registry.log").open("wb")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def test_lock_pins_the_digest_and_image_builds_on_it(
    registry: str, base_id: str, quick_cache: Path, server: object, tmp_path: Path
) -> None:
    ref = f"{registry}/reprostack-test/base:bookworm"
    local = f"reprostack-test-base:{base_id.removeprefix('sha256:')[:12]}"
    _docker("tag", base_id, local)
    pulled = tag = ""
    try:
        # skopeo's docker-daemon: transport reads no DOCKER_HOST (CI's daemon has its own socket): say it.
        host = ["--src-daemon-host", os.environ["DOCKER_HOST"]] if os.environ.get("DOCKER_HOST") else []
        subprocess.run(
            [
                "skopeo",
                "copy",
                "--quiet",
                "--dest-tls-verify=false",
                *host,
                f"docker-daemon:{local}",
                f"docker://{ref}",
            ],
            check=True,
            capture_output=True,
        )
        pushed = subprocess.run(
            ["skopeo", "inspect", "--tls-verify=false", "--format", "{{.Digest}}", f"docker://{ref}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        ws = image_workspace(
            tmp_path / "ws",
            copy_cache(quick_cache, tmp_path / "cache"),
            server.url,  # type: ignore[attr-defined]
            image_table(base=ref),
        )
        res = ws.doit("lock")
        assert f"[image] {ref}: {pushed}" in res.stdout, res.stdout
        assert f'digest = "{pushed}"' in ws.lock.read_text()
        # Pinned but not pulled: refused; pulled by digest: the image builds on it without base=.
        ws.env_extra["REPRO_PROFILE"] = "quick"
        res = ws.doit("image", check=False)
        assert res.returncode != 0 and "is not in the local docker daemon" in res.stdout + res.stderr
        pulled = f"{registry}/reprostack-test/base@{pushed}"
        _docker("pull", pulled)
        tag = image_tag(ws.doit("image").stdout)
        labels = labels_of(tag)
        assert labels["org.opencontainers.image.base.digest"] == pushed
        assert labels["org.opencontainers.image.base.name"] == ref
    finally:
        _docker("image", "rm", local, check=False)
        if tag:
            _docker("image", "rm", tag, check=False)
        if pulled:
            _docker("image", "rm", pulled, check=False)


@pytest.fixture(scope="session")
def builder_id(docker_ready: None) -> str:
    """A builder image: the runtime base plus g++, python3-dev, setuptools, pybind11 from Debian (cached by tag)."""
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "make-base-image.sh"), "builder"],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    if res.returncode != 0:
        pytest.fail(f"scripts/make-base-image.sh builder failed:\n{res.stderr[-3000:]}", pytrace=False)
    return res.stdout.strip().splitlines()[-1]


BUILDER_PROFILE = """
[profiles.builder]
description = "What a plain Debian builder builds: no nvcc, no torch."
[profiles.builder.packages.repro_cuda]
enabled = false
[profiles.builder.packages.repro_torchext]
enabled = false
"""


def test_wheels_build_in_a_builder_image(
    builder_id: str, base_id: str, quick_cache: Path, server: object, tmp_path: Path
) -> None:
    ws = image_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    # The builder has neither torch nor nvcc: this lock does not ask for them.
    ws.edit_lock('torch = ">=2.4"\n', "")
    ws.edit_lock('cuda = ">=12.8"\n', "")
    ws.lock.write_text(ws.lock.read_text().replace("\n[image]", BUILDER_PROFILE + "\n[image]"))
    ws.env_extra["REPRO_PROFILE"] = "builder"
    res = ws.doit("wheels", f"builder={builder_id}")
    assert sorted(built_packages(res.stdout)) == ["repro_pure", "repro_pybind"]
    log = (ws.root / "build" / "logs" / "build-repro_pybind.log").read_text()
    assert "docker run --rm --network none" in log and "--mount type=bind,source=" in log
    assert "Processing /reprostack/src" in log  # built at the fixed path inside the builder
    manifest = json.loads((ws.wheels / "manifest.json").read_text())
    in_builder = {w["package"]: w["action_key"] for w in manifest["wheels"] if w["origin"] != "fetched"}
    entry = json.loads(next((ws.cache / "wheels").glob(f"*/{in_builder['repro_pybind']}/entry.json")).read_text())
    assert entry["key_document"]["builder"] == {"id": builder_id}
    assert "Debian" in entry["key_document"]["toolchain"]["cxx"]  # the builder's compiler, probed inside it
    # The same lock on this host: other keys (the session's cache has them from its host builds);
    # back to the builder: nothing is built again.
    ws.doit("wheels", "builder=host")
    on_host = {w["package"]: w["action_key"] for w in json.loads((ws.wheels / "manifest.json").read_text())["wheels"]
               if w["origin"] != "fetched"}  # fmt: skip
    assert set(on_host.values()).isdisjoint(in_builder.values())
    assert built_packages(ws.doit("wheels", f"builder={builder_id}").stdout) == []
    # The builder's wheels run in the runtime image (same Debian Python).
    report = ws.doit("verify_image", f"builder={builder_id}", f"base={base_id}").stdout
    assert re.search(r"^\d+ passed, 0 failed, \d+ skipped$", report, flags=re.M), report
    # A lock's [builder] needs a digest; builder=lock without one says what to do.
    ws.lock.write_text(ws.lock.read_text() + '\n[builder]\nimage = "localhost/reprostack-builder:bookworm"\n')
    res = ws.doit("wheels", check=False)
    assert res.returncode != 0 and "[builder] image 'localhost/reprostack-builder:bookworm' has no digest" in (
        res.stdout + res.stderr
    )


def test_no_docker_daemon_is_a_clear_error(tmp_path: Path, server: object) -> None:
    ws = image_workspace(tmp_path / "ws", tmp_path / "cache", server.url)  # type: ignore[attr-defined]
    ws.env_extra["DOCKER_HOST"] = f"unix://{tmp_path / 'no-such-docker.sock'}"
    res = ws.doit("-s", "image", "base=" + "a" * 64, check=False)
    text = res.stdout + res.stderr
    assert res.returncode != 0 and "ImageError: docker: cannot reach the docker daemon" in text, text
    assert "sudo systemctl start docker" in text and "Traceback" not in text


def test_a_bundle_unpacks_and_the_tool_installs_in_an_offline_container_with_only_python3(
    docker_ready: None, base_id: str, quick_cache: Path, server: object, tmp_path: Path
) -> None:
    """The air-gapped host as the issue (29) describes it: a container without network holding the distribution's
    python3 (the runtime base: python3, its venv and pip, nothing of ours) and the bundle file. The command
    `doit bundle` printed checks and unpacks it there, and the tool installs from the bundle's own wheels with
    --no-index, then runs."""
    ws = make_workspace(tmp_path / "ws", copy_cache(quick_cache, tmp_path / "cache"), server.url)  # type: ignore[attr-defined]
    ws.doit("wheels", "profile=quick")
    res = ws.doit("bundle", "profile=quick")
    (bundle,) = (ws.root / "build" / "bundle").glob("reprostack-*-quick.tar")
    (printed,) = [line for line in res.stdout.splitlines() if "with only python3" in line]
    command = printed.split(": ", 1)[1].replace(" DIR", " /site/stack")  # run in /site, beside the bundle
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy2(bundle, site / bundle.name)
    shutil.copy2(bundle.with_name(bundle.name + ".sha256"), site / (bundle.name + ".sha256"))
    script = (
        f"set -e; cd /site; {command}; python3 -m venv /opt/tool; "
        "/opt/tool/bin/pip install -q --no-index --find-links stack/tool --require-hashes "
        "-r stack/tool/requirements.txt; cd /tmp && /opt/tool/bin/reprostack help; ls /site/stack/wheels"
    )
    out = _docker("run", "--rm", "--network", "none", "-v", f"{site}:/site", base_id, "sh", "-c", script, timeout=900)
    assert "repro_pure" in out.stdout, out.stdout + out.stderr
    assert (site / "stack" / "wheels" / "manifest.json").is_file()
