"""Stage 5: the runtime image, the base pinned by digest plus the wheelhouse, the same digest every build.

``doit image`` runs ``docker/install-wheels.sh`` (the lock's ``[image]
docker_dir``) in a container of the base the lock pins by digest, or of a
local image named by ID with ``base=``: no network, the docker_dir and the
wheels copied in with ``docker cp``, the wheels installed offline (``pip
install --no-index --require-hashes`` from the wheelhouse's requirements.txt,
or uv's where the base has uv) into a venv at ``[image] prefix``. The venv is copied out as a tar, written as
one layer on the base with the image config by :mod:`tasks.image.layer` (fixed
times, sorted entries, canonical JSON) and ``docker load``-ed: the same
inputs give the same layer diff_id and image ID, on any day and in any
directory. The image is tagged by content, ``<name>:<key[:12]>``, where the
key is the sha256 of everything that goes in: the base pin, the lock's hash
and profile, every wheel's sha256, the requirements file, the tree hash of
docker_dir, the image settings and the labels. Its labels name the lock's
hash, every wheel's sha256 and every source pin (commit or archive sha256), so
``docker inspect`` says what the image holds.

Pure parts (labels, key document, wheelhouse checks) take plain values;
the docker calls are in :mod:`tasks.docker`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from filelock import FileLock

from tasks.core.digest import canonical_json
from tasks.core.errors import ImageError, ReproError
from tasks.core.fsutil import rmtree
from tasks.core.imageref import label_key, parse_reference, short_id
from tasks.core.treehash import file_sha256, tree_sha256
from tasks.env import docker
from tasks.image.layer import base_history, config_bytes, image_config, normalize_layer, write_docker_archive
from tasks.lock.lockfile import ImageSpec
from tasks.stages.context import Context
from tasks.store.manifest import MANIFEST_FILE, load_document
from tasks.store.wheelnorm import DEFAULT_EPOCH

#: Bump when what an image holds changes for the same inputs (install script contract, layer, config, labels).
#: 2: no docker build; the layer and config written by tasks/image/layer.py, the same bytes for the same inputs.
IMAGE_FORMAT = 2
KEY_LABEL = "org.reprostack.image.key"
OCI = "org.opencontainers.image"
#: docker_dir's script that installs the wheelhouse, and where the install container gets docker_dir and wheels/.
INSTALL_SCRIPT = "install-wheels.sh"
STAGE = "/reprostack"
STEP_MARK = "reprostack: step "


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
class ImagePlan:
    """Everything `doit image` builds from, and what it will call the result."""

    spec: ImageSpec
    base: BasePin
    key: str
    labels: Mapping[str, str]
    document: Mapping[str, Any] = field(repr=False)

    @property
    def tag(self) -> str:
        return f"{self.spec.name}:{self.key[:12]}"


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
        "image": {
            "name": spec.name,
            "python": spec.python,
            "prefix": spec.prefix,
            # only where set, so the keys of images without them stay as they were
            **({"env": dict(spec.env)} if spec.env else {}),
            **({"volumes": list(spec.volumes)} if spec.volumes else {}),
        },
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
    have = {str(w["package"]) for w in house.wheels if w.get("origin") != "fetched"}  # the closure's are not packages
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
    if spec.docker_dir == ctx.lock.path.parent / "docker" and not (spec.docker_dir / INSTALL_SCRIPT).is_file():
        own = tool_docker_dir()  # the lock's directory has no docker/: the tool's own (a lock outside the checkout)
        if own is not None:
            return replace(spec, docker_dir=own)
    return spec


def tool_docker_dir() -> Path | None:
    """The tool's own docker_dir: this repository's docker/, installed as the package ``tasks.docker``."""
    here = Path(__file__).resolve().parents[1]  # tasks/
    for candidate in (here / "docker", here.parent / "docker"):  # installed; this checkout
        if (candidate / INSTALL_SCRIPT).is_file():
            return candidate
    return None


def load_wheelhouse(root: Path) -> Wheelhouse:
    try:
        manifest = load_document(root)
        requirements = (root / "requirements.txt").read_bytes()
    except FileNotFoundError as exc:
        raise ImageError(f"{exc.filename} does not exist: build the wheelhouse first (`doit wheels`)") from None
    except ValueError as exc:
        raise ImageError(f"{root / MANIFEST_FILE} is not valid JSON ({exc}): rebuild it with `doit wheels`") from None
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


def make_plan(ctx: Context) -> ImagePlan:
    """The plan of the current lock, profile, wheelhouse, docker_dir and base (no hashing of wheels)."""
    spec = image_spec(ctx)
    base = base_pin(ctx, spec)
    house = load_wheelhouse(ctx.settings.wheels)
    if not (spec.docker_dir / INSTALL_SCRIPT).is_file():
        raise ImageError(
            f"{ctx.lock.path}: [image] docker_dir {spec.docker_dir} has no {INSTALL_SCRIPT} (the script that installs "
            "the wheelhouse); set docker_dir, relative to the lock, to a directory holding it (this repository's "
            'docker/: docker_dir = "../docker" for a lock in recipes/)'
        )
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
    return ImagePlan(spec=spec, base=base, key=key, labels={**labels, KEY_LABEL: key}, document=doc)


# --------------------------------------------------------------------------- docker


def current_image(plan: ImagePlan) -> dict[str, Any] | None:
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
        packages=[p.name for p in ctx.active],
        requirements=(house.root / "requirements.txt").read_text(),
    )
    if problems:
        raise ImageError(
            f"the wheelhouse {house.root} does not match {ctx.lock.path} (profile {ctx.settings.profile}):\n  - "
            + "\n  - ".join(problems)
            + "\nRebuild it with `doit wheels` (same lock= and profile=), then rerun `doit image`."
        )


def local_base(plan: ImagePlan) -> dict[str, Any]:
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


def _stage_context(plan: ImagePlan, house: Wheelhouse, dest: Path) -> None:
    """What the install container gets at /reprostack: docker_dir's files, and wheels/ with the wheelhouse."""
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


