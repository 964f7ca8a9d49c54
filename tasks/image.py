"""Stage 5: the runtime image, the base pinned by digest plus the wheelhouse.

``doit image`` builds ``docker/Dockerfile`` (the lock's ``[image] docker_dir``)
on the base the lock pins by digest, or on a local image named by ID with
``base=``. The wheels are installed offline (``--network none``, ``pip
install --no-index --require-hashes`` from the wheelhouse's requirements.txt)
into a venv at ``[image] prefix``. The image is tagged by content,
``<name>:<key[:12]>``, where the key is the sha256 of everything that goes in:
the base pin, the lock's hash and profile, every wheel's sha256, the
requirements file, the tree hash of docker_dir, the image settings and the
labels. Its labels name the lock's hash, every wheel's sha256 and every
source pin (commit or archive sha256), so ``docker inspect`` says what the
image holds.

Pure parts (labels, key document, wheelhouse checks) take plain values;
the docker calls are in :mod:`tasks.docker`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from tasks import docker
from tasks.cache import rmtree
from tasks.context import Context
from tasks.errors import ImageError, ReproError
from tasks.imageref import label_key, parse_reference, short_id
from tasks.keys import canonical_json
from tasks.lockfile import ImageSpec
from tasks.treehash import file_sha256, tree_sha256

#: Bump when what an image holds changes for the same inputs (Dockerfile contract, labels).
IMAGE_FORMAT = 1
KEY_LABEL = "org.reprostack.image.key"
OCI = "org.opencontainers.image"


# --------------------------------------------------------------------------- the plan (pure)


@dataclass(frozen=True, kw_only=True)
class BasePin:
    """Which base an image is built on, and how docker finds it locally."""

    lookup: str  # what `docker image inspect` resolves: name@sha256:... or an image ID
    pin: Mapping[str, str]  # what enters the key
    description: str


@dataclass(frozen=True, kw_only=True)
class Wheelhouse:
    root: Path
    manifest: Mapping[str, Any]
    requirements_sha256: str

    @property
    def wheels(self) -> list[Mapping[str, Any]]:
        return sorted(self.manifest.get("wheels", []), key=lambda w: str(w["package"]))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything `doit image` builds from, and what it will call the result."""

    spec: ImageSpec
    base: BasePin
    key: str
    labels: Mapping[str, str]
    document: Mapping[str, Any] = field(repr=False)

    @property
    def tag(self) -> str:
        return f"{self.spec.name}:{self.key[:12]}"

    @property
    def build_args(self) -> dict[str, str]:
        return {"PYTHON": self.spec.python, "PREFIX": self.spec.prefix}


def image_labels(
    *,
    spec: ImageSpec,
    base: BasePin,
    lock_sha256: str,
    profile: str,
    house: Wheelhouse,
    docker_tree: str,
) -> dict[str, str]:
    """The labels of the image: lock hash, every wheel's sha256, every source's pin."""
    labels = {
        f"{OCI}.title": spec.name,
        f"{OCI}.description": "reprostack runtime image: pinned base plus the lock's wheelhouse",
        label_key("lock", "sha256"): lock_sha256,
        label_key("lock", "profile"): profile,
        label_key("prefix"): spec.prefix,
        label_key("docker", "tree-sha256"): docker_tree,
    }
    if "digest" in base.pin:
        labels[f"{OCI}.base.name"] = base.pin["ref"]
        labels[f"{OCI}.base.digest"] = base.pin["digest"]
    else:
        labels[label_key("base", "id")] = base.pin["id"]
    for wheel in house.wheels:
        pkg = str(wheel["package"])
        labels[label_key("wheel", pkg, "filename")] = str(wheel["filename"])
        labels[label_key("wheel", pkg, "sha256")] = str(wheel["sha256"])
        for src in wheel.get("sources", []):
            labels.update(source_labels(src))
    return labels


