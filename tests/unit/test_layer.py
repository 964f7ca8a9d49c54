"""The image's own layer, config and docker-archive (tasks/image/layer.py): the same tree gives the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest

from tasks.image.layer import (
    DEFAULT_PATH,
    base_history,
    config_bytes,
    image_config,
    normalize_layer,
    venv_env,
    write_docker_archive,
)

EPOCH = 315532800
LONG = "a-directory-name-long-enough-that-the-path-needs-a-pax-record-" + "x" * 60


def make_tree(root: Path) -> None:
    """A small venv-like tree: files, an executable, symlinks (relative and absolute), hard links, long names."""
    (root / "bin").mkdir(parents=True)
    (root / "lib" / "pkg" / LONG).mkdir(parents=True)
    (root / "lib" / "pkg" / "__init__.py").write_text("X = 1\n")
    (root / "lib" / "pkg" / LONG / "mod.py").write_text("Y = 2\n")
    (root / "lib" / "pkg" / "ünïcode.txt").write_text("ü\n")
    (root / "bin" / "tool").write_text("#!/opt/reprostack/bin/python\n")
    (root / "bin" / "tool").chmod(0o755)
    os.symlink("/usr/bin/python3", root / "bin" / "python3")
    os.symlink("python3", root / "bin" / "python")
    os.symlink("lib", root / "lib64")
    os.link(root / "lib" / "pkg" / "__init__.py", root / "lib" / "pkg" / "copy.py")
    os.link(root / "lib" / "pkg" / "__init__.py", root / "lib" / "a-first.py")


def docker_cp_tar(root: Path, dest: Path, *, reverse: bool, uid: int, mtime: int, fmt: int) -> None:
    """A tar of ``root`` named ``reprostack/...`` the way an unknown tool writes one: its own order and owners."""
    paths = sorted(root.rglob("*"), key=lambda p: p.as_posix(), reverse=reverse)
    with tarfile.open(dest, "w", format=fmt) as tar:
        seen: dict[int, str] = {}
        for path in [root, *paths]:
            name = "reprostack" + ("" if path == root else "/" + path.relative_to(root).as_posix())
            info = tar.gettarinfo(str(path), arcname=name)
            info.uid = info.gid = uid
            info.uname, info.gname = f"user{uid}", f"group{uid}"
            info.mtime = mtime
            if fmt == tarfile.PAX_FORMAT:
                info.pax_headers = {"SCHILY.xattr.user.origin": "test", "atime": "1.5", "ctime": "2.5"}
            if info.isreg() and path.stat().st_nlink > 1:
                inode = path.stat().st_ino
                if inode in seen:  # every later name of the inode: a link to the first one written
                    info.type, info.linkname, info.size = tarfile.LNKTYPE, seen[inode], 0
                else:
                    seen[inode] = name
            if info.isreg():
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
            else:
                tar.addfile(info)


def test_the_same_tree_gives_the_same_layer_bytes(tmp_path: Path) -> None:
    make_tree(tmp_path / "tree")
    docker_cp_tar(
        tmp_path / "tree", tmp_path / "a.tar", reverse=False, uid=0, mtime=1_700_000_000, fmt=tarfile.GNU_FORMAT
    )
    docker_cp_tar(
        tmp_path / "tree", tmp_path / "b.tar", reverse=True, uid=1234, mtime=1_800_000_000, fmt=tarfile.PAX_FORMAT
    )
    assert (tmp_path / "a.tar").read_bytes() != (tmp_path / "b.tar").read_bytes()
    first = normalize_layer(tmp_path / "a.tar", tmp_path / "a.layer", prefix="/opt/reprostack", epoch=EPOCH)
    second = normalize_layer(tmp_path / "b.tar", tmp_path / "b.layer", prefix="/opt/reprostack/", epoch=EPOCH)
    data = (tmp_path / "a.layer").read_bytes()
    assert data == (tmp_path / "b.layer").read_bytes()
    assert first == second == f"sha256:{hashlib.sha256(data).hexdigest()}"
    assert not list(tmp_path.glob(".*.tmp"))

    with tarfile.open(tmp_path / "a.layer") as tar:
        members = tar.getmembers()
        names = [m.name for m in members]
        assert names[:3] == ["opt", "opt/reprostack", "opt/reprostack/bin"]
        assert names[2:] == sorted(names[2:], key=str.encode)
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(EPOCH, 0, 0, "", "")}
        by_name = {m.name: m for m in members}
        assert by_name["opt"].isdir() and by_name["opt"].mode == 0o755
        assert by_name["opt/reprostack/bin/tool"].mode & 0o111
        assert by_name["opt/reprostack/bin/python3"].issym()
        assert by_name["opt/reprostack/bin/python3"].linkname == "/usr/bin/python3"
        assert by_name["opt/reprostack/bin/python"].linkname == "python3"
        assert by_name["opt/reprostack/lib64"].issym()
        # The hard links: the group's first name holds the data, the others link to it, whatever the input said.
        assert by_name["opt/reprostack/lib/a-first.py"].isreg()
        for name in ("opt/reprostack/lib/pkg/__init__.py", "opt/reprostack/lib/pkg/copy.py"):
            assert by_name[name].islnk() and by_name[name].linkname == "opt/reprostack/lib/a-first.py"
        assert "opt/reprostack/lib/pkg/ünïcode.txt" in by_name
        # No pax record but the ones a long or non-ASCII name needs: no xattrs, atimes, ctimes.
        assert {k for m in members for k in m.pax_headers} == {"path"}
        # (tarfile's filters exist from Python 3.11.4 on; Debian bookworm's 3.11.2 has none)
        tar.extractall(tmp_path / "out", **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
    out = tmp_path / "out" / "opt" / "reprostack"
    assert (out / "lib" / "pkg" / LONG / "mod.py").read_text() == "Y = 2\n"
    assert (out / "lib" / "pkg" / "copy.py").stat().st_ino == (out / "lib" / "a-first.py").stat().st_ino


def test_a_tar_of_more_than_one_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t" / "reprostack").mkdir(parents=True)
    (tmp_path / "t" / "other").mkdir()
    with tarfile.open(tmp_path / "raw.tar", "w") as tar:
        tar.add(tmp_path / "t" / "reprostack", arcname="reprostack")
        tar.add(tmp_path / "t" / "other", arcname="other")
    with pytest.raises(ValueError, match="'other' is outside reprostack/"):
        normalize_layer(tmp_path / "raw.tar", tmp_path / "layer.tar", prefix="/opt/reprostack", epoch=EPOCH)
    assert not (tmp_path / "layer.tar").exists() and not list(tmp_path.glob(".*.tmp"))


# --------------------------------------------------------------------------- config

BASE: dict[str, Any] = {
    "Id": "sha256:" + "1" * 64,
    "Architecture": "amd64",
    "Os": "linux",
    "Author": "",
    "Config": {
        "Hostname": "",
        "User": "",
        "AttachStdin": False,
        "Env": ["PATH=/usr/local/nvidia/bin:/usr/bin:/bin", "LANG=C.UTF-8"],
        "Cmd": ["/bin/bash"],
        "Image": "",
        "Volumes": None,
        "WorkingDir": "/workspace",
        "Entrypoint": ["/opt/entrypoint.sh"],
        "Labels": {"maintainer": "base", "org.opencontainers.image.title": "base title"},
        "OnBuild": ["RUN make"],
    },
    "RootFS": {"Type": "layers", "Layers": ["sha256:" + "a" * 64, "sha256:" + "b" * 64]},
}

# `docker image history --no-trunc --human=false --format '{{json .}}'` of a legacy-builder image, newest first.
HISTORY_ROWS = [
    {"CreatedAt": "2026-11-21T15:57:44+01:00", "CreatedBy": "/bin/sh -c #(nop)  LABEL a=b", "Size": "0", "Comment": ""},
    {"CreatedAt": "2026-11-21T14:57:43Z", "CreatedBy": "/bin/sh -c apt-get install g++", "Size": "427862238"},
    {"CreatedAt": "2026-11-21T14:43:07Z", "CreatedBy": "", "Size": "189524450", "Comment": "Imported from -"},
]


def test_the_base_history_is_oldest_first_in_utc_with_its_empty_layers() -> None:
    assert base_history(HISTORY_ROWS, 2) == [
        {"created": "2026-11-21T14:43:07Z", "comment": "Imported from -"},
        {"created": "2026-11-21T14:57:43Z", "created_by": "/bin/sh -c apt-get install g++"},
        {"created": "2026-11-21T14:57:44Z", "created_by": "/bin/sh -c #(nop)  LABEL a=b", "empty_layer": True},
    ]


def test_a_layer_of_size_zero_takes_the_newest_step_that_is_not_metadata() -> None:
    rows = [
        {"CreatedAt": "2026-01-01T00:00:03Z", "CreatedBy": '/bin/sh -c #(nop)  CMD ["sh"]', "Size": "0"},
        {"CreatedAt": "2026-01-01T00:00:02Z", "CreatedBy": "/bin/sh -c true", "Size": "0"},
        {"CreatedAt": "2026-01-01T00:00:01Z", "CreatedBy": "/bin/sh -c #(nop) ADD file:x in /", "Size": "5"},
    ]
    history = base_history(rows, 2)
    assert [e.get("empty_layer", False) for e in history] == [False, False, True]
    # More layers than history entries: entries without a time come first; more sized entries than layers: refused.
    padded = base_history(rows[2:], 3)
    assert padded[:2] == [{"comment": "a base layer without a history entry"}] * 2 and len(padded) == 3
    with pytest.raises(ValueError, match="1 entries with a layer, but the base has 0 layers"):
        base_history(rows, 0)


def test_venv_env_puts_the_venv_first_on_the_bases_path() -> None:
    assert venv_env(["A=1", "PATH=/usr/bin:/bin"], "/opt/v") == [
        "A=1",
        "PATH=/opt/v/bin:/usr/bin:/bin",
        "VIRTUAL_ENV=/opt/v",
    ]
    assert venv_env(["VIRTUAL_ENV=/old"], "/opt/v") == ["VIRTUAL_ENV=/opt/v", f"PATH=/opt/v/bin:{DEFAULT_PATH}"]


def test_the_config_is_the_base_plus_the_venv_at_a_fixed_time() -> None:
    labels = {"org.opencontainers.image.title": "ours", "org.reprostack.image.key": "k"}
    config = image_config(
        base=BASE,
        history=base_history(HISTORY_ROWS, 2),
        diff_id="sha256:" + "c" * 64,
        prefix="/opt/reprostack",
        labels=labels,
        created_by="doit image: 3 wheels",
        epoch=EPOCH,
    )
    assert config["created"] == "1980-01-01T00:00:00Z" and "author" not in config
    assert (config["architecture"], config["os"]) == ("amd64", "linux")
    assert config["rootfs"] == {
        "type": "layers",
        "diff_ids": ["sha256:" + "a" * 64, "sha256:" + "b" * 64, "sha256:" + "c" * 64],
    }
    assert config["history"][-1] == {"created": "1980-01-01T00:00:00Z", "created_by": "doit image: 3 wheels"}
    assert sum(not e.get("empty_layer") for e in config["history"]) == len(config["rootfs"]["diff_ids"])
    inner = config["config"]
    assert set(inner) == {"Env", "Cmd", "WorkingDir", "Entrypoint", "Labels"}  # no empty, runtime-only, ONBUILD
    assert inner["Env"] == [
        "PATH=/opt/reprostack/bin:/usr/local/nvidia/bin:/usr/bin:/bin",
        "LANG=C.UTF-8",
        "VIRTUAL_ENV=/opt/reprostack",
    ]
    assert inner["Labels"] == {"maintainer": "base", **labels}  # ours win over the base's
    raw = config_bytes(config)
    assert raw == config_bytes(dict(reversed(config.items())))  # key order does not matter
    assert raw.startswith(b'{"architecture":"amd64","config":{"Cmd":["/bin/bash"],"Entrypoint":')


def test_the_docker_archive_holds_the_config_and_only_the_new_layer(tmp_path: Path) -> None:
    layer = tmp_path / "layer.tar"
    layer.write_bytes(b"layer bytes")
    config = config_bytes({"rootfs": {"type": "layers", "diff_ids": ["sha256:" + "a" * 64, "sha256:" + "c" * 64]}})
    image_id = write_docker_archive(tmp_path / "image.tar", config=config, layer=layer, tag="t:1", epoch=EPOCH)
    assert image_id == f"sha256:{hashlib.sha256(config).hexdigest()}"
    with tarfile.open(tmp_path / "image.tar") as tar:
        assert tar.getnames() == [f"{image_id[7:]}.json", "manifest.json", "c" * 64, f"{'c' * 64}/layer.tar"]
        manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        assert tar.extractfile(f"{'c' * 64}/layer.tar").read() == b"layer bytes"  # type: ignore[union-attr]
    assert manifest == [
        {
            "Config": f"{image_id[7:]}.json",
            "RepoTags": ["t:1"],
            "Layers": [f"{'a' * 64}/layer.tar", f"{'c' * 64}/layer.tar"],
        }
    ]
