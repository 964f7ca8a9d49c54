"""The gate's unit names and the broker's expectations of a unit's memory."""

from __future__ import annotations

from pathlib import Path

from tasks.engine.admission import Expect, Expectations
from tasks.env import compilers
from tasks.outside import gate
from tasks.outside.gate import Unit, unit_name
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