def failed_install_step(output: str) -> str:
    """The install script's last ``reprostack: step ...`` in ``output`` (where it stopped), or ''."""
    steps = [line.strip()[len(STEP_MARK) :] for line in output.splitlines() if line.strip().startswith(STEP_MARK)]
    return " ".join(steps[-1].split()) if steps else ""


def _install_venv(plan: ImagePlan, base_id: str, context: Path, raw: Path, log: Path) -> None:
    """Run install-wheels.sh in a container of the base (no network); PREFIX as a tar in ``raw``."""
    name = f"reprostack-install-{plan.key[:12]}-{os.getpid()}"
    command = [f"{STAGE}/{INSTALL_SCRIPT}", plan.spec.python, plan.spec.prefix, f"{STAGE}/wheels"]
    start = log.stat().st_size
    try:
        docker.create_container(
            base_id, command, name=name, entrypoint="/bin/sh", env={"SOURCE_DATE_EPOCH": str(DEFAULT_EPOCH)}
        )
        docker.copy_into(name, context, STAGE)
        try:
            docker.start_attached(name, log=log, what=f"{INSTALL_SCRIPT} in a container of the base")
        except ImageError as exc:
            with log.open("rb") as fh:
                fh.seek(start)
                step = failed_install_step(fh.read().decode("utf-8", "replace"))
            head, _, rest = exc.message.partition("\n")
            where = f" at install step '{step}'" if step else ""
            raise ImageError(f"{head.rstrip('.')}{where}.\n{rest}\nNo image was tagged.") from None
        docker.copy_out(name, plan.spec.prefix, raw, log=log)
    finally:
        docker.remove_container(name)


