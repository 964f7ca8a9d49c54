"""The image stage's pure parts: references, the [image]/[builder] tables, labels and key, failing steps.

The layer, config and docker-archive writers are tested in test_layer.py."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tasks.cli.oci import is_loopback, manifest_url, parse_challenge, split_update
from tasks.core.digest import action_key, canonical_json
from tasks.core.errors import LockError, ReproError
from tasks.core.imageref import label_key, parse_reference
from tasks.core.settings import load_settings
from tasks.env.build_container import BUILD_ENV, Builder, build_env, run_arguments
from tasks.image.image import (
    BasePin,
    ImagePlan,
    Wheelhouse,
    failed_install_step,
    image_labels,
    key_document,
    plan_config,
    wheelhouse_problems,
)
from tasks.lock.keys import key_document as action_key_document
from tasks.lock.lockfile import ImageSpec, Package, Source, parse_lock

DIGEST = "sha256:" + "c" * 64


# --------------------------------------------------------------------------- references


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "name"),
    [
        ("debian:12", "docker.io", "library/debian", "12", "debian"),
        ("lmsysorg/sglang:v0.5.2", "docker.io", "lmsysorg/sglang", "v0.5.2", "lmsysorg/sglang"),
        ("docker.io/lmsysorg/sglang:latest", "docker.io", "lmsysorg/sglang", "latest", "lmsysorg/sglang"),
        ("nvcr.io/nvidia/pytorch:25.09-py3", "nvcr.io", "nvidia/pytorch", "25.09-py3", "nvcr.io/nvidia/pytorch"),
        ("localhost:5000/base:1", "localhost:5000", "base", "1", "localhost:5000/base"),
        ("127.0.0.1:41234/a/b:x.y", "127.0.0.1:41234", "a/b", "x.y", "127.0.0.1:41234/a/b"),
        ("localhost/reprostack-base:bookworm", "localhost", "reprostack-base", "bookworm", "localhost/reprostack-base"),
    ],
)
def test_references_expand_like_the_docker_cli(text: str, registry: str, repository: str, tag: str, name: str) -> None:
    ref = parse_reference(text)
    assert (ref.registry, ref.repository, ref.tag, ref.name) == (registry, repository, tag, name)
    assert ref.pinned(DIGEST) == f"{name}@{DIGEST}"


def test_docker_hub_is_asked_at_its_api_host() -> None:
    assert parse_reference("lmsysorg/sglang:latest").api_host == "registry-1.docker.io"
    assert manifest_url(parse_reference("lmsysorg/sglang:v1")) == (
        "https://registry-1.docker.io/v2/lmsysorg/sglang/manifests/v1"
    )
    assert manifest_url(parse_reference("127.0.0.1:5000/a:1")) == "http://127.0.0.1:5000/v2/a/manifests/1"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("Debian:12", "lowercase"),
        ("nvcr.io/nvidia/pytorch:25.09-py3@" + DIGEST, "digest"),
        ("debian:bad tag", "not a valid tag"),
        (" debian:12", "not an image reference"),
        ("debian:-x", "not a valid tag"),
    ],
)
def test_bad_references_say_why(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_reference(text)


def test_label_keys_are_lowercase_dotted() -> None:
    assert label_key("wheel", "Repro_Pure", "sha256") == "org.reprostack.wheel.repro-pure.sha256"
    assert label_key("source", "te", "submodule", "3rdparty/cudnn-frontend") == (
        "org.reprostack.source.te.submodule.3rdparty-cudnn-frontend"
    )


# --------------------------------------------------------------------------- registry helpers


def test_bearer_challenge_is_parsed() -> None:
    scheme, params = parse_challenge(
        'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
        'scope="repository:library/debian:pull"'
    )
    assert scheme == "bearer"
    assert params == {
        "realm": "https://auth.docker.io/token",
        "service": "registry.docker.io",
        "scope": "repository:library/debian:pull",
    }


def test_loopback_registries_speak_http() -> None:
    assert is_loopback("localhost:5000") and is_loopback("127.0.0.1:1") and is_loopback("[::1]:5000")
    assert not is_loopback("nvcr.io") and not is_loopback("10.0.0.1:5000")


def test_update_names_the_image_tables_apart_from_sources() -> None:
    assert split_update(("image", "apex")) == (("apex",), ("image",))
    assert split_update(("all",)) == (("all",), ("all",))
    assert split_update(()) == ((), ())


# --------------------------------------------------------------------------- lock tables


def lock_doc(**tables: Any) -> dict[str, Any]:
    return {
        "format": 1,
        "toolchain": {"archs": ["sm_90a"]},
        "sources": {
            "s": {"kind": "url", "url": "https://example.invalid/a.tar", "sha256": "b" * 64, "tree_sha256": "b" * 64}
        },
        "packages": {"p": {"source": "s"}},
        **tables,
    }


def test_image_table_parses_with_defaults_relative_to_the_lock() -> None:
    lock = parse_lock(
        lock_doc(image={"base": "nvcr.io/nvidia/pytorch:25.09-py3", "digest": DIGEST}),
        path=Path("/x/y/sources.lock"),
        check_files=False,
        require_pins=False,
    )
    assert lock.image == ImageSpec(
        base="nvcr.io/nvidia/pytorch:25.09-py3",
        digest=DIGEST,
        name="reprostack",
        python="python3",
        prefix="/opt/reprostack",
        docker_dir=Path("/x/y/docker"),
    )
    assert lock.builder is None


def test_image_and_builder_problems_are_all_reported() -> None:
    doc = lock_doc(
        image={"base": "nvcr.io/nvidia/pytorch", "digest": "sha256:abc", "prefx": "/opt/x", "prefix": "opt"},
        builder={"image": "Builder:1", "python": 3},
    )
    with pytest.raises(LockError) as err:
        parse_lock(doc, path=Path("sources.lock"), check_files=False, require_pins=False)
    text = str(err.value)
    assert "needs a tag" in text
    assert "digest must be 'sha256:' and 64 lowercase hex digits, got 'sha256:abc'" in text
    assert "unknown key 'prefx' (perhaps you meant 'prefix'?)" in text
    assert "prefix must be an absolute path inside the image, got 'opt'" in text
    assert "[builder] image" in text and "lowercase" in text
    assert "[builder] python must be a string" in text


CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "/var/cache/torch-compile/inductor", "TRITON_CACHE_DIR": "/var/cache/tc/t"}


def test_image_env_and_volumes_parse_and_every_bad_one_is_reported() -> None:
    table = {"base": "nvcr.io/nvidia/pytorch:25.09-py3", "env": CACHE_ENV, "volumes": ["/var/cache/torch-compile"]}
    lock = parse_lock(lock_doc(image=table), path=Path("sources.lock"), check_files=False, require_pins=False)
    assert lock.image is not None
    assert (lock.image.env, lock.image.volumes) == (CACHE_ENV, ("/var/cache/torch-compile",))
    bad = lock_doc(image={"base": "a/b:1", "env": {"PATH": "/x", "1X": "y"}, "volumes": ["/a/", "/a/"]})
    with pytest.raises(LockError) as err:
        parse_lock(bad, path=Path("sources.lock"), check_files=False, require_pins=False)
    text = str(err.value)
    assert "[image] env has invalid variable names ['1X']" in text
    assert "[image] volumes has paths ['/a/', '/a/'] that are not absolute paths in plain form" in text
    for volumes, problem in (
        (["/opt/reprostack/cache"], "volume '/opt/reprostack/cache' overlaps the venv at prefix '/opt/reprostack'"),
        (["/opt"], "volume '/opt' overlaps the venv"),
        (["tmp"], "volumes has paths ['tmp']"),
        (["/c", "/c"], "volumes names ['/c'] more than once"),
    ):
        with pytest.raises(LockError, match=re.escape(problem)):
            parse_lock(lock_doc(image={"base": "a/b:1", "volumes": volumes}), path=Path("l.lock"), check_files=False)
    with pytest.raises(LockError, match=re.escape("[image] env may not set ['VIRTUAL_ENV']")):
        parse_lock(lock_doc(image={"base": "a/b:1", "env": {"VIRTUAL_ENV": "/x"}}), path=Path("l.lock"))


def test_the_image_config_carries_the_locks_env_and_volumes() -> None:
    """What `doit image` writes as the config (tasks/image/image.py plan_config) from a lock's [image] env
    and volumes."""
    table = {"base": "a/b:1", "env": CACHE_ENV, "volumes": ["/var/cache/torch-compile"]}
    spec = parse_lock(lock_doc(image=table), path=Path("l.lock"), check_files=False).image
    assert spec is not None
    base = {
        "Architecture": "amd64",
        "Os": "linux",
        "RootFS": {"Layers": ["sha256:" + "a" * 64]},
        "Config": {"Env": ["PATH=/usr/bin:/bin", "TRITON_CACHE_DIR=/root/.triton"], "Volumes": {"/data": {}}},
    }
    plan = ImagePlan(spec=spec, base=PIN, key="k" * 64, labels={"l": "v"}, document={})
    config = json.loads(plan_config(plan, base, [{"created_by": "base"}], "sha256:" + "c" * 64, 2))["config"]
    assert config["Env"] == [
        "PATH=/opt/reprostack/bin:/usr/bin:/bin",
        "TRITON_CACHE_DIR=/var/cache/tc/t",  # the lock's value in place of the base's
        "VIRTUAL_ENV=/opt/reprostack",
        "TORCHINDUCTOR_CACHE_DIR=/var/cache/torch-compile/inductor",
    ]
    assert config["Volumes"] == {"/data": {}, "/var/cache/torch-compile": {}}
    # They are part of the image's key; a lock without them keeps the key it had.
    house = Wheelhouse(root=Path("w"), manifest={"wheels": []}, requirements_sha256="0" * 64)
    docs = [key_document(spec=s, base=PIN, house=house, docker_tree="1", labels={}) for s in (spec, SPEC)]
    assert docs[0]["image"]["env"] == CACHE_ENV and docs[0]["image"]["volumes"] == ["/var/cache/torch-compile"]
    assert set(docs[1]["image"]) == {"name", "python", "prefix"}


def test_a_missing_digest_does_not_block_other_tasks() -> None:
    lock = parse_lock(lock_doc(image={"base": "lmsysorg/sglang:latest"}), path=Path("sources.lock"), check_files=False)
    assert lock.image is not None and lock.image.digest == "" and not lock.unpinned


# --------------------------------------------------------------------------- settings


def test_base_setting_takes_an_image_id_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REPRO_BASE", raising=False)
    assert load_settings({"base": "sha256:" + "a" * 64}).base == "sha256:" + "a" * 64
    assert load_settings({"base": "0123456789ab"}).base == "0123456789ab"
    with pytest.raises(ReproError, match="give a local image by ID"):
        load_settings({"base": "debian:12"})
    monkeypatch.setenv("REPRO_BASE", "debian")
    with pytest.raises(ReproError, match="give a local image by ID"):
        load_settings({})
    monkeypatch.delenv("REPRO_BASE")
    with pytest.raises(ReproError, match="use 'host', 'lock'"):
        load_settings({"builder": "gcc:14"})


# --------------------------------------------------------------------------- labels, key, wheelhouse


def wheelhouse(root: Path, *, content: bytes = b"wheel bytes") -> Wheelhouse:
    root.mkdir(parents=True, exist_ok=True)
    (root / "p-1.0-py3-none-any.whl").write_bytes(content)
    sha = hashlib.sha256(content).hexdigest()
    requirements = f"p==1.0 --hash=sha256:{sha}\n"
    (root / "requirements.txt").write_text(requirements)
    manifest = {
        "lock_sha256": "d" * 64,
        "profile": "default",
        "wheels": [
            {
                "package": "p",
                "filename": "p-1.0-py3-none-any.whl",
                "sha256": sha,
                "sources": [
                    {
                        "name": "s",
                        "kind": "git",
                        "url": "https://example.invalid/s.git",
                        "commit": "a" * 40,
                        "tree_sha256": "e" * 64,
                        "submodules": {"third_party/x": "f" * 40},
                    },
                    {"name": "t", "kind": "pypi", "project": "t", "version": "1", "filename": "t-1.tar.gz",
                     "sha256": "9" * 64, "tree_sha256": "8" * 64},
                ],
            }
        ],
    }  # fmt: skip
    return Wheelhouse(
        root=root, manifest=manifest, requirements_sha256=hashlib.sha256(requirements.encode()).hexdigest()
    )


SPEC = ImageSpec(base="nvcr.io/nvidia/pytorch:25.09-py3", digest=DIGEST, docker_dir=Path("docker"))
PIN = BasePin(lookup=f"nvcr.io/nvidia/pytorch@{DIGEST}", pin={"ref": SPEC.base, "digest": DIGEST}, description="")


def key_of(house: Wheelhouse, *, docker_tree: str = "1" * 64, base: BasePin = PIN) -> str:
    labels = image_labels(
        spec=SPEC, base=base, lock_sha256="d" * 64, profile="default", house=house, docker_tree=docker_tree
    )
    doc = key_document(spec=SPEC, base=base, house=house, docker_tree=docker_tree, labels=labels)
    return hashlib.sha256(canonical_json(doc)).hexdigest()


def test_labels_name_lock_wheels_sources_and_base(tmp_path: Path) -> None:
    house = wheelhouse(tmp_path / "w")
    labels = image_labels(spec=SPEC, base=PIN, lock_sha256="d" * 64, profile="default", house=house, docker_tree="1")
    assert labels["org.reprostack.lock.sha256"] == "d" * 64
    assert labels["org.reprostack.wheel.p.sha256"] == house.wheels[0]["sha256"]
    assert labels["org.reprostack.source.s.commit"] == "a" * 40
    assert labels["org.reprostack.source.s.submodule.third-party-x"] == "f" * 40
    assert labels["org.reprostack.source.t.sha256"] == "9" * 64
    assert labels["org.opencontainers.image.base.digest"] == DIGEST
    assert labels["org.opencontainers.image.base.name"] == SPEC.base


def test_the_key_follows_every_input(tmp_path: Path) -> None:
    house = wheelhouse(tmp_path / "a")
    key = key_of(house)
    assert key == key_of(wheelhouse(tmp_path / "b"))  # same content elsewhere: same key
    assert key != key_of(wheelhouse(tmp_path / "c", content=b"other wheel"))
    assert key != key_of(house, docker_tree="2" * 64)
    other_base = BasePin(lookup="sha256:" + "7" * 64, pin={"id": "sha256:" + "7" * 64}, description="")
    assert key != key_of(house, base=other_base)


def test_wheelhouse_problems_name_each_mismatch(tmp_path: Path) -> None:
    house = wheelhouse(tmp_path / "w")
    requirements = (tmp_path / "w" / "requirements.txt").read_text()
    ok = wheelhouse_problems(house, lock_sha256="d" * 64, profile="default", packages=["p"], requirements=requirements)
    assert ok == []
    (tmp_path / "w" / "p-1.0-py3-none-any.whl").write_bytes(b"wheel bytez")
    problems = wheelhouse_problems(
        house, lock_sha256="0" * 64, profile="quick", packages=["p", "q"], requirements="p==1.0\n"
    )
    text = "\n".join(problems)
    assert "written for a lock with sha256 dddddddddddd…, the lock's sha256 is now 000000000000…" in text
    assert "manifest.json is for profile 'default', not 'quick'" in text
    assert "missing ['q']" in text
    assert "p-1.0-py3-none-any.whl: sha256 differs from manifest.json" in text
    assert "requirements.txt does not pin its sha256" in text


# --------------------------------------------------------------------------- failing steps

# Trimmed from a real run of the install container on a wheelhouse whose requirements.txt was altered.
INSTALL_OUTPUT = """\
$ /usr/bin/docker start --attach reprostack-install-49ba17d68efd-20630
reprostack: step check the base's python (python3)
python 3.11.2 /usr/bin/python3
reprostack: step create the venv /opt/reprostack
reprostack: step pip install --no-index --require-hashes -r requirements.txt
Looking in links: /reprostack/wheels
ERROR: THESE PACKAGES DO NOT MATCH THE HASHES FROM THE REQUIREMENTS FILE.
"""


def test_the_failing_install_step_is_the_last_one_started() -> None:
    assert failed_install_step(INSTALL_OUTPUT) == "pip install --no-index --require-hashes -r requirements.txt"
    assert failed_install_step("Error response from daemon: No such image\n") == ""


# --------------------------------------------------------------------------- builder containers


def test_the_builder_enters_the_action_key_and_host_keys_stay_as_they_were() -> None:
    pkg = Package(name="p", source="s")
    sources = {"s": Source(name="s", kind="url", tree_sha256="e" * 64)}
    common: dict[str, Any] = {
        "sources": sources, "patches": [], "toolchain": {"cxx": "g++ 12"}, "archs": ["sm_90a"], "build_requires": {}
    }  # fmt: skip
    host = action_key_document(pkg, **common)
    assert "builder" not in host  # host builds keep the keys they had before builders existed
    a = action_key_document(pkg, builder={"image": "ghcr.io/x/builder:1", "digest": DIGEST}, **common)
    b = action_key_document(pkg, builder={"image": "ghcr.io/x/builder:1", "digest": "sha256:" + "d" * 64}, **common)
    assert len({action_key(host), action_key(a), action_key(b)}) == 3


def test_builds_run_at_fixed_paths_with_only_the_recipe_environment() -> None:
    builder = Builder(image_id="sha256:" + "1" * 64, python="python3")
    stage, out = Path("/home/u/proj/build/stage/pkg-abc"), Path("/home/u/.cache/reprostack/tmp/out-pkg.x1")
    cmd = ["/venv/bin/python", "-m", "pip", "wheel", "-w", f"{out}/raw", f"{stage}/hopper"]
    env = build_env({"CUDA_HOME": "/usr/local/cuda"}, ["MAX_JOBS"], 6)
    args = run_arguments(
        builder, cmd, mounts={stage: "/reprostack/src", out: "/reprostack/out"}, workdir=stage / "hopper", env=env,
        user="1000:1000",
    )  # fmt: skip
    assert args[:6] == ["run", "--rm", "--network", "none", "--user", "1000:1000"]
    assert f"type=bind,source={stage},target=/reprostack/src" in args
    assert args[args.index("--workdir") + 1] == "/reprostack/src/hopper"
    tail = args[args.index(builder.image_id) :]
    assert tail == [
        builder.image_id,
        "python3",
        "-m",
        "pip",
        "wheel",
        "-w",
        "/reprostack/out/raw",
        "/reprostack/src/hopper",
    ]
    envs = {args[i + 1].split("=", 1)[0] for i, a in enumerate(args) if a == "--env"}
    assert envs == {"CUDA_HOME", "MAX_JOBS", *BUILD_ENV}  # nothing of the host's environment
    assert "MAX_JOBS=6" in args
