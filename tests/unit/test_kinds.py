"""The source-kind registry (tasks/lock/kinds.py): an unknown kind is an error everywhere, never pypi."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tasks.core.errors import LockError
from tasks.lock import kinds
from tasks.lock.lockfile import Source, parse_lock
from tasks.stages import provenance, sbom


def test_an_unknown_kind_is_a_lock_error_never_pypi() -> None:
    src = Source(name="x", kind="hg", url="https://example.invalid/x", project="x", version="1")
    for describe in (src.pin, lambda: provenance.source_descriptors(src, "."), lambda: sbom.source_component(src)):
        with pytest.raises(LockError, match=r"^unknown source kind 'hg': the kinds are git, url, pypi, wheel "):
            describe()


def test_the_lock_names_the_kinds_and_the_closest_one() -> None:
    doc: dict[str, Any] = {"format": 1, "toolchain": {"archs": ["sm_90a"]}, "sources": {"x": {"kind": "gti"}}}
    with pytest.raises(LockError) as err:
        parse_lock(doc, path=Path("sources.lock"), check_files=False)
    message = "[sources.x] kind must be one of git, url, pypi, wheel, got 'gti' (perhaps you meant 'git'?)"
    assert message in str(err.value)


def test_a_plugin_module_that_is_not_there_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kinds.PLUGINS_VAR, "no_such_module_of_kinds")
    with pytest.raises(LockError, match="cannot import 'no_such_module_of_kinds'"):
        kinds.registry()
    monkeypatch.setenv(kinds.PLUGINS_VAR, "os.path; rm")
    with pytest.raises(LockError, match="is not a module name"):
        kinds.registry()


def test_a_plugin_may_not_replace_a_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kinds.PLUGINS_VAR, "tasks.lock.kinds")  # a module whose SOURCE_KINDS is missing
    with pytest.raises(LockError, match="must define SOURCE_KINDS"):
        kinds.registry()
    monkeypatch.setattr(kinds, "SOURCE_KINDS", [kinds.Git()], raising=False)
    with pytest.raises(LockError, match="names kind 'git', which exists already"):
        kinds.registry()
    assert isinstance(kinds.KINDS["git"], kinds.Git)
