"""The index URLs pip is configured with (tasks/lock/pypi.py ``pip_indexes``): asked of pip's own
``pip config list`` when a configuration file may add one, not asked when PIP_CONFIG_FILE is os.devnull."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tasks.core import proc
from tasks.lock import pypi


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pypi, "_INDEXES", {})
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)


def test_a_config_file_adds_its_extra_index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nextra-index-url = http://127.0.0.1:9/extra/simple\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/main/simple")
    assert pypi.pip_indexes() == ["http://127.0.0.1:9/main/simple", "http://127.0.0.1:9/extra/simple"]


def test_no_config_file_means_pip_is_not_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/main/simple")

    def asked(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"pip was asked: {args}")

    monkeypatch.setattr(proc, "query", asked)
    assert pypi.pip_indexes() == ["http://127.0.0.1:9/main/simple"]
    monkeypatch.delenv("PIP_INDEX_URL")
    assert pypi.pip_indexes() == [pypi.DEFAULT_INDEX]
