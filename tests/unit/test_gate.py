"""The gate's unit names and the broker's expectations of a unit's memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tasks.engine.admission import Expect, Expectations
from tasks.env import compilers
from tasks.outside import gate
from tasks.outside.gate import Unit, unit_name, watch
from tasks.store.history import load_memory, record_memory
from tasks.store.history import memory_path as memory_record


def test_a_unit_is_named_by_its_output_as_ninja_logs_it() -> None:
    assert unit_name(["nvcc", "-c", "src/k.cu", "-o", "build/temp/k.o", "-O3"]) == "k.o"
    assert unit_name(["g++", "-c", "a.cpp", "-obuild/a.o"]) == "a.o"
    assert unit_name(["g++", "-c", "a.cpp"]) == "a.cpp"
    # ccache's preprocessor runs are kept apart from the compile of the same source
    assert unit_name(["nvcc", "-E", "src/k.cu", "-Xcompiler", "-fPIC"]) == "k.cu.E"
    # questions to the compiler are no unit: the gate runs them without a token
    assert unit_name(["nvcc", "--version"]) == ""
    assert unit_name(["c++", "-dumpmachine"]) == ""


def test_the_gate_marks_its_compilers_by_the_name_the_escape_watch_looks_for() -> None:
    # tasks/outside/gate.py imports nothing of tasks/, and the no-op path does not import the gate: two definitions.
    assert gate.ENV_GATED == compilers.GATED_MARK


def test_a_unit_remembers_its_peak_the_process_it_came_in_and_its_rest() -> None:
    unit = Unit()
    for total, names in [
        (300.0, {"nvcc": 10.0, "cudafe++": 290.0}),
        (9000.0, {"nvcc": 10.0, "cicc": 8990.0}),
        (12000.0, {"nvcc": 10.0, "cicc": 11990.0}),
        (900.0, {"nvcc": 10.0, "ptxas": 890.0}),
        (1500.0, {"nvcc": 10.0, "cc1plus": 1490.0}),
    ]:
        unit.add(total, names)
    assert (unit.peak_mb, unit.peak_in, unit.after_mb) == (12000.0, "cicc", 1500.0)


def test_expectations_come_from_records_then_hints_then_the_package() -> None:
    plan = Expectations(
        records={"k1.o": {"peak_mb": 6000, "peak_in": "cicc", "after_mb": 800}},
        hints={"k*.o": {"peak_mb": 20000, "peak_in": "cicc", "after_mb": 5000}, "huge.o": {"peak_mb": 99999}},
        default_mb=24576,
    )
    assert plan.expect("k1.o") == Expect(6000, "cicc", 800)
    assert plan.expect("k2.o") == Expect(20000, "cicc", 5000)
    assert plan.expect("huge.o") == Expect(24576, "", 24576)  # a hint above the package's figure is capped
    assert plan.expect("other.o") == Expect(24576)
    assert plan.expect("other.cu.E") == Expect(2048)
    small = Expectations(records={}, hints=plan.hints, default_mb=7168)  # FA3's minimal profile states 7 GB
    assert small.expect("k2.o").peak_mb == 7168


def test_records_merge_and_a_killed_unit_keeps_its_larger_peak(tmp_path: Path) -> None:
    record_memory(tmp_path, "pkg", {"a.o": {"peak_mb": 5000.4, "seconds": 3.0}, "b.o": {"peak_mb": 100.0}})
    record_memory(tmp_path, "pkg", {"a.o": {"peak_mb": 4000.0, "killed": True}})
    found = load_memory(memory_record(tmp_path, "pkg"))
    assert found["a.o"] == {"peak_mb": 5000, "killed": True}
    assert found["b.o"] == {"peak_mb": 100}
    memory_record(tmp_path, "broken").write_text("{not json")
    assert load_memory(memory_record(tmp_path, "broken")) == {}


def test_a_unit_times_its_peak_from_its_samples() -> None:
    """Held 100 MB, then 900 MB from about 2 s to 4 s (in cicc), then 200 MB: its peak span runs from the
    sample before the first at half its peak to the sample after the last, so it covers the peak whatever
    fell between samples; what it held before and after are the most outside that span."""
    unit = Unit()
    for at, total, name in [(0.5, 100, "cc1plus"), (1.5, 120, "cicc"), (2.5, 900, "cicc"), (3.5, 800, "cicc"),
                            (4.5, 200, "ptxas"), (5.5, 150, "ptxas")]:  # fmt: skip
        unit.add(total, {name: total}, at)
    unit.timed(6.0)
    assert (unit.peak_mb, unit.peak_in, unit.before_mb, unit.after_mb) == (900, "cicc", 120, 200)
    assert (unit.peak_from_s, unit.peak_for_s) == (1.5, 3.0)
    assert unit.report() == "120 1.5 3.0"
    # A peak at the last sample runs to the unit's end; one no sample saw (the kernel's figure) is untimed.
    tail = Unit()
    tail.add(100, {"cc1plus": 100}, 0.5)
    tail.add(900, {"cicc": 900}, 1.5)
    tail.timed(2.0)
    assert (tail.peak_from_s, tail.peak_for_s, tail.after_mb) == (0.5, 1.5, 0.0)
    missed = Unit()
    missed.add(100, {"cc1plus": 100}, 0.5)
    missed.peak_mb = 900  # ru_maxrss: a spike between samples
    missed.timed(1.0)
    assert missed.peak_for_s is None and missed.report() == "- - -"


def test_a_timed_record_becomes_a_timed_expectation_and_a_hint_is_capped(tmp_path: Path) -> None:
    found = {"peak_mb": 20000, "peak_in": "cicc", "after_mb": 3000, "before_mb": 1500, "peak_from_s": 40.0,
             "peak_for_s": 30.0, "seconds": 400.0}  # fmt: skip
    record_memory(tmp_path, "fa3", {"k.o": dict(found, peak_from_s=40.04, peak_for_s=29.96)})
    recorded = load_memory(memory_record(tmp_path, "fa3"))["k.o"]
    assert recorded == found  # seconds to a tenth, MB whole
    expect = Expectations(records={"k.o": recorded}, hints={}, default_mb=24 * 1024).expect("k.o")
    assert expect == Expect(20000, "cicc", 3000, 1500, 40.0, 30.0) and expect.timed
    # A hint above the package's mem_per_job_gb (a profile that builds less) counts as that, timing kept.
    capped = Expectations(records={}, hints={"k.o": found}, default_mb=7 * 1024).expect("k.o")
    assert capped == Expect(7 * 1024, "cicc", 3000, 1500, 40.0, 30.0)


def test_a_unit_is_charged_the_cpu_its_compiler_and_children_used() -> None:
    """watch() takes the compiler's CPU-seconds from the kernel (its children's too, as a compiler driver's
    cicc and ptxas): a child that spins 0.4 s of CPU in a grandchild is charged about that, busy host or not."""
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}], check=True)"
    child = subprocess.Popen([sys.executable, "-c", code])
    status, unit = watch(child.pid, "")
    child.returncode = status
    assert status == 0
    assert 0.4 <= unit.cpu_s < 5.0, unit.cpu_s
