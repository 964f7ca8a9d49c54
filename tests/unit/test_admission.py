"""The run's admission policy (tasks/engine/admission.py): which waiting compile gets the next token, without
a broker, a socket or a process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest

from tasks.engine.admission import (
    STRETCH,
    Expect,
    Running,
    Waiter,
    choose,
    expectation,
    is_step,
    most,
    outlook,
    priority,
    reserved,
    shifted,
    total,
    unit_priority,
)


def _next(
    waiting: Sequence[Waiter],
    running: Sequence[Running] = (),
    *,
    slots: int = 8,
    budget_mb: float | None = None,
    available_mb: float | None = None,
    building: Mapping[str, float] | None = None,
) -> str | None:
    """The package and seq of the waiter :func:`choose` admits (``pkg#seq``), None for none."""
    found = choose(
        waiting, running, slots=slots, budget_mb=budget_mb, available_mb=available_mb, building=building or {}
    )
    return None if found is None else f"{found.package}#{found.seq}"


def test_a_unit_waits_by_its_package_priority_plus_its_own_seconds() -> None:
    fa3 = {"flash_fwd_hdimall_bf16_sm90.o": 650.0, "flash_fwd_combine.o": 120.0}
    fa2 = {"flash_bwd_hdim128_bf16_sm80.o": 820.0, "flash_api.o": 60.0}
    fa3_prio, fa2_prio = 1310.0, 1284.0  # the default profile's, on 64 slots: FA3 ranks a little higher
    long_fa2 = unit_priority(fa2, "flash_bwd_hdim128_bf16_sm80.o", fa2_prio)
    assert long_fa2 == fa2_prio + 820.0
    assert long_fa2 > unit_priority(fa3, "flash_fwd_combine.o", fa3_prio)
    assert unit_priority(fa3, "flash_fwd_hdimall_bf16_sm90.o", fa3_prio) > unit_priority(
        {"flash_fwd_split.o": 640.0}, "flash_fwd_split.o", fa2_prio
    )  # of two units nearly as long, the one of the package that ranks higher
    # A preprocessor run ranks as the compile it precedes, plus its own seconds.
    assert unit_priority(fa2, "flash_bwd_hdim128_bf16_sm80.cu.E", fa2_prio) == fa2_prio + 820.0
    assert unit_priority({**fa2, "flash_api.cpp.E": 2.0}, "flash_api.cpp.E", fa2_prio) == fa2_prio + 62.0
    assert unit_priority({"core.cu.o": 30.0}, "core.cu.E", 5.0) == 35.0  # CMake's naming
    # A unit without a time (a configure check, a new source) ranks as its package's longest, not last.
    assert unit_priority(fa2, "cmTC_1f5dd", fa2_prio) == fa2_prio + 820.0
    assert unit_priority(fa2, "new_kernel.cu.E", fa2_prio) == fa2_prio + 820.0
    assert unit_priority({}, "x.o", 0.0) == 0.0  # no records at all: after every package that has them


def test_a_package_claims_tokens_by_its_longest_unit_plus_its_work_over_the_budget() -> None:
    # TransformerEngine's shape: one 230 s unit among short ones; apex's: many units of similar length.
    te = {"cast_transpose_fusion.o": 230.0, **{f"t{i}.o": 20.0 for i in range(10)}}
    apex = {f"a{i}.o": 40.0 for i in range(20)}
    assert priority(te, 16) == round(230 + 430 / 16, 1) == 256.9
    assert priority(apex, 16) == 90.0
    assert priority(te, 16) > priority(apex, 16)
    assert priority({}, 16) == 0.0  # no records: after every package that has them
    assert priority({"a.o": 10.0}, 0) == 20.0  # no slots counts as one


def test_the_waiter_of_the_highest_priority_goes_first_then_first_come() -> None:
    waiting = [
        Waiter("apex", 90.0, 1, Expect(100)),
        Waiter("te", 256.9, 3, Expect(100)),
        Waiter("te", 256.9, 2, Expect(100)),
        Waiter("fa3", 0.0, 0, Expect(100)),
    ]
    assert _next(waiting) == "te#2"
    assert _next([w for w in waiting if w.package != "te"]) == "apex#1"
    assert _next([Waiter("b", 5.0, 7, Expect(1)), Waiter("a", 5.0, 4, Expect(1))]) == "a#4"
    # A unit killed for memory and run once more (the broker gives it infinite priority) goes before all.
    assert _next([*waiting, Waiter("fa3", float("inf"), 9, Expect(100))]) == "fa3#9"
    assert _next([]) is None


def test_a_short_unit_its_package_waits_on_alone_goes_first() -> None:
    """The 16-core H200 host, with apex's records ranking it (490.9) above TransformerEngine (446.3): TE's
    CMake checks, one after another, each its package's only unit, waited 72 s for their first token behind
    apex's units. A short unit (admission.is_step) that its package waits on alone, running no compile,
    now goes before them; not where its package runs a compile or asks for others (a batch keeps its
    order by priority), not a long unit, and not before a unit run once more after it was killed."""
    apex_running = [Running("apex", 100.0) for _ in range(15)]
    apex_waiting = [Waiter("apex", 490.9 + 120.0, i, Expect(100)) for i in range(1, 4)]
    check = Waiter("te", 446.3 + 2.1, 9, Expect(185), step=True)
    assert _next([*apex_waiting, check], apex_running, slots=16) == "te#9"
    # Where TE runs a compile, or asks for another unit beside it, the line keeps its order.
    assert _next([*apex_waiting, check], [*apex_running[:14], Running("te", 100.0)], slots=16) == "apex#1"
    other = Waiter("te", 446.3 + 100.0, 10, Expect(100))
    assert _next([*apex_waiting, check, other], apex_running, slots=16) == "apex#1"
    # A long unit (not a step) of a package that runs nothing waits by its priority as before.
    assert _next([*apex_waiting, Waiter("te", 446.3 + 100.0, 9, Expect(100))], apex_running, slots=16) == "apex#1"
    # A unit killed for memory and run once more still goes first.
    assert _next([*apex_waiting, check, Waiter("fa3", float("inf"), 11, Expect(100))], apex_running, slots=16) == (
        "fa3#11"
    )


def test_a_serial_steps_unit_is_short_by_its_record_or_one_of_cmakes_checks() -> None:
    times = {"CMakeCUDACompilerId.cu": 2.1, "helpers_cpp.so": 0.2, "helpers.o": 9.2, "cast.cu.o": 120.0}
    assert is_step(times, "CMakeCUDACompilerId.cu") and is_step(times, "helpers_cpp.so")
    assert not is_step(times, "helpers.o") and not is_step(times, "cast.cu.o")
    # CMake's configure checks by their names, without a record (the lock's hints hold compiles only), as
    # the broker saw TE's on the H200 host:
    for check in ("cmTC_effe4", "CMakeCUDACompilerId.cu", "CMakeCXXCompilerABI.cpp.o", "CMakeCUDACompilerABI.cu.E",
                  "src.cxx.o", "src.cxx.E", "-.E", "tmpxft_000003d6_00000000-2.cpp.E"):  # fmt: skip
        assert is_step({}, check), check
    assert not is_step({}, "new_source.cu.o")  # unknown: not taken for short
    assert not is_step({}, "src.cpp.o") and not is_step({}, "CMakeLists.o")
    # Named like a check, recorded long: a package's own kernel (src.cu), not a step to put first.
    assert not is_step({"src.cu.o": 300.0}, "src.cu.o") and not is_step({"cmTC_1": 40.0}, "cmTC_1")
    assert is_step({"src.cu.o": 1.0}, "src.cu.o")


def test_the_last_token_is_kept_for_the_top_package_while_it_runs_no_compile() -> None:
    building = {"te": 256.9, "apex": 90.0}
    apex_running = [Running("apex", 100.0) for _ in range(3)]
    apex_waiting = [Waiter("apex", 90.0, 1, Expect(100))]
    # Three of four slots taken by apex, TransformerEngine between compiles: the fourth waits for it.
    assert _next(apex_waiting, apex_running, slots=4, building=building) is None
    assert _next([*apex_waiting, Waiter("te", 256.9, 2, Expect(100))], apex_running, slots=4, building=building) == (
        "te#2"
    )
    # Below the last token apex takes what is free.
    assert _next(apex_waiting, apex_running[:2], slots=4, building=building) == "apex#1"
    # While TransformerEngine runs a compile of its own, the others may take every other token.
    assert _next(apex_waiting, [*apex_running[:2], Running("te", 100.0)], slots=4, building=building) == "apex#1"
    # Not on fewer than four slots, not once the top package has finished, not without any priority.
    assert _next(apex_waiting, apex_running[:2], slots=3, building=building) == "apex#1"
    assert _next(apex_waiting, apex_running, slots=4, building={"apex": 90.0}) == "apex#1"
    assert _next(apex_waiting, apex_running, slots=4, building={"te": 0.0, "apex": 0.0}) == "apex#1"
    assert _next(apex_waiting, apex_running, slots=4, building={"te": 0.0}) == "apex#1"  # a top of 0 is none
    # Packages tied at the top share the kept token.
    tied = {"te": 256.9, "fa2": 256.9, "apex": 90.0}
    assert _next([Waiter("fa2", 256.9, 5, Expect(100))], apex_running, slots=4, building=tied) == "fa2#5"
    assert _next(apex_waiting, [*apex_running[:2], Running("fa2", 100.0)], slots=4, building=tied) == "apex#1"


def test_a_unit_starts_only_where_its_peak_fits_beside_what_the_running_ones_are_counted_for() -> None:
    running = [Running("fa3", 250.0, live_mb=250.0)]
    assert _next([Waiter("fa3", 1.0, 1, Expect(340))], running, budget_mb=600) == "fa3#1"
    assert _next([Waiter("fa3", 1.0, 1, Expect(360))], running, budget_mb=600) is None
    # Without a memory budget (memory=job, or tokens only) the peak does not matter.
    assert _next([Waiter("fa3", 1.0, 1, Expect(99999))], running, budget_mb=None) == "fa3#1"
    # With nothing running, a unit larger than the whole budget runs alone.
    assert _next([Waiter("fa3", 1.0, 1, Expect(99999))], [], budget_mb=600) == "fa3#1"


def test_a_unit_that_does_not_fit_is_not_overtaken_by_lighter_ones_that_would_take_its_room() -> None:
    running = [Running("fa3", 250.0, live_mb=250.0)]
    heavy_first = [Waiter("fa3", 1.0, 1, Expect(400)), Waiter("fa3", 1.0, 2, Expect(50))]
    # 350 MB free: the heavy unit waits, and the light one behind it would eat into its room.
    assert _next(heavy_first, running, budget_mb=600) is None
    # First in line, the light unit goes as any unit that fits.
    light_first = [Waiter("fa3", 1.0, 1, Expect(50)), Waiter("fa3", 1.0, 2, Expect(400))]
    assert _next(light_first, running, budget_mb=600) == "fa3#1"


def test_units_behind_pass_where_the_host_holds_the_first_back_and_they_leave_its_room_free() -> None:
    running = [Running("fa3", 100.0, live_mb=100.0)]
    # The budget has 900 MB free, the host 500: a 600 MB unit waits for the host, a 200 MB one behind it
    # passes (600 + 200 leave the budget's room), a 400 MB one does not (600 + 400 > 900).
    head = Waiter("fa3", 1.0, 1, Expect(600))
    assert _next([head], running, budget_mb=1000, available_mb=500) is None
    assert _next([head, Waiter("fa3", 1.0, 2, Expect(400))], running, budget_mb=1000, available_mb=500) is None
    assert _next([head, Waiter("fa3", 1.0, 3, Expect(200))], running, budget_mb=1000, available_mb=500) == "fa3#3"
    assert _next([head], running, budget_mb=1000, available_mb=None) == "fa3#1"  # MemAvailable unknown


def test_what_the_host_has_left_is_less_what_the_running_units_may_still_grow_by() -> None:
    # Counted for 400 MB (its expected peak), holding 100 now: it may still take 300 of the host's 600.
    growing = [Running("fa3", reserved(Expect(400), 100.0, False), live_mb=100.0)]
    assert _next([Waiter("te", 1.0, 1, Expect(300))], growing, budget_mb=10000, available_mb=600) == "te#1"
    assert _next([Waiter("te", 1.0, 1, Expect(301))], growing, budget_mb=10000, available_mb=600) is None


def test_a_running_unit_counts_its_peak_then_its_rest_or_what_it_holds_if_more() -> None:
    cicc = Expect(peak_mb=20000, peak_in="cicc", after_mb=1500)
    assert reserved(cicc, 300.0, past=False) == 20000  # before and while cicc runs: its peak
    assert reserved(cicc, 300.0, past=True) == 1500  # cicc has ended: only the recorded rest
    assert reserved(cicc, 2500.0, past=True) == 2500  # holding more than that: what it holds
    assert reserved(cicc, 26000.0, past=False) == 26000  # grown beyond its record: what it holds
    assert reserved(Expect(8000), 300.0, past=True) == 8000  # no rest on record: the peak for all of it
    # The room the rest frees is the room the next unit gets.
    budget = 24000.0
    waiting = [Waiter("fa3", 1.0, 2, Expect(20000))]
    assert _next(waiting, [Running("fa3", reserved(cicc, 300.0, False), 300.0)], budget_mb=budget) is None
    assert _next(waiting, [Running("fa3", reserved(cicc, 300.0, True), 300.0)], budget_mb=budget) == "fa3#2"


# --------------------------------------------------------------------------- a peak at its time (issue 41)

#: A unit of 100 s whose gate timed its peak: 50 MB until 20 s, at least half of 400 MB from 20 s to 30 s,
#: 60 MB after. Charged by the clock, with STRETCH's margin: its peak from 13.3 s to 45 s.
BRIEF = Expect(peak_mb=400, peak_in="cicc", after_mb=60, before_mb=50, peak_from_s=20, peak_for_s=10)


def test_a_record_with_its_peak_timed_is_read_and_a_hostile_one_is_not() -> None:
    found = expectation(
        {"peak_mb": 400, "peak_in": "cicc", "after_mb": 60, "before_mb": 50, "peak_from_s": 20, "peak_for_s": 10},
        default_mb=1000,
    )
    assert found == BRIEF and found.timed
    assert not expectation({"peak_mb": 400}, 1000).timed
    # Values of another type, NaN, infinity, negative: no figure (the peak falls back to the default).
    hostile = {"peak_mb": float("nan"), "after_mb": True, "before_mb": "50", "peak_from_s": -1, "peak_for_s": 1e999}
    assert expectation(hostile, 1000) == Expect(1000)
    assert expectation({"peak_mb": 400, "peak_in": ["cicc"]}, 1000) == Expect(400)


def test_a_timed_unit_is_charged_its_peak_only_around_the_time_it_comes() -> None:
    assert outlook(BRIEF) == ((0.0, 50), (pytest.approx(20 / STRETCH), 400), (pytest.approx(30 * STRETCH), 60))
    assert outlook(BRIEF, elapsed_s=10, live_mb=40) == ((0.0, 50), (pytest.approx(20 / STRETCH - 10), 400),
                                                        (pytest.approx(35.0), 60))  # fmt: skip
    assert outlook(BRIEF, elapsed_s=30, live_mb=100) == ((0.0, 400), (pytest.approx(15.0), 60))
    assert outlook(BRIEF, elapsed_s=60, live_mb=70) == ((0.0, 70),)  # past it: its rest, or what it holds
    # Holding half its peak early (a host faster than the record's): in its peak now, for its span and margin.
    assert outlook(BRIEF, elapsed_s=5, live_mb=250) == ((0.0, 400), (pytest.approx(45.0 - 5), 60))
    # Still holding half its peak long after its record (a slower host): its peak now and for a while more.
    late = outlook(BRIEF, elapsed_s=80, live_mb=300, high_since_s=70)
    assert late[0] == (0.0, 400) and late[1][1] == 60 and late[1][0] >= 5
    # Without timing, the rule as before: its peak, or its rest once its peak process has ended.
    assert outlook(Expect(400, "cicc", 60), elapsed_s=60, live_mb=70) == ((0.0, 400),)
    assert outlook(Expect(400, "cicc", 60), elapsed_s=60, live_mb=70, past=True) == ((0.0, 70),)


def test_units_whose_peaks_are_brief_and_past_leave_room_that_a_whole_life_peak_would_take() -> None:
    """Three units past their brief peaks hold 60 MB each: a fourth (400 MB) fits in 600 MB. Charged their
    peaks for their whole lives, as before, they left no room for it."""
    waiting = [Waiter("fa3", 1.0, 9, BRIEF)]
    past = [Running("fa3", 60, 60, outlook(BRIEF, elapsed_s=60, live_mb=60)) for _ in range(3)]
    assert _next(waiting, past, budget_mb=600) == "fa3#9"
    whole = [Running("fa3", 400, 60) for _ in range(3)]
    assert _next(waiting, whole, budget_mb=600) is None


def test_a_unit_starts_only_where_its_peak_and_the_running_ones_do_not_meet_ahead() -> None:
    """Both hold 50 MB now. A unit started 1 s ago peaks at the same time as a new one would: 800 MB in
    600, so it waits. Started 50 s ago, its peak is over before the new one's comes: it starts."""
    waiting = [Waiter("fa3", 1.0, 9, BRIEF)]
    young = outlook(BRIEF, elapsed_s=1, live_mb=50)
    assert _next(waiting, [Running("fa3", young[0][1], 50, young)], budget_mb=600) is None
    assert _next(waiting, [Running("fa3", young[0][1], 50, young)], budget_mb=800) == "fa3#9"
    old = outlook(BRIEF, elapsed_s=40, live_mb=150, high_since_s=20)
    assert old[0][1] == 400  # in its peak now, ending 5 s from now; the new one's comes in 13 s
    assert _next(waiting, [Running("fa3", old[0][1], 150, old)], budget_mb=600) == "fa3#9"


def test_units_behind_a_waiting_one_fill_the_slots_until_it_is_expected_to_fit() -> None:
    """FA3's unit (500 MB, untimed) waits: the running unit is at its peak (400 of 600 MB), expected past it
    (60 MB) 20 s from now, when FA3's unit fits. FA2's unit behind it peaks now (150 MB) and holds 30 MB from
    15 s on: it leaves FA3's room from then, so it starts (the slot would have idled). One that holds 150 MB
    after its peak would take that room: it waits, as does one whose peak comes after FA3's unit starts."""
    running = [Running("fa3", 400, 300, outlook(BRIEF, elapsed_s=25, live_mb=300, high_since_s=20))]
    head = Waiter("fa3", 9.0, 1, Expect(500))
    quick = Expect(peak_mb=150, after_mb=30, before_mb=150, peak_from_s=0, peak_for_s=10)
    assert _next([head, Waiter("fa2", 1.0, 2, quick)], running, budget_mb=600) == "fa2#2"
    heavy_rest = Expect(peak_mb=150, after_mb=150, before_mb=150, peak_from_s=0, peak_for_s=10)
    assert _next([head, Waiter("fa2", 1.0, 2, heavy_rest)], running, budget_mb=600) is None
    late_peak = Expect(peak_mb=150, after_mb=10, before_mb=10, peak_from_s=60, peak_for_s=10)
    assert _next([head, Waiter("fa2", 1.0, 2, late_peak)], running, budget_mb=600) is None
    # Where the running unit is not expected past its peak (no timing), FA3's whole peak is kept.
    flat = [Running("fa3", 400, 300)]
    assert _next([head, Waiter("fa2", 1.0, 2, quick)], flat, budget_mb=600) is None


def test_admission_holds_back_while_the_host_runs_high() -> None:
    """The budget has room, the host (MemAvailable) has not: a timed unit's peak ahead counts against what
    the host has left, less the running units' growth and the headroom kept free."""
    now = outlook(BRIEF, elapsed_s=1, live_mb=50)
    running = [Running("fa3", now[0][1], 50, now)]  # 350 MB still to come, 12 s from now
    waiting = [Waiter("te", 1.0, 1, Expect(200))]
    assert _next(waiting, running, budget_mb=10_000, available_mb=600) == "te#1"
    assert _next(waiting, running, budget_mb=10_000, available_mb=549) is None
    found = choose(waiting, running, slots=8, budget_mb=10_000, available_mb=600, building={}, headroom_mb=100)
    assert found is None
    assert _next(waiting, running, budget_mb=10_000, available_mb=None) == "te#1"


def test_step_sums() -> None:
    a = ((0.0, 50.0), (10.0, 400.0), (20.0, 60.0))
    b = ((0.0, 100.0), (15.0, 0.0))
    assert total([a, b]) == ((0.0, 150.0), (10.0, 500.0), (15.0, 400.0), (20.0, 60.0))
    assert most(a, b) == 500 and most(a, b, since=16) == 400
    assert shifted(b, 5) == ((0.0, 0.0), (5.0, 100.0), (20.0, 0.0))
    assert total([]) == ((0.0, 0.0),)
