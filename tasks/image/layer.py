"""The runtime image's own layer, config and docker-archive, written so equal inputs give equal digests.

docker 20.10's builder stamps the time of the build into what it makes: the
config's ``created`` and history, every file's mtime in the layer (and the
mtime of the layer's parent directory). So ``doit image`` lets docker do only
the install (``docker/install-wheels.sh`` in a container of the base, no
network) and writes the rest here, from the venv as ``docker cp
CONTAINER:PREFIX -`` streams it:

- :func:`normalize_layer`: the layer tar. Entries sorted by name (UTF-8
  bytes), the parent directories of PREFIX added (mode 0755), every mtime the
  epoch, owner 0:0 without names, modes as installed, PAX format without
  xattrs, atimes or ctimes; a group of hard links becomes one file under the
  group's first name and links to it; symlinks are kept as they are. The
  sha256 of the tar is the layer's diff_id.
- :func:`image_config`: the base's config (``docker image inspect``, and its
  history from ``docker image history``) plus the venv's ``VIRTUAL_ENV`` and
  ``PATH``, the lock's ``[image] env`` and ``volumes``, the labels, the new
  diff_id and one history entry; ``created`` is
  the epoch. Serialised canonically (:func:`config_bytes`), its sha256 is the
  image ID.
- :func:`write_docker_archive`: ``manifest.json``, the config and the new layer
  for ``docker load``. The base's layers are named in the manifest but not
  written: ``docker load`` reads a layer file only when the layer store lacks
  its chain ID, and the base is in the daemon (``doit image`` checks it).

Pure: files and values in, files and values out; no docker here.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tasks.core.treehash import file_sha256

#: What docker puts on PATH when an image sets none.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

#: The keys of the base's container config that an image built on it inherits, as `docker build` has them
#: (not OnBuild: docker runs a base's ONBUILD triggers instead of inheriting them; doit image refuses such a base).
CONFIG_KEYS = (
    "User",
    "ExposedPorts",
    "Env",
    "Entrypoint",
    "Cmd",
    "Volumes",
    "WorkingDir",
    "Labels",
    "StopSignal",
    "ArgsEscaped",
    "Healthcheck",
    "Shell",
)

_KINDS = {
    tarfile.DIRTYPE,
    tarfile.SYMTYPE,
    tarfile.LNKTYPE,
    tarfile.CHRTYPE,
    tarfile.BLKTYPE,
    tarfile.FIFOTYPE,
}


def rfc3339(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------- the layer


def normalize_layer(raw: Path, dest: Path, *, prefix: str, epoch: int) -> str:
    """Write ``raw`` (a tar of PREFIX's directory) as the image layer ``dest``; return its diff_id.

    ``raw``'s names start with PREFIX's last component (``reprostack/...``, as
    ``docker cp`` writes them); in the layer they start with PREFIX without its
    leading slash (``opt/reprostack/...``).
    """
    root = prefix.strip("/")
    if not root:
        raise ValueError(f"prefix {prefix!r} names no directory")
    with tarfile.open(raw, "r:", encoding="utf-8") as src:
        members = src.getmembers()
        if not members:
            raise ValueError(f"{raw} is empty: the container has nothing at {prefix}")
        top = members[0].name.split("/", 1)[0]
        by_name: dict[str, tarfile.TarInfo] = {}
        for member in members:
            by_name[_rename(member.name, top, root)] = member
        links = _hard_link_groups(by_name, top, root)
        parents = [root.rsplit("/", n)[0] for n in range(root.count("/"), 0, -1)]
        tmp = dest.with_name(f".{dest.name}.tmp")
        try:
            with tmp.open("wb") as fh, _writer(fh) as out:
                for name in parents:
                    out.addfile(_entry(name, tarfile.DIRTYPE, 0o755, epoch))
                for name in sorted(by_name, key=lambda n: n.encode()):
                    member = by_name[name]
                    if name in links:  # one name of a group of hard links
                        first, holder = links[name]
                        if name != first:
                            info = _entry(name, tarfile.LNKTYPE, holder.mode, epoch)
                            info.linkname = first
                            out.addfile(info)
                            continue
                        member = holder
                    _copy(src, member, name, out, epoch)
            tmp.replace(dest)
        finally:
            tmp.unlink(missing_ok=True)
    return f"sha256:{file_sha256(dest)}"


def _rename(name: str, top: str, root: str) -> str:
    if name != top and not name.startswith(top + "/"):
        raise ValueError(f"tar member {name!r} is outside {top}/: expected one directory's tar")
    return root + name[len(top) :]


def _hard_link_groups(
    by_name: Mapping[str, tarfile.TarInfo], top: str, root: str
) -> dict[str, tuple[str, tarfile.TarInfo]]:
    """name -> (the group's first name, the member holding the data), for every hard-linked name."""
    groups: dict[str, list[str]] = {}
    for name, member in by_name.items():
        if member.islnk():
            target = _rename(member.linkname, top, root)
            if target not in by_name or by_name[target].islnk():
                raise ValueError(f"hard link {name} -> {target}: the target is not a file of the tar")
            groups.setdefault(target, [target]).append(name)
    out: dict[str, tuple[str, tarfile.TarInfo]] = {}
    for target, names in groups.items():
        first = min(names, key=lambda n: n.encode())
        for name in names:
            out[name] = (first, by_name[target])
    return out


def _writer(fh: io.BufferedWriter) -> tarfile.TarFile:
    return tarfile.open(fileobj=fh, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8")


def _entry(name: str, kind: bytes, mode: int, epoch: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode & 0o7777
    info.mtime = epoch
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _copy(src: tarfile.TarFile, member: tarfile.TarInfo, name: str, out: tarfile.TarFile, epoch: int) -> None:
    if member.isreg():
        info = _entry(name, tarfile.REGTYPE, member.mode, epoch)
        info.size = member.size
        out.addfile(info, src.extractfile(member))
        return
    if member.type not in _KINDS:
        raise ValueError(f"{member.name}: tar entry type {member.type!r} is not one a layer may hold")
    info = _entry(name, member.type, member.mode, epoch)
    if member.issym():
        info.linkname = member.linkname
    if member.ischr() or member.isblk():
        info.devmajor, info.devminor = member.devmajor, member.devminor
    out.addfile(info)


# --------------------------------------------------------------------------- the config


def venv_env(base_env: Sequence[str], prefix: str, extra: Mapping[str, str] | None = None) -> list[str]:
    """The base's ``Env`` with ``VIRTUAL_ENV=prefix``, ``prefix/bin`` first on ``PATH``, then ``extra``
    (``[image] env``): each variable in its place where the base sets it, else appended in order."""
    env = list(base_env)
    names = [item.partition("=")[0] for item in env]
    path = next((item.partition("=")[2] for item in env if item.startswith("PATH=")), DEFAULT_PATH)
    for key, value in (("VIRTUAL_ENV", prefix), ("PATH", f"{prefix}/bin:{path}"), *(extra or {}).items()):
        if key in names:
            env[names.index(key)] = f"{key}={value}"
        else:
            env.append(f"{key}={value}")
            names.append(key)
    return env


def base_history(rows: Sequence[Mapping[str, Any]], layers: int) -> list[dict[str, Any]]:
    """The base's history, oldest first, from ``docker image history --human=false --format '{{json .}}'``.

    ``rows`` are newest first, as docker prints them. The daemon reports a
    history entry's time to the second and its layer's size, not whether it
    made a layer: entries with a size made one; where that accounts for fewer
    than ``layers`` layers (a layer may be empty), the newest zero-size entries
    that are not legacy-builder metadata steps (``#(nop)``) are taken next,
    then any zero-size ones; where there are still fewer entries than layers,
    entries without a time are added before the rest.
    """
    entries: list[dict[str, Any]] = []
    sizes: list[int] = []
    for row in reversed(rows):
        entry: dict[str, Any] = {}
        if row.get("CreatedAt"):
            when = datetime.fromisoformat(str(row["CreatedAt"]).replace("Z", "+00:00")).astimezone(UTC)
            entry["created"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
        if row.get("CreatedBy"):
            entry["created_by"] = str(row["CreatedBy"])
        if row.get("Comment"):
            entry["comment"] = str(row["Comment"])
        entries.append(entry)
        sizes.append(int(row.get("Size") or 0))
    made = [size > 0 for size in sizes]
    missing = layers - sum(made)
    if missing < 0:
        raise ValueError(f"the base's history has {sum(made)} entries with a layer, but the base has {layers} layers")
    for metadata_too in (False, True):
        for i in reversed(range(len(entries))):
            nop = "#(nop)" in entries[i].get("created_by", "")
            if missing and not made[i] and (metadata_too or not nop):
                made[i], missing = True, missing - 1
    for entry, has_layer in zip(entries, made, strict=True):
        if not has_layer:
            entry["empty_layer"] = True
    return [{"comment": "a base layer without a history entry"} for _ in range(missing)] + entries


def image_config(
    *,
    base: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]],
    diff_id: str,
    prefix: str,
    labels: Mapping[str, str],
    created_by: str,
    epoch: int,
    env: Mapping[str, str] | None = None,
    volumes: Sequence[str] = (),
) -> dict[str, Any]:
    """The image config: ``base`` (``docker image inspect``) plus the venv layer, its Env and ``labels``;
    ``env`` and ``volumes`` (``[image] env``, ``volumes``) are set over the base's."""
    base_config = base.get("Config") or {}
    config = {key: base_config[key] for key in CONFIG_KEYS if base_config.get(key)}
    config["Env"] = venv_env(base_config.get("Env") or [], prefix, env)
    config["Labels"] = {**(base_config.get("Labels") or {}), **labels}
    if volumes:
        config["Volumes"] = {**(base_config.get("Volumes") or {}), **{path: {} for path in volumes}}
    doc: dict[str, Any] = {
        "architecture": base["Architecture"],
        "os": base["Os"],
        "created": rfc3339(epoch),
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [*base["RootFS"]["Layers"], diff_id]},
        "history": [*history, {"created": rfc3339(epoch), "created_by": created_by}],
    }
    if base.get("Variant"):
        doc["variant"] = base["Variant"]
    if base.get("Author"):
        doc["author"] = base["Author"]
    return doc


def config_bytes(config: Mapping[str, Any]) -> bytes:
    """The config as docker stores it: canonical JSON (sorted keys, no spaces, UTF-8)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# --------------------------------------------------------------------------- the docker-archive


def write_docker_archive(dest: Path, *, config: bytes, layer: Path, tag: str, epoch: int) -> str:
    """Write the docker-archive of the image ``config`` whose last layer is ``layer``; return the image ID.

    The manifest names one file per diff_id; only the last one (``layer``) is in
    the archive: the others are the base's, already in the daemon.
    """
    doc = json.loads(config)
    diff_ids = [str(d) for d in doc["rootfs"]["diff_ids"]]
    image_id = f"sha256:{hashlib.sha256(config).hexdigest()}"
    config_name = f"{image_id.removeprefix('sha256:')}.json"
    layer_names = [f"{d.removeprefix('sha256:')}/layer.tar" for d in diff_ids]
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": layer_names}], sort_keys=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    try:
        with tmp.open("wb") as fh, _writer(fh) as out:
            for name, data in ((config_name, config), ("manifest.json", manifest.encode())):
                info = _entry(name, tarfile.REGTYPE, 0o644, epoch)
                info.size = len(data)
                out.addfile(info, io.BytesIO(data))
            out.addfile(_entry(layer_names[-1].split("/")[0], tarfile.DIRTYPE, 0o755, epoch))
            info = _entry(layer_names[-1], tarfile.REGTYPE, 0o644, epoch)
            info.size = layer.stat().st_size
            with layer.open("rb") as data_fh:
                out.addfile(info, data_fh)
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return image_id
