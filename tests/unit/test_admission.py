"""The run's admission policy (tasks/engine/admission.py): which waiting compile gets the next token, without
a broker, a socket or a process."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tasks.engine.admission import Expect, Running, Waiter, choose, priority, reserved


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
