"""A source kind added in this one file: "dir", a directory tree of this host, locked, fetched and built
end to end by the real `doit lock` and `doit wheels`.

The doit processes learn of it through tasks/lock/kinds.py's plugin point: ``REPRO_SOURCE_KINDS`` names this
module, whose ``SOURCE_KINDS`` lists the kind. Nothing in tasks/ knows the kind.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
from conftest import REPO, Workspace
from serve import FixtureServer

from tasks.lock.kinds import BomEntry, TreeKind, source_filter
from tasks.lock.lockfile import Source
from tasks.lock.schema import Field, Problems, is_license, is_sha256, is_str, is_str_list
from tasks.store.cache import Cache

pytestmark = pytest.mark.integration


class Dir(TreeKind):
    """A directory on this host, by absolute path (kept in ``Source.url``): its tree hash is its only pin."""

    name = "dir"
    fields: ClassVar[Mapping[str, Field]] = {
        "kind": Field(is_str, required=True),
        "path": Field(is_str, required=True),
        "tree_sha256": Field(is_sha256),
        "include": Field(is_str_list),
        "exclude": Field(is_str_list),
        "license": Field(is_license),
    }

    def check(self, where: str, entry: Mapping[str, Any], p: Problems) -> dict[str, Any]:
        if not Path(entry["path"]).is_absolute():
            p.add(where, f"path {entry['path']!r} must be absolute")
        return {"url": entry["path"]}

    def pin(self, src: Source) -> dict[str, Any]:
        return {"name": src.name, "kind": src.kind, "tree_sha256": src.tree_sha256, "path": src.url}

    def complete(self, src: Source) -> bool:
        return bool(src.tree_sha256)

    def _pinned(self, src: Source, meta: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        return "directory", {}

    def materialize(
        self, src: Source, work: Path, *, cache: Cache, mirror: Path | None, log: Path
    ) -> tuple[Path, dict[str, Any]]:
        root = work / "tree"
        shutil.copytree(src.url, root, symlinks=True)
        source_filter(src).apply(root)
        return root, {"origin": src.url}

    def provenance(self, src: Source, path: str) -> list[dict[str, Any]]:
        notes = self._annotations(src, path)
        return [{"name": f"source:{src.name}", "uri": f"file://{src.url}", "digest": {"sha256": src.tree_sha256},
                 "annotations": notes}]  # fmt: skip

    def sbom(self, src: Source) -> BomEntry:
        return BomEntry(name=src.name, version=f"tree:{src.tree_sha256}", ref=f"source:{src.name}",
                        license=src.license, purl_name=src.name,
                        properties=(("kind", src.kind), ("tree_sha256", src.tree_sha256)))  # fmt: skip


SOURCE_KINDS = [Dir()]

LOCK = """\
format = 1

[toolchain]
python = ">=3.10"
archs = ["sm_90a"]

[sources.pure]
kind = "dir"
path = "{path}"
license = "MIT"

[packages.repro_pure]
source = "pure"
build_requires = ["setuptools>=61"]
verify = {{ imports = ["repro_pure"] }}
"""


def test_a_kind_in_one_file_locks_fetches_and_builds(tmp_path: Path, server: FixtureServer) -> None:
    upstream = shutil.copytree(REPO / "tests" / "fixtures" / "src" / "repro_pure", tmp_path / "upstream")
    ws = Workspace(root=tmp_path / "ws", cache=tmp_path / "cache", index_url=f"{server.url}/simple",
                   env_extra={"REPRO_SOURCE_KINDS": __name__, "PYTHONPATH": str(REPO / "tests")})  # fmt: skip
    ws.root.mkdir()
    ws.lock.write_text(LOCK.format(path=upstream))

    res = ws.doit("wheels", check=False)
    assert res.returncode != 0 and "[sources.pure] missing 'tree_sha256'" in res.stdout + res.stderr
    out = ws.doit("lock").stdout
    assert "pure: directory tree " in out, out
    assert "tree_sha256 = " in ws.lock.read_text()

    ws.doit("wheels")
    manifest = json.loads((ws.wheels / "manifest.json").read_text())
    (wheel,) = [w for w in manifest["wheels"] if w["package"] == "repro_pure"]
    assert wheel["filename"].startswith("repro_pure-0.1.0-") and (ws.wheels / wheel["filename"]).is_file()
    statement = (ws.wheels / "provenance" / f"{wheel['filename']}.intoto.json").read_text()
    assert f'"uri": "file://{upstream}"' in statement.replace('":"', '": "'), statement
    components = json.loads((ws.wheels / "sbom.cdx.json").read_text())["components"]
    pure = next(c for c in components if c.get("bom-ref") == "source:pure")
    assert {"name": "reprostack:kind", "value": "dir"} in pure["properties"]

    # A change upstream is a different tree: refused until `doit lock update=pure` pins it again.
    (upstream / "repro_pure" / "__init__.py").write_text("VALUE = 2\n")
    shutil.rmtree(ws.cache / "sources")
    res = ws.doit("fetch:pure", check=False)
    assert res.returncode != 0 and "does not match the lock's tree_sha256" in res.stdout + res.stderr