def source_labels(pin: Mapping[str, Any]) -> dict[str, str]:
    """``org.reprostack.source.<name>.*`` for one source pin of the manifest."""
    name = str(pin["name"])
    out = {label_key("source", name, "tree-sha256"): str(pin.get("tree_sha256", ""))}
    if pin.get("kind") == "git":
        out[label_key("source", name, "url")] = str(pin.get("url", ""))
        out[label_key("source", name, "commit")] = str(pin.get("commit", ""))
        for path, commit in sorted((pin.get("submodules") or {}).items()):
            out[label_key("source", name, "submodule", path)] = str(commit)
    else:
        origin = pin.get("url") or f"{pin.get('project')}=={pin.get('version')} ({pin.get('filename')})"
        out[label_key("source", name, "archive")] = str(origin)
        out[label_key("source", name, "sha256")] = str(pin.get("sha256", ""))
    return out


def key_document(
    *, spec: ImageSpec, base: BasePin, house: Wheelhouse, docker_tree: str, labels: Mapping[str, str]
) -> dict[str, Any]:
    return {
        "image_format": IMAGE_FORMAT,
        "base": dict(base.pin),
        "wheels": [{"filename": w["filename"], "sha256": w["sha256"]} for w in house.wheels],
        "requirements_sha256": house.requirements_sha256,
        "docker_tree_sha256": docker_tree,
        "image": {"name": spec.name, "python": spec.python, "prefix": spec.prefix},
        "labels": dict(sorted(labels.items())),
    }


def wheelhouse_problems(
    house: Wheelhouse,
    *,
    lock_sha256: str,
    profile: str,
    packages: Sequence[str],
    requirements: str,
    hash_files: bool = True,
) -> list[str]:
    """Why ``house`` is not the wheelhouse of this lock and profile (empty: it is)."""
    doc = house.manifest
    problems = []
    if doc.get("lock_sha256") != lock_sha256:
        problems.append(
            f"manifest.json was written for a lock with sha256 {str(doc.get('lock_sha256'))[:12]}…, "
            f"the lock's sha256 is now {lock_sha256[:12]}…"
        )
    if doc.get("profile") != profile:
        problems.append(f"manifest.json is for profile {doc.get('profile')!r}, not {profile!r}")
    have = {str(w["package"]) for w in house.wheels}
    if have != set(packages):
        missing, extra = sorted(set(packages) - have), sorted(have - set(packages))
        problems.append(f"packages differ from the lock's: missing {missing or 'none'}, extra {extra or 'none'}")
    pinned = _requirement_hashes(requirements)
    for w in house.wheels:
        name, sha = str(w["filename"]), str(w["sha256"])
        path = house.root / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif hash_files and file_sha256(path) != sha:
            problems.append(f"{name}: sha256 differs from manifest.json (the file was changed after `doit wheels`)")
        if sha not in pinned:
            problems.append(f"{name}: requirements.txt does not pin its sha256")
    return problems


def _requirement_hashes(text: str) -> set[str]:
    return {part.split(":", 1)[1] for part in text.split() if part.startswith("--hash=sha256:")}


# --------------------------------------------------------------------------- reading the inputs


def image_spec(ctx: Context) -> ImageSpec:
    spec = ctx.lock.image
    if spec is None:
        raise ImageError(
            f"{ctx.lock.path} has no [image] table. Add one naming the base, for example\n"
            '  [image]\n  base = "nvcr.io/nvidia/pytorch:25.09-py3"\n'
            "then run `doit lock` to pin its digest (or give a local image with base=<image ID>)."
        )
    return spec


def load_wheelhouse(root: Path) -> Wheelhouse:
    try:
        manifest = json.loads((root / "manifest.json").read_text())
        requirements = (root / "requirements.txt").read_bytes()
    except FileNotFoundError as exc:
        raise ImageError(f"{exc.filename} does not exist: build the wheelhouse first (`doit wheels`)") from None
    except ValueError as exc:
        raise ImageError(f"{root / 'manifest.json'} is not valid JSON ({exc}): rebuild it with `doit wheels`") from None
    return Wheelhouse(root=root, manifest=manifest, requirements_sha256=hashlib.sha256(requirements).hexdigest())


