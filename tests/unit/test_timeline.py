"""Build timeline: ninja logs, Chrome trace events, summary, progress throttling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.engine.timeline import (
    Outcome,
    Progress,
    Unit,
    chrome_trace,
    interval_union,
    parse_ninja_log,
    report,
    summary_table,
)

NINJA_LOG = """# ninja log v5
0\t1500\t0\tbuild/a.o\tdeadbeef
10\t2500\t0\tbuild/b.o\tcafebabe
0\t900\t0\tbuild/a.o\tdeadbeef
garbage line
"""


def test_parse_ninja_log_keeps_the_last_entry_of_each_output() -> None:
    assert parse_ninja_log(NINJA_LOG) == [Unit("build/a.o", 0, 900), Unit("build/b.o", 10, 2500)]


def test_chrome_trace_has_a_row_per_package_and_spans_per_unit() -> None:
    built = Outcome(
        package="te",
        status="built",
        start=100.0,
        wall_s=3.0,
        cpu_s=5.0,
        max_rss_mb=10,
        units=[Unit("x/a.o", 200, 1200)],
    )
    later = Outcome(package="fa3", status="built", start=101.0, wall_s=1.0)
    cached = Outcome(package="apex", status="cached")
    trace = chrome_trace([built, later, cached])
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"te", "fa3"}
    te = next(e for e in spans if e["name"] == "build te")
    assert (te["ts"], te["dur"], te["tid"]) == (0, 3_000_000, 1)
    unit = next(e for e in spans if e["name"] == "a.o")
    assert (unit["ts"], unit["dur"], unit["tid"]) == (200_000, 1_000_000, 1)
    assert next(e for e in spans if e["name"] == "build fa3")["ts"] == 1_000_000
    table = summary_table([built, cached])
    assert "apex" in table and "cached" in table and "te" in table and "built" in table


def test_progress_beats_while_the_build_is_silent(tmp_path: Path) -> None:
    """The heartbeat prints while nothing is printed, and counts the compilers running in the build's session."""
    import shutil
    import subprocess
    import time

    # A process named like gcc's compiler proper, in a session of its own, as a build's are.
    fake = tmp_path / "cc1plus"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", fake)
    proc = subprocess.Popen([str(fake), "30"], start_new_session=True)
    try:
        lines: list[str] = []
        progress = Progress("te", lines.append, every=0.2)
        progress.feed("[3/10] Building CUDA object a.o")
        progress.started(proc.pid)
        with progress:
            deadline = time.monotonic() + 10
            while len(lines) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert len(lines) >= 2, lines
        assert lines[0].startswith("  te: 3/10 units done, 1 compiler(s) running, 0m0"), lines
    finally:
        proc.kill()
        proc.wait()
    n = len(lines)
    time.sleep(0.5)
    assert len(lines) == n  # stopped with the build


def test_waits_are_counted_once() -> None:
    assert interval_union([(1.0, 3.0), (2.0, 4.0), (10.0, 11.0)], 0.0, 10.5) == 3.5
    assert interval_union([], 0.0, 5.0) == 0.0
    table = summary_table([Outcome(package="te", status="built", wall_s=10.0, wait_s=4.0)])
    assert table.splitlines()[1].split()[:5] == ["te", "built", "10.0", "4.0", "6.0"], table


def test_report_writes_the_trace_only_when_something_was_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "build" / "trace.json"
    report({}, ["apex"], trace)  # everything cached, no earlier timeline: none is claimed
    out = capsys.readouterr().out
    assert not trace.exists() and "no build timeline" in out and str(trace) not in out
    report({"te": Outcome(package="te", status="built", wall_s=1.0)}, ["te", "apex"], trace)
    rows = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "M"}
    assert rows == {"te"} and f"build timeline: {trace}" in capsys.readouterr().out
    report({}, ["te", "apex"], trace)  # a cached run keeps the last build's timeline and says where it is
    assert trace.exists() and f"the last build's timeline stays in {trace}" in capsys.readouterr().out
