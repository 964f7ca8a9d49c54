"""The run's progress: the time left by the run's own forecast, and how it is said on a terminal and in a log."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tasks.core import console
from tasks.core.console import CLEAR, LineWriter, Live
from tasks.engine.admission import Expect
from tasks.engine.forecast import OVERDUE_S, Forecast, PackageWork, Seen, UnitWork, remaining, simulate
from tasks.engine.progress import EVERY, GAP, Status, UnitsLog, duration
from tasks.engine.timeline import Progress, against, finished_unit


def units(*seconds: float, mb: float = 1000.0) -> tuple[UnitWork, ...]:
    return tuple(UnitWork(f"u{i}.o", s, mb) for i, s in enumerate(seconds))


def left(forecast: Forecast | None, **seen: Seen) -> float | None:
    rest = remaining(forecast, seen)
    return None if rest is None else rest.wall_s


# --------------------------------------------------------------------------- the time left


def test_nothing_done_is_the_forecast_and_everything_done_is_nothing() -> None:
    f = simulate([PackageWork("te", units(10, 10, 10), serial_s=5), PackageWork("apex", units(4), serial_s=1)], slots=2)
    assert left(f) == f.wall_s == 25  # nothing seen yet: the very simulation that forecast the run
    assert left(f, te=Seen(), apex=Seen()) == f.wall_s  # started, nothing done: the same
    assert left(f, te=Seen(ended=True), apex=Seen(ended=True)) == 0.0
    rest = remaining(f, {"apex": Seen(ended=True)})
    assert rest is not None and set(rest.packages) == {"te"}  # an ended build is no longer in it


def test_no_history_is_no_figure() -> None:
    assert remaining(None, {"te": Seen(elapsed_s=30.0)}) is None


def test_what_ended_is_taken_off_and_what_runs_keeps_its_slot_for_what_it_has_left() -> None:
    f = simulate([PackageWork("te", units(10, 10), serial_s=5)], slots=1)
    assert f.wall_s == 25
    assert left(f, te=Seen(elapsed_s=3.0)) == 22  # in its serial part: what is left of it, then the units
    assert left(f, te=Seen(elapsed_s=10.0, running={"u0.o": 5.0})) == 15  # on time
    assert left(f, te=Seen(elapsed_s=20.0, done=frozenset({"u0.o"}), running={"u1.o": 5.0})) == 5
    # A preprocessor run (the object cache's) is its compile's start.
    assert left(f, te=Seen(elapsed_s=10.0, running={"u0.cpp.E": 5.0})) == 15
    # On two slots the running unit keeps its own and the other unit starts beside it, as in the build.
    two = simulate([PackageWork("te", units(10, 10, 10), serial_s=5)], slots=2)
    assert left(two, te=Seen(elapsed_s=12.0, running={"u0.o": 7.0, "u1.o": 7.0})) == 13
    # A unit the forecast does not know (a configure check's) is in the serial part already.
    assert left(f, te=Seen(elapsed_s=3.0, running={"cmTC_1234.o": 1.0})) == 22


def test_a_unit_slower_than_its_record_raises_the_time_left() -> None:
    f = simulate([PackageWork("te", units(10, 10), serial_s=5)], slots=1)
    on_time = f.wall_s - 20.0  # what the forecast has left 20 s in
    late = left(f, te=Seen(elapsed_s=20.0, running={"u0.o": 15.0}))
    assert late == OVERDUE_S + 10 > on_time  # its rest not guessed: a second, then the unit behind it
    slow = left(f, te=Seen(elapsed_s=25.0, done=frozenset({"u0.o"})))  # ended at 20 s into the run, not 15
    assert slow == 10 > f.wall_s - 25.0
    # A build whose units have all ended but which has not: never over before it is.
    assert left(f, te=Seen(elapsed_s=40.0, done=frozenset({"u0.o", "u1.o"}))) == OVERDUE_S


def test_packages_not_started_wait_for_doit_s_tasks_as_forecast() -> None:
    work = [PackageWork(f"p{i}", units(10), serial_s=0) for i in range(3)]
    f = simulate(work, slots=4, tasks=1)
    assert f.wall_s == 30
    assert left(f, p0=Seen(elapsed_s=5.0, running={"u0.o": 5.0})) == 25  # the running unit, then the two after it
    rest = remaining(f, {"p0": Seen(ended=True), "p1": Seen(elapsed_s=2.0, running={"u0.o": 2.0})})
    assert rest is not None and rest.packages["p1"].end_s == 8 and rest.packages["p2"].end_s == 18


def test_a_running_unit_s_timed_peak_moves_with_what_it_has_run() -> None:
    # Two units of 10 GB on a 15 GB budget cannot run together while both peak; the running one is past its
    # peak (held from 0 to 4 s), so the other starts beside it at once.
    peak = Expect(10_000, before_mb=100.0, peak_from_s=0.0, peak_for_s=4.0, after_mb=500.0)
    work = [PackageWork("fa3", (UnitWork("a.o", 10, 10_000, peak), UnitWork("b.o", 10, 10_000, peak)))]
    f = simulate(work, slots=2, budget_mb=15_000)
    assert left(f, fa3=Seen(elapsed_s=6.0, running={"a.o": 6.0})) == 10
    untimed = [PackageWork("fa3", units(10, 10, mb=10_000))]
    g = simulate(untimed, slots=2, budget_mb=15_000)
    assert left(g, fa3=Seen(elapsed_s=6.0, running={"u0.o": 6.0})) == 14  # held for all of it: after it


# --------------------------------------------------------------------------- what a run sees


def test_ninja_s_lines_name_the_unit_that_ended() -> None:
    assert finished_unit("[3/10] Building CXX object CMakeFiles/te.dir/common/core.cpp.o") == "core.cpp.o"
    assert finished_unit("[1/3] /usr/bin/nvcc -c /src/csrc/vadd.cu -o /b/temp/csrc/vadd.o -O3") == "vadd.o"
    assert finished_unit("compiling something") is None
    p = Progress("te", lambda _: None, every=0)
    p.feed("[1/3] /usr/bin/c++ -c a.cpp -o build/a.o")
    p.feed("[2/3] Linking CXX shared library libte.so")
    assert (p.done, p.total, p.ended) == (2, 3, {"a.o", "libte.so"})


def test_the_unit_log_is_read_as_it_grows_from_where_this_run_began(tmp_path: Path) -> None:
    path = tmp_path / "units.log"
    path.write_text("# earlier run\n100.0 start te old.o expect=1MB\n")
    log = UnitsLog(path)
    with path.open("a") as fh:
        fh.write("# 2025 run 1: 2 slots, memory tokens only\n200.0 wait te a.o expect=1MB\n200.5 start te a.o exp")
    log.read()
    assert log.running == {}  # a line half-written is taken once it is whole
    with path.open("a") as fh:
        fh.write("ect=1MB\n")
    log.read()
    assert log.running == {"te": {"a.o": 200.5}}
    with path.open("a") as fh:
        fh.write("201.0 start te a.cpp.E expect=1MB\n209.0 end te a.o seconds=8.5\n")
    log.read()
    assert log.running == {"te": {"a.cpp.E": 201.0}} and log.done == {"te": {"a.o"}}
    with path.open("a") as fh:
        fh.write("210.0 retry te a.o expect=2MB\n")  # killed for memory, run once more: running again
    log.read()
    assert log.running["te"] == {"a.cpp.E": 201.0, "a.o": 210.0} and log.done["te"] == set()
    assert UnitsLog(tmp_path / "none.log").running == {}


def test_the_figures_are_said_in_minutes_and_seconds() -> None:
    assert [duration(s) for s in (0.0, 0.4, 59.6, 365.2, 3725.0)] == ["0m00s", "0m00s", "1m00s", "6m05s", "62m05s"]
    assert against(365.0, 375.0) == " (2.7 % under the forecast)"
    assert against(385.0, 375.0) == " (2.7 % over the forecast)"
    assert against(375.1, 375.0) == " (as forecast)" and against(1.0, 0.0) == ""


# --------------------------------------------------------------------------- the lines


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0  # (not 0: Progress.line takes 0 for "now")

    def __call__(self) -> float:
        return self.now


def building(status: Status, clock: Clock, *names: str) -> dict[str, Progress]:
    found = {}
    for name in names:
        p = Progress(name, lambda _: None, every=0)
        p.started_at = clock.now
        status._open[name] = p  # (what open() does, without its thread: the test ticks itself)
        found[name] = p
    return found


def test_a_log_gets_whole_lines_every_20_to_30_seconds_unless_something_moved() -> None:
    f = simulate([PackageWork("te", units(100, 100), serial_s=0), PackageWork("apex", units(50))], slots=2)
    clock, lines = Clock(), list[str]()
    status = Status(f, known={"te", "apex"}, emit=lines.append, clock=clock, wall=clock)
    building(status, clock, "te")
    status.tick()
    assert lines == ["  te: 0m00s, remaining 1m40s, of the run 2m30s"]  # apex's 50 s come after te's units
    status.units.running["te"] = {"u0.o": clock.now, "u1.o": clock.now}  # (the broker's log: they started)
    for _ in range(4):  # nothing due in between: a tick every 5 s, a line every 20 s (at most 25 s apart)
        clock.now += GAP
        status.tick()
    assert len(lines) == 2 and clock.now - 1000.0 == EVERY
    assert lines[1] == "  te: 0m20s, remaining 1m20s, of the run 2m10s"
    clock.now += 1.0
    building(status, clock, "apex")
    status.tick()
    assert len(lines) == 2  # a build that started is said, but not within GAP of the last line
    clock.now += GAP
    status.tick()
    assert [line.split(":")[0] for line in lines[2:]] == ["  te", "  apex"]
    assert all("\r" not in line and CLEAR not in line for line in lines)


def test_a_log_gets_a_line_early_when_the_time_left_moves() -> None:
    f = simulate([PackageWork("te", units(300), serial_s=0)], slots=1)
    clock, lines = Clock(), list[str]()
    status = Status(f, known={"te"}, emit=lines.append, clock=clock, wall=clock)
    building(status, clock, "te")
    status.units.running["te"] = {"u0.o": clock.now}
    status.tick()
    assert lines == ["  te: 0m00s, remaining 5m00s"]
    clock.now += 10.0
    status.tick()
    assert len(lines) == 1  # on time: counting down, nothing to say
    status.units.done["te"], status.units.running["te"] = {"u0.o"}, {}  # done at once: nothing left
    clock.now += 5.0
    status.tick()
    assert lines[-1] == "  te: 0m15s, remaining 0m01s", lines


def test_without_history_the_lines_say_so() -> None:
    clock, lines = Clock(), list[str]()
    status = Status(None, emit=lines.append, clock=clock, wall=clock)
    building(status, clock, "repro_pure")
    status.tick()
    assert lines == ["  repro_pure: 0m00s, remaining unknown (no history)"]
    # A forecast that has no record of this package: none for it, a floor for the run.
    f = simulate([PackageWork("te", units(60)), PackageWork("new", ())], slots=2)
    lines.clear()
    status = Status(f, known={"te"}, emit=lines.append, clock=clock, wall=clock)
    building(status, clock, "te", "new")
    status.tick()
    assert lines == [
        "  te: 0m00s, remaining 1m00s",
        "  new: 0m00s, remaining unknown (no history), of the run at least 1m00s",
    ]


def test_a_terminal_gets_one_line_rewritten_in_place_with_the_other_lines_above_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    screen = io.StringIO()
    live = Live(screen, width=60)
    f = simulate([PackageWork("te", units(100, 100)), PackageWork("apex", units(50))], slots=2)
    clock = Clock()
    status = Status(f, known={"te", "apex"}, live=live, clock=clock, wall=clock)
    found = building(status, clock, "te", "apex")
    found["te"].feed("[0/2] (nothing ended yet)")
    status.tick()
    text = "  remaining 2m30s, 0m00s in: te 0/2 units, apex; 0 compiler(s) running"
    assert screen.getvalue() == "\r" + text[:59] + CLEAR  # cut to the terminal's width, less one column
    clock.now += 1.0
    status.tick()
    assert screen.getvalue().count("\r") == 2 and "\n" not in screen.getvalue()  # rewritten, not a line more
    assert screen.getvalue().endswith(
        "\r" + "  remaining 2m29s, 0m01s in: te 0/2 units, apex; 0 compiler(s)"[:59] + CLEAR
    )
    # A line printed meanwhile goes above the status line, which is drawn again below it.
    monkeypatch.setattr(console, "_live", live)  # (what console.live() keeps for the terminal)
    before = len(screen.getvalue())
    LineWriter(screen).write("built apex in 50.0s\n")
    assert screen.getvalue()[before:] == "\r" + CLEAR + "built apex in 50.0s\n" + "\r" + live.text[:59] + CLEAR
    live.clear()
    assert screen.getvalue().endswith("\r" + CLEAR) and live.text == ""


def test_a_build_followed_opens_and_closes_the_status_and_its_ticker() -> None:
    lines: list[str] = []
    screen = io.StringIO()
    status = Status(None, emit=lines.append, live=Live(screen, width=80))
    with status.follow(Progress("te", lambda _: None, every=0)):
        assert status._thread is not None and status._thread[0].is_alive()
        assert "remaining unknown (no history), 0m00s in: te; 0 compiler(s) running" in screen.getvalue()
    assert status._thread is None and screen.getvalue().endswith("\r" + CLEAR)  # the line taken off at the end
    assert lines == []  # (a terminal's status is no line of the log)