def base_pin(ctx: Context, spec: ImageSpec) -> BasePin:
    """The base: ``base=<image ID>`` when given, else the lock's reference and digest."""
    if ctx.settings.base:
        full = resolve_image_id(ctx.settings.base, setting="base")
        return BasePin(lookup=full, pin={"id": full}, description=f"local image {short_id(full)} (base=)")
    ref = parse_reference(spec.base)
    if not spec.digest:
        raise ImageError(
            f"{ctx.lock.path}: [image] base {spec.base!r} has no digest, and `doit image` builds only on a pinned "
            "base. Run `doit lock` where the registry is reachable (it records the digest), or name a local image "
            "by ID: `doit image base=<image ID>` (`docker image inspect --format '{{.Id}}' IMAGE`)."
        )
    return BasePin(
        lookup=ref.pinned(spec.digest),
        pin={"ref": spec.base, "digest": spec.digest},
        description=f"{spec.base}@{spec.digest[:19]}…",
    )


def resolve_image_id(image_id: str, *, setting: str) -> str:
    """The full ID of a local image named by (a prefix of) its ID."""
    digits = image_id.removeprefix("sha256:")
    if len(digits) == 64:
        return f"sha256:{digits}"
    info = docker.inspect_image(digits)
    if info is None:
        raise ImageError(f"{setting}={image_id}: no image with this ID in the local docker daemon (`docker images`)")
    return str(info["Id"])


def make_plan(ctx: Context) -> Plan:
    """The plan of the current lock, profile, wheelhouse, docker_dir and base (no hashing of wheels)."""
    spec = image_spec(ctx)
    base = base_pin(ctx, spec)
    house = load_wheelhouse(ctx.settings.wheels)
    if not spec.docker_dir.is_dir():
        raise ImageError(f"[image] docker_dir {spec.docker_dir} is not a directory (it holds the Dockerfile)")
    docker_tree = tree_sha256(spec.docker_dir)
    labels = image_labels(
        spec=spec,
        base=base,
        lock_sha256=ctx.lock.sha256,
        profile=ctx.settings.profile,
        house=house,
        docker_tree=docker_tree,
    )
    doc = key_document(spec=spec, base=base, house=house, docker_tree=docker_tree, labels=labels)
    key = hashlib.sha256(canonical_json(doc)).hexdigest()
    return Plan(spec=spec, base=base, key=key, labels={**labels, KEY_LABEL: key}, document=doc)


# --------------------------------------------------------------------------- docker


def current_image(plan: Plan) -> dict[str, Any] | None:
    """The built image of ``plan``, if the daemon has it under its tag with its key."""
    info = docker.inspect_image(plan.tag)
    if info is None or docker.image_labels(info).get(KEY_LABEL) != plan.key:
        return None
    return info


