"""The venv's ``doit`` (tasks/cli.py): doit's start-up trimmed, its behaviour unchanged."""

from __future__ import annotations

import importlib.metadata
import inspect
import runpy
import subprocess
import sys
from pathlib import Path

import doit
import doit.loader
import doit.plugin
import pytest
from conftest import require

from tasks import cli

REPO = Path(__file__).resolve().parents[2]


def test_task_creators_keep_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # doit orders the creators by the line they start on; the code object's line is that line.
    namespace = runpy.run_path(str(REPO / "tasks" / "graph.py"), run_name="graph_under_test")
    monkeypatch.setattr(doit.loader, "inspect", inspect)
    before = [(name, line) for name, _, line in doit.loader._get_task_creators(namespace, [])]
    cli.fast_start()
    assert doit.loader.inspect is not inspect  # doit no longer reads the creators' source
    after = [(name, line) for name, _, line in doit.loader._get_task_creators(namespace, [])]
    assert after == before and len(after) >= 10


def test_plugins_are_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    real = importlib.metadata.entry_points

    def counted() -> importlib.metadata.EntryPoints:
        reads.append(1)
        return real()

    monkeypatch.setattr(importlib.metadata, "entry_points", counted)
    monkeypatch.setattr(doit.loader, "inspect", inspect)  # fast_start runs again
    monkeypatch.setattr(doit.plugin, "entry_points_impl", doit.plugin.entry_points_impl)
    cli.fast_start()
    for category in ("COMMAND", "LOADER", "REPORTER", "BACKEND"):
        doit.plugin.PluginDict().add_plugins({}, category)
    assert len(reads) == 1


def test_the_venvs_doit_is_ours_and_runs_doit() -> None:
    script = Path(sys.executable).parent / "doit"
    if not script.is_file():
        require(f"no doit script beside {sys.executable}")
    assert "tasks.cli" in script.read_text(), f"{script} is not the project's (pip install -e . writes it)"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == ".".join(map(str, doit.__version__))