def plan_config(
    plan: ImagePlan, base: Mapping[str, Any], history: Sequence[Mapping[str, Any]], diff_id: str, wheels: int
) -> bytes:
    """The image config of ``plan`` on ``base`` (``docker image inspect``) whose new layer is ``diff_id``."""
    return config_bytes(
        image_config(
            base=base,
            history=history,
            diff_id=diff_id,
            prefix=plan.spec.prefix,
            labels=plan.labels,
            created_by=f"doit image: {wheels} wheels from the wheelhouse into the venv {plan.spec.prefix}",
            epoch=DEFAULT_EPOCH,
            env=plan.spec.env,
            volumes=plan.spec.volumes,
        )
    )


def _write_image(plan: ImagePlan, base: Mapping[str, Any], raw: Path, work: Path, log: Path, wheels: int) -> str:
    """The layer, config and docker-archive of ``plan`` from the venv tar ``raw``, loaded; return the image ID.

    Each intermediate file is removed once the next one is written, so at most
    two copies of the venv are on disk at a time.
    """
    layer, archive = work / "layer.tar", work / "image.docker.tar"
    try:
        diff_id = normalize_layer(raw, layer, prefix=plan.spec.prefix, epoch=DEFAULT_EPOCH)
        raw.unlink()
        history = base_history(docker.image_history(str(base["Id"])), len(base["RootFS"]["Layers"]))
    except ValueError as exc:
        raise ImageError(f"cannot write the image of {plan.tag}: {exc}; see {log}") from None
    config = plan_config(plan, base, history, diff_id, wheels)
    image_id = write_docker_archive(archive, config=config, layer=layer, tag=plan.tag, epoch=DEFAULT_EPOCH)
    layer.unlink()
    with log.open("a") as fh:
        fh.write(f"# layer diff_id {diff_id}\n# config {config.decode()}\n# image ID {image_id}\n")
    docker.load(archive, log=log)
    return image_id


def build_image(ctx: Context) -> ImagePlan:
    """Build the runtime image of the current plan, or reuse it; return the plan."""
    docker.check_daemon()
    plan = make_plan(ctx)
    house = load_wheelhouse(ctx.settings.wheels)
    check_wheelhouse(ctx, house)
    base = local_base(plan)
    if current_image(plan) is not None:
        print(f"image {plan.tag} is up to date", flush=True)
        return plan
    if (base.get("Config") or {}).get("OnBuild"):
        raise ImageError(
            f"the base {plan.base.description} has ONBUILD triggers ({base['Config']['OnBuild']}), which doit image "
            "does not run: build on a base without them (run the triggers in an image of your own first)"
        )
    build_dir = ctx.settings.builddir.absolute()
    build_dir.mkdir(parents=True, exist_ok=True)
    log = (ctx.settings.logs / "image.log").absolute()
    work = build_dir / "image" / plan.key[:12]
    with FileLock(str(build_dir / "image.lock")):
        rmtree(work)
        work.mkdir(parents=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"# doit image: {plan.tag}\n# key document: {json.dumps(plan.document, sort_keys=True)}\n")
        print(f"image {plan.tag} on {plan.base.description} ({len(house.wheels)} wheels), log: {log}", flush=True)
        try:
            _stage_context(plan, house, work / "context")
            _install_venv(plan, str(base["Id"]), work / "context", work / "venv.tar", log)
            image_id = _write_image(plan, base, work / "venv.tar", work, log, len(house.wheels))
        finally:
            rmtree(work)
    built = current_image(plan)
    if built is None or built["Id"] != image_id:
        raise ImageError(f"docker load reported success but {plan.tag} is not image {image_id}; see {log}")
    layer = built["RootFS"]["Layers"][-1]
    print(
        f"built image {plan.tag} (id {short_id(image_id)}, layer {layer[:19]}…, "
        f"{int(built.get('Size', 0)) / 1e6:.0f} MB, {len(plan.labels)} labels)",
        flush=True,
    )
    return plan


def require_image(ctx: Context) -> tuple[ImagePlan, dict[str, Any]]:
    """The current image, which `doit image` must have built."""
    docker.check_daemon()
    plan = make_plan(ctx)
    info = current_image(plan)
    if info is None:
        raise ImageError(f"image {plan.tag} does not exist: build it with `doit image` (same lock=, profile=, base=)")
    return plan, info
