"""`doit export`: the runtime image as files, for clusters without a registry.

Under ``export=`` (default ``build/export``), for image ``<name>:<key12>``::

    <name>-<key12>.docker.tar   docker-archive, from `docker save` (docker load, podman load,
                                apptainer build ... docker-archive://)
    <name>-<key12>.oci/         OCI image layout, converted from the archive by skopeo
                                (podman, skopeo, apptainer build ... oci://, umoci, registries)
    <name>-<key12>.json         what was exported: tag, image ID, image key, and each file's sha256
    SHA256SUMS                  `sha256sum -c` input for the archive and every file of the layout

skopeo (the containers project's image copier, in Debian and every major
distribution) converts between docker-archive, OCI layouts, oci-archive and
registries without a daemon, and checks every blob against its digest while
it copies; the OCI layout's manifest digest is printed and recorded. Both
outputs appear atomically (written under a temporary name, then renamed), so
an interrupted export leaves nothing that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from tasks.core import proc
from tasks.core.errors import ImageError
from tasks.core.fsutil import rmtree, write_atomic
from tasks.core.treehash import file_sha256
from tasks.env import docker
from tasks.image.image import ImagePlan, make_plan, require_image
from tasks.stages.context import Context

SKOPEO_HINT = "install skopeo (Debian/Ubuntu: `sudo apt-get install skopeo`; Fedora/RHEL: `dnf install skopeo`)"


def stem(plan: ImagePlan) -> str:
    return f"{plan.spec.name.replace('/', '_')}-{plan.key[:12]}"


def record_path(ctx: Context, plan: ImagePlan) -> Path:
    return ctx.settings.export_dir / f"{stem(plan)}.json"


def is_current(ctx: Context, plan: ImagePlan) -> bool:
    """The export of this plan exists: its record names the key, and the files have the recorded sizes."""
    try:
        record = json.loads(record_path(ctx, plan).read_text())
    except (OSError, ValueError):
        return False
    if record.get("image_key") != plan.key:
        return False
    out = ctx.settings.export_dir
    return all((out / f["path"]).is_file() and (out / f["path"]).stat().st_size == f["size"] for f in record["files"])


class ExportCurrent:
    """Up to date when the export directory holds the current image's archive and layout."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def __call__(self, task: Any, values: Any) -> bool:
        try:
            return is_current(self.ctx, make_plan(self.ctx))
        except (ImageError, OSError, ValueError):
            return False

    def __repr__(self) -> str:
        return "ExportCurrent(export dir has <name>-<key12>.docker.tar and .oci/ for the current image key)"


def skopeo_bin() -> str:
    found = shutil.which("skopeo")
    if found is None:
        raise ImageError(f"doit export needs skopeo to write the OCI layout: {SKOPEO_HINT}")
    return found


def export_image(ctx: Context) -> dict[str, Any]:
    plan, info = require_image(ctx)
    skopeo = skopeo_bin()
    out = ctx.settings.export_dir.absolute()
    out.mkdir(parents=True, exist_ok=True)
    name = stem(plan)
    log = (ctx.settings.logs / "export.log").absolute()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(f"# doit export: {plan.tag} ({info['Id']})\n")
    archive, layout = out / f"{name}.docker.tar", out / f"{name}.oci"
    tmp_archive, tmp_layout = out / f".{name}.docker.tar.tmp", out / f".{name}.oci.tmp"
    print(f"export {plan.tag} to {out}, log: {log}", flush=True)
    try:
        tmp_archive.unlink(missing_ok=True)
        proc.run(
            [docker.docker_bin(), "image", "save", "--output", str(tmp_archive), plan.tag],
            env=docker.client_env(),
            log=log,
            error=ImageError,
            what=f"docker image save {plan.tag}",
        )
        rmtree(tmp_layout)
        proc.run(
            [
                skopeo,
                "--insecure-policy",  # a local file to a local directory: no signature policy applies
                "copy",
                f"docker-archive:{tmp_archive}:{plan.tag}",
                f"oci:{tmp_layout}:{plan.tag}",
            ],
            env=dict(os.environ),
            log=log,
            error=ImageError,
            what="skopeo copy docker-archive -> oci",
        )
        os.chmod(tmp_archive, 0o644)  # docker writes it 0600
        os.replace(tmp_archive, archive)
        rmtree(layout)
        os.replace(tmp_layout, layout)
    finally:
        tmp_archive.unlink(missing_ok=True)
        rmtree(tmp_layout)
    files = [archive, *sorted(p for p in layout.rglob("*") if p.is_file())]
    sums = [{"path": p.relative_to(out).as_posix(), "sha256": file_sha256(p), "size": p.stat().st_size} for p in files]
    index = json.loads((layout / "index.json").read_text())
    manifest_digest = str(index["manifests"][0]["digest"])
    record = {
        "format": 1,
        "tag": plan.tag,
        "image_id": info["Id"],
        "image_key": plan.key,
        "docker_archive": {"path": archive.name, "sha256": sums[0]["sha256"], "size": sums[0]["size"]},
        "oci_layout": {"path": layout.name, "manifest_digest": manifest_digest, "ref": plan.tag},
        "files": sums,
    }
    write_atomic(out / "SHA256SUMS", _merge_sums(out / "SHA256SUMS", sums, prefix=name))
    write_atomic(record_path(ctx, plan), json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"  {archive.name}  sha256:{record['docker_archive']['sha256']}", flush=True)
    print(f"  {layout.name}/  manifest {manifest_digest}", flush=True)
    print(
        f"  checksums of every file: {out / 'SHA256SUMS'} (sha256sum -c), record: {record_path(ctx, plan)}", flush=True
    )
    return record


def _merge_sums(path: Path, sums: list[dict[str, Any]], *, prefix: str) -> str:
    """SHA256SUMS with this export's lines replacing earlier lines of the same image."""
    try:
        kept = [ln for ln in path.read_text().splitlines() if ln and not ln.split("  ", 1)[-1].startswith(prefix)]
    except FileNotFoundError:
        kept = []
    lines = kept + [f"{s['sha256']}  {s['path']}" for s in sums]
    return "\n".join(lines) + "\n"