class ImageCurrent:
    """Up to date when the daemon holds ``<name>:<key12>`` labelled with the current image key."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def __call__(self, task: Any, values: Any) -> bool:
        try:
            return current_image(make_plan(self.ctx)) is not None
        except (ReproError, OSError, ValueError, KeyError):  # no docker, wheelhouse, digest: the action says why
            return False

    def __repr__(self) -> str:
        return "ImageCurrent(docker has <name>:<key12> for the lock, wheelhouse, docker_dir and base)"


def check_wheelhouse(ctx: Context, house: Wheelhouse) -> None:
    """Refuse a wheelhouse that is not the one of this lock and profile, or whose files changed."""
    problems = wheelhouse_problems(
        house,
        lock_sha256=ctx.lock.sha256,
        profile=ctx.settings.profile,
        packages=[p.name for p in ctx.packages],
        requirements=(house.root / "requirements.txt").read_text(),
    )
    if problems:
        raise ImageError(
            f"the wheelhouse {house.root} does not match {ctx.lock.path} (profile {ctx.settings.profile}):\n  - "
            + "\n  - ".join(problems)
            + "\nRebuild it with `doit wheels` (same lock= and profile=), then rerun `doit image`."
        )


def local_base(plan: Plan) -> dict[str, Any]:
    """The base image in the local daemon; a clear error when it is not there."""
    info = docker.inspect_image(plan.base.lookup)
    if info is not None:
        return info
    if "digest" in plan.base.pin:
        ref = parse_reference(plan.base.pin["ref"])
        raise ImageError(
            f"the base {plan.base.pin['ref']} at {plan.base.pin['digest']} is not in the local docker daemon. "
            f"Pull it where its registry is reachable: `docker pull {ref.pinned(plan.base.pin['digest'])}` "
            "(an image moved with docker save/load keeps no digest: build on it with base=<image ID>), "
            "or build on a local image: `doit image base=<image ID>`."
        )
    raise ImageError(f"base={plan.base.pin['id']}: no such image in the local docker daemon (`docker images`)")


def _stage_context(plan: Plan, house: Wheelhouse, dest: Path) -> None:
    """The build context: docker_dir's files, plus wheels/ with the wheels and requirements.txt."""
    rmtree(dest)
    shutil.copytree(plan.spec.docker_dir, dest, symlinks=True)
    wheels = dest / "wheels"
    if wheels.exists():
        raise ImageError(f"{plan.spec.docker_dir} must not contain 'wheels': the build puts the wheelhouse there")
    wheels.mkdir()
    for name in [str(w["filename"]) for w in house.wheels] + ["requirements.txt"]:
        src, dst = house.root / name, wheels / name
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)


def build_image(ctx: Context) -> Plan:
    """Build the runtime image of the current plan, or reuse it; return the plan."""
    docker.check_daemon()
    plan = make_plan(ctx)
    house = load_wheelhouse(ctx.settings.wheels)
    check_wheelhouse(ctx, house)
    base = local_base(plan)
    if current_image(plan) is not None:
        print(f"image {plan.tag} is up to date", flush=True)
        return plan
    build_dir = ctx.settings.builddir.absolute()
    build_dir.mkdir(parents=True, exist_ok=True)
    log = (ctx.settings.logs / "image.log").absolute()
    context_dir = build_dir / "image" / f"context-{plan.key[:12]}"
    with FileLock(str(build_dir / "image.lock")):
        _stage_context(plan, house, context_dir)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"# doit image: {plan.tag}\n# key document: {json.dumps(plan.document, sort_keys=True)}\n")
        print(f"image {plan.tag} on {plan.base.description} ({len(house.wheels)} wheels), log: {log}", flush=True)
        try:
            docker.build(
                context_dir,
                tag=plan.tag,
                build_args={"BASE": docker.pin_tag(str(base["Id"])), **plan.build_args},
                labels=plan.labels,
                log=log,
            )
        finally:
            rmtree(context_dir)
    built = current_image(plan)
    if built is None:
        raise ImageError(f"docker build reported success but {plan.tag} does not carry key {plan.key}; see {log}")
    print(
        f"built image {plan.tag} (id {short_id(str(built['Id']))}, {int(built.get('Size', 0)) / 1e6:.0f} MB, "
        f"{len(plan.labels)} labels)",
        flush=True,
    )
    return plan


def require_image(ctx: Context) -> tuple[Plan, dict[str, Any]]:
    """The current image, which `doit image` must have built."""
    docker.check_daemon()
    plan = make_plan(ctx)
    info = current_image(plan)
    if info is None:
        raise ImageError(f"image {plan.tag} does not exist: build it with `doit image` (same lock=, profile=, base=)")
    return plan, info
