"""The no-op's record in the build history (tasks/store/noop.py): read back, written only when it moves."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tasks.store import noop

SHA = "a" * 64


def test_a_record_is_read_back_for_its_lock_and_profile_only(tmp_path: Path) -> None:
    assert noop.read(tmp_path, SHA, "quick") is None
    noop.record(tmp_path, SHA, "quick", 0.31)
    assert noop.read(tmp_path, SHA, "quick") == 0.31
    assert noop.read(tmp_path, SHA, "default") is None and noop.read(tmp_path, "b" * 64, "quick") is None


def test_a_no_op_within_a_quarter_of_the_record_writes_nothing(tmp_path: Path) -> None:
    noop.record(tmp_path, SHA, "quick", 0.40)
    file = noop.path(tmp_path)
    os.utime(file, ns=(1, 1))
    noop.record(tmp_path, SHA, "quick", 0.49)  # within 25 %
    assert file.stat().st_mtime_ns == 1 and noop.read(tmp_path, SHA, "quick") == 0.40
    noop.record(tmp_path, SHA, "quick", 0.60)
    assert noop.read(tmp_path, SHA, "quick") == 0.60


def test_only_the_newest_pairs_are_kept(tmp_path: Path) -> None:
    for i in range(noop.KEPT + 4):
        noop.record(tmp_path, f"{i:064x}", "p", 1.0 + i)
    doc = json.loads(noop.path(tmp_path).read_text())
    assert len(doc) == noop.KEPT
    assert noop.read(tmp_path, f"{noop.KEPT + 3:064x}", "p") == noop.KEPT + 4.0


DAMAGED = [
    "{not json",
    "[]",
    json.dumps({f"{SHA}:quick": {"seconds": "1"}}),
    f'{{"{SHA}:quick": {{"seconds": 1e999}}}}',
]


@pytest.mark.parametrize("text", DAMAGED)
def test_a_damaged_record_is_no_record_and_is_written_over(tmp_path: Path, text: str) -> None:
    noop.path(tmp_path).parent.mkdir(parents=True)
    noop.path(tmp_path).write_text(text)
    assert noop.read(tmp_path, SHA, "quick") is None
    noop.record(tmp_path, SHA, "quick", 0.2)
    assert noop.read(tmp_path, SHA, "quick") == 0.2


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan"), float("inf"), 1e9])
def test_no_figure_is_no_record(tmp_path: Path, seconds: float) -> None:
    noop.record(tmp_path, SHA, "quick", seconds)
    assert not noop.path(tmp_path).exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes a read-only directory")
def test_a_cache_that_cannot_be_written_keeps_no_record_and_raises_nothing(tmp_path: Path) -> None:
    (tmp_path / "timings").mkdir()
    (tmp_path / "timings").chmod(0o500)
    try:
        noop.record(tmp_path, SHA, "quick", 0.2)
    finally:
        (tmp_path / "timings").chmod(0o700)
    assert noop.read(tmp_path, SHA, "quick") is None
