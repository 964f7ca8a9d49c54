"""The forecast: how long a run's builds take, from the build history, on the scheduler's own policy.

Pure at its core: :func:`simulate` plays a run on a simulated clock, asking tasks/engine/admission.py's
:func:`~tasks.engine.admission.choose` which waiting compile starts each time a slot frees, exactly as the
broker does (tasks/engine/jobserver.py); there is no second copy of the policy to keep in step. The
figures come from the history (tasks/store/history.py): each unit's seconds and expected memory, each
package's serial part (pip, CMake's configure, the link), or, without a record, the lock's hints. Where the
object cache's answer for each unit is known beforehand (:class:`UnitForecast`, from tasks/stages/units.py),
a unit that hits runs for what its hit takes, one that is preprocessed for its preprocessor run, and only
the units that compile for their compile.

Used by `doit plan` (tasks/cli/plan.py) and by a run itself, which prints its forecast beside what happened
(tasks/stages/context.py) and, as it goes, the time left by it (:func:`remaining`, tasks/engine/progress.py).
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.engine import admission
from tasks.store import history

if TYPE_CHECKING:
    from tasks.core.settings import Settings
    from tasks.lock.lockfile import Package


@dataclass(frozen=True)
class UnitWork:
    """One compile: its seconds and the memory the broker expects it to hold (MB: its peak, or, with
    ``expect``, when and how long, tasks/engine/admission.py's :class:`~tasks.engine.admission.Expect`)."""

    name: str
    seconds: float
    peak_mb: float = 0.0
    expect: admission.Expect | None = None

    def expected(self) -> admission.Expect:
        return self.expect if self.expect is not None else admission.Expect(self.peak_mb)


def holds(expect: admission.Expect, elapsed_s: float) -> float:
    """What a unit is taken to hold ``elapsed_s`` seconds into its run, in the forecast: its recorded
    ``before_mb``, peak and ``after_mb`` at their recorded times where timed, else its peak."""
    if not expect.timed:
        return expect.peak_mb
    assert expect.peak_from_s is not None and expect.peak_for_s is not None
    if elapsed_s < expect.peak_from_s:
        return expect.before_mb or 0.0
    if elapsed_s < expect.peak_from_s + expect.peak_for_s:
        return expect.peak_mb
    return expect.after_mb if expect.after_mb is not None else expect.peak_mb


@dataclass(frozen=True)
class PackageWork:
    """One package's build as the forecast sees it: serial seconds outside compiles (pip, CMake's configure,
    the link), its compile units, and its priority at the broker (admission.priority)."""

    name: str
    units: tuple[UnitWork, ...] = ()
    serial_s: float = 0.0
    priority: float = 0.0
    #: After its last unit: what its ninja ran without a job slot (the links), the longest of them.
    tail_s: float = 0.0
    #: Whether it takes one of doit's tasks while it runs (the running units :func:`remaining` plays as packages
    #: of their own take none: their package holds its task).
    task: bool = True


@dataclass(frozen=True)
class UnitForecast:
    """A package's units as its unit records predict them (tasks/stages/units.py): at the next build, each
    unit's name, seconds and the unit whose memory record the broker admits it by ("" for a hit, which runs
    no compiler); and at the build recorded, each unit's name and seconds (what its wall time held of them)."""

    next: tuple[tuple[str, float, str], ...]
    last: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class PackageForecast:
    start_s: float
    end_s: float
    units: int

    @property
    def wall_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class Forecast:
    """A run's forecast: its wall time (the last package's end), the most memory its running units are
    expected to hold at once, and each package's start and end (seconds after the run starts)."""

    wall_s: float
    peak_mb: float
    packages: Mapping[str, PackageForecast] = field(default_factory=dict)
    #: What :func:`simulate` played (the packages' work in doit's order, on ``slots``, ``budget_mb`` and ``tasks``):
    #: what :func:`remaining` plays again with what is done taken off.
    work: tuple[PackageWork, ...] = field(default=(), compare=False)
    slots: int = field(default=1, compare=False)
    budget_mb: float | None = field(default=None, compare=False)
    tasks: int = field(default=8, compare=False)


def simulate(work: Sequence[PackageWork], *, slots: int, budget_mb: float | None = None, tasks: int = 8) -> Forecast:
    """The broker's schedule of ``work`` (in doit's order) on ``slots`` job slots and ``budget_mb`` of memory.

    No clock, no processes. Each package starts when one of doit's ``tasks`` is free, runs its serial
    part, then offers its units longest first, at most ``slots`` at a time (ninja's ``-j``). Each time a
    slot is free, :func:`tasks.engine.admission.choose` picks the waiting unit that starts, with the
    packages that build and their priorities, the running units' expected memory and the budget, as it
    does for the broker. The host's free memory is not simulated: the running units are taken to hold
    what is expected of them (:func:`holds`, at its recorded times where the unit's peak was timed), and
    while units wait, the clock also stops where a running unit's expectation changes.
    """
    slots = max(1, slots)
    pending_start = list(range(len(work)))  # packages not started, doit's order
    started: set[int] = set()
    finished: set[int] = set()
    queue: dict[int, list[UnitWork]] = {}  # package -> its units not yet offered, longest first
    offered: dict[int, int] = {}  # package -> units offered (waiting or running)
    waiting: dict[int, tuple[int, UnitWork, admission.Waiter]] = {}  # seq -> (package, unit, as the policy sees it)
    running: list[tuple[float, int, int, float, admission.Expect]] = []  # heap of (end, seq, package, start, expect)
    events: list[tuple[float, int, int]] = []  # heap of (time, seq, package): serial part done
    start_at: dict[int, float] = {}
    pending_events: dict[int, int] = {}
    tailed: set[int] = set()
    end_at: dict[int, float] = {}
    names = [f"{i}:{w.name}" for i, w in enumerate(work)]  # the policy's package names, unique
    seq = 0
    now = 0.0
    peak = 0.0

    def start_packages() -> None:
        nonlocal seq
        while pending_start and (
            not work[pending_start[0]].task or sum(work[i].task for i in started - finished) < tasks
        ):
            i = pending_start.pop(0)
            started.add(i)
            start_at[i] = now
            queue[i] = sorted(work[i].units, key=lambda u: -u.seconds)
            offered[i] = 0
            seq += 1
            heapq.heappush(events, (now + max(0.0, work[i].serial_s), seq, i))
            pending_events[i] = 1

    def offer(i: int) -> None:
        nonlocal seq
        while queue.get(i) and offered[i] < slots:
            unit = queue[i].pop(0)
            seq += 1
            place = admission.unit_priority({unit.name: unit.seconds}, unit.name, work[i].priority)
            step = admission.is_step({unit.name: unit.seconds}, unit.name)
            waiter = admission.Waiter(names[i], place, seq, unit.expected(), step)
            waiting[seq] = (i, unit, waiter)
            offered[i] += 1

    def finish_if_done(i: int) -> None:
        nonlocal seq
        if i in finished or queue.get(i) or offered.get(i) or pending_events.get(i):
            return
        if work[i].tail_s > 0 and i not in tailed:  # its links, once its compiles are done
            tailed.add(i)
            seq += 1
            heapq.heappush(events, (now + work[i].tail_s, seq, i))
            pending_events[i] = 1
            return
        finished.add(i)
        end_at[i] = now

    def event(i: int) -> None:
        pending_events[i] -= 1
        offer(i)
        finish_if_done(i)

    def as_running() -> list[admission.Running]:
        """The running units as the policy sees them now."""
        found = []
        for _, _, i, start, expect in running:
            elapsed = now - start
            live = holds(expect, elapsed)
            high = expect.peak_from_s if expect.timed and live >= admission.HIGH_SHARE * expect.peak_mb else None
            ahead = admission.outlook(expect, elapsed_s=elapsed, live_mb=live, high_since_s=high)
            found.append(admission.Running(names[i], ahead[0][1], live, ahead))
        return found

    def grant() -> float | None:
        """Start what the policy admits now; when, while units still wait, a running unit's expectation
        changes next (None: not before a unit ends)."""
        nonlocal seq, peak
        while waiting and len(running) < slots:
            chosen = admission.choose(
                [w for _, _, w in waiting.values()],
                as_running(),
                slots=slots,
                budget_mb=budget_mb,
                available_mb=None,
                building={names[i]: work[i].priority for i in started if i not in finished},
            )
            if chosen is None:
                break
            i, unit, _ = waiting.pop(chosen.seq)
            seq += 1
            heapq.heappush(running, (now + max(0.0, unit.seconds), seq, i, now, unit.expected()))
            peak = max(peak, sum(r.reserved_mb for r in as_running()))
        if not waiting:
            return None
        changes = [start + t for _, _, _, start, expect in running for t in _changes(expect)]
        changes += [now + start for r in as_running() for start, _ in r.steps() if start > 0]
        return min((t for t in changes if t > now), default=None)

    start_packages()
    while True:
        # Everything that happens at `now`: serial parts that end, units that end, packages that start.
        while events and events[0][0] <= now:
            event(heapq.heappop(events)[2])
        while running and running[0][0] <= now:
            _, _, i, _, _ = heapq.heappop(running)
            offered[i] -= 1
            offer(i)
            finish_if_done(i)
        start_packages()
        while events and events[0][0] <= now:  # a package with nothing serial and no units
            event(heapq.heappop(events)[2])
        wake = grant()
        upcoming = [
            t for t in (events[0][0] if events else None, running[0][0] if running else None, wake) if t is not None
        ]
        if not upcoming:
            break
        now = min(upcoming)
    packages = {
        work[i].name: PackageForecast(
            start_s=start_at.get(i, 0.0), end_s=end_at.get(i, start_at.get(i, 0.0)), units=len(work[i].units)
        )
        for i in range(len(work))
    }
    return Forecast(
        wall_s=max((p.end_s for p in packages.values()), default=0.0),
        peak_mb=peak,
        packages=packages,
        work=tuple(work),
        slots=slots,
        budget_mb=budget_mb,
        tasks=tasks,
    )


def _changes(expect: admission.Expect) -> tuple[float, ...]:
    """The seconds into a unit at which :func:`holds` changes."""
    if not expect.timed:
        return ()
    assert expect.peak_from_s is not None and expect.peak_for_s is not None
    return (expect.peak_from_s, expect.peak_from_s + expect.peak_for_s)


#: What a unit still running past its recorded seconds is taken to need yet (:func:`remaining`): the figure does
#: not guess how late it will be; it stops falling while the unit runs on.
OVERDUE_S = 1.0


@dataclass(frozen=True)
class Seen:
    """What a run has seen of one package's build so far (tasks/engine/progress.py): the seconds since it
    started, the units that ended, those running with the seconds each has run (a preprocessor run
    ``core.cpp.E`` counts as its compile running), and whether the build has ended."""

    elapsed_s: float = 0.0
    done: frozenset[str] = frozenset()
    running: Mapping[str, float] = field(default_factory=dict)
    ended: bool = False


def remaining(forecast: Forecast | None, seen: Mapping[str, Seen]) -> Forecast | None:
    """What is left of the run ``forecast`` foresaw, by the same simulation, once ``seen`` (by package) is
    taken off: its ``wall_s`` is the seconds left, each package's ``end_s`` the seconds until it ends (a
    package that ended is not in it). None without a forecast (no history).

    A package not started is played as forecast. Of one building, the units that ended are gone; each
    running unit keeps its slot first (:func:`tasks.engine.admission.choose`'s first in line, as a unit
    run once more is) for its recorded seconds less those it has run, at least :data:`OVERDUE_S`; its other
    units wait as forecast; its serial part is what is left of it while none of its units has started
    (then none: the forecast plays it before the compiles), and it does not end before its running units.
    """
    if forecast is None:
        return None
    first: list[PackageWork] = []  # the running units, each a package of its own, first in line
    building: list[PackageWork] = []
    pending: list[PackageWork] = []
    owner: dict[str, str] = {}  # first's names -> their package
    for work in forecast.work:
        found = seen.get(work.name)
        if found is None:
            pending.append(work)
            continue
        if found.ended:
            continue
        units = {u.name: u for u in work.units}
        running: dict[str, float] = {}
        for name, ran in found.running.items():
            if name not in units and name.endswith(".E"):
                name = admission.compile_of(name, units) or name
            if name in units:  # (a unit the forecast does not know, a configure check, is in its serial part)
                running[name] = max(running.get(name, 0.0), ran)
        ahead = []
        for name, ran in sorted(running.items()):
            unit = _running_for(units[name], ran)
            ahead.append(unit.seconds)
            owner[f"{work.name} {name}"] = work.name
            first.append(PackageWork(f"{work.name} {name}", (unit,), priority=math.inf, task=False))
        left = tuple(u for u in work.units if u.name not in found.done and u.name not in running)
        began = running or any(u in units for u in found.done)
        serial = 0.0 if began else max(0.0, work.serial_s - found.elapsed_s)
        if not left:  # it waits for its running units, and it has not ended yet
            serial = max([serial, OVERDUE_S, *ahead])
        building.append(replace(work, units=left, serial_s=serial))
    rest = simulate(
        [*first, *building, *pending], slots=forecast.slots, budget_mb=forecast.budget_mb, tasks=forecast.tasks
    )
    packages: dict[str, PackageForecast] = {}
    for name, told in rest.packages.items():
        name = owner.get(name, name)
        was = packages.get(name)  # a package ends with its last running unit
        packages[name] = told if was is None or told.end_s > was.end_s else was
    return replace(rest, packages=packages)


def _running_for(unit: UnitWork, ran_s: float) -> UnitWork:
    """``unit`` ``ran_s`` seconds into its run: what it has left, and what it is expected to hold from now."""
    expect = unit.expected()
    if expect.timed:
        assert expect.peak_from_s is not None and expect.peak_for_s is not None
        begin = expect.peak_from_s - ran_s
        end = begin + expect.peak_for_s
        expect = replace(expect, peak_from_s=max(0.0, begin), peak_for_s=max(0.0, end - max(0.0, begin)))
    return UnitWork(unit.name, max(unit.seconds - ran_s, OVERDUE_S), expect.peak_mb, expect)


def hint_range(seconds: Iterable[float], slots: int) -> tuple[float, float]:
    """What a package's compile units take on ``slots`` slots, bounded from their times alone: at least its
    longest unit and its work spread over every slot, at most Graham's bound for any list schedule (the
    work spread, plus the longest unit)."""
    times = [max(0.0, s) for s in seconds]
    if not times:
        return 0.0, 0.0
    spread = sum(times) / max(1, slots)
    return max(max(times), spread), spread + max(times)


def serial_seconds(record: Mapping[str, Any], units: Sequence[UnitWork], slots: int) -> float:
    """The seconds of a package's build outside its compile units, from its last build's record
    (tasks/store/history.py's ``record_build``): its wall time less the time its compiles ran or waited;
    where no ninja log placed the compiles in time, less its units as :func:`simulate` places them alone
    on its slots."""
    wall = float(record.get("wall_s") or 0.0)
    covered = record.get("compile_s")
    if isinstance(covered, int | float):
        return max(0.0, wall - float(covered))
    alone = simulate([PackageWork("alone", tuple(units))], slots=int(record.get("slots") or slots)).wall_s
    return max(0.0, wall - float(record.get("wait_s") or 0.0) - alone)


def split_units(
    times: Mapping[str, float], gated: Iterable[str], ninja: Sequence[str]
) -> tuple[dict[str, float], float]:
    """A package's recorded units as the forecast runs them: (compile units -> seconds, its tail).

    ``times``: every unit's seconds; ``gated``: those the gate ran (compiles, on a job slot); ``ninja``: the
    edges its ninja log had at its last build. A preprocessor run (``core.cpp.E``, ccache's) is added to its
    compile (``core.o``, ``core.cpp.o``), which it precedes. Where a ninja log and the gate both spoke, the
    compiles are the gated ninja edges; the edges the gate did not run (links) make the tail, the longest of
    them, after the compiles; gated units outside the ninja log (CMake's configure checks) are in the
    package's serial part already. Otherwise every unit is a compile.
    """
    gated = set(gated)
    merged = {u: t for u, t in times.items() if not u.endswith(".E")}
    for unit, seconds in times.items():
        if not unit.endswith(".E"):
            continue
        target = admission.compile_of(unit, merged)
        if target is not None:
            merged[target] += seconds
        else:
            merged[unit] = seconds
    if not ninja or not gated:
        return merged, 0.0
    edges = set(ninja)
    compiles = {u: t for u, t in merged.items() if u in edges and u in gated}
    tail = max((times.get(u, 0.0) for u in edges if u not in gated), default=0.0)
    return compiles, tail


def _recorded(cache_root: Path, package: str) -> tuple[dict[str, float], dict[str, dict[str, object]]]:
    """``package``'s recorded unit seconds (the gate's own where it measured them: compiling, not waiting in
    the gate) and memory."""
    memory = history.load_memory(history.memory_path(cache_root, package))
    recorded = history.load_times(history.times_path(cache_root, package))
    for unit, found in memory.items():
        seconds = found.get("seconds")
        if isinstance(seconds, int | float) and "exit" not in found:
            recorded[unit] = float(seconds)
    return recorded, memory


def _ninja_units(record: Mapping[str, Any]) -> list[str]:
    ninja = record.get("ninja_units")
    return [str(u) for u in ninja] if isinstance(ninja, list) else []


def recorded_units(cache_root: Path, package: str) -> tuple[dict[str, float], dict[str, dict[str, object]]]:
    """What ``doit hints`` writes into the lock for ``package`` from this cache's records: the compile units
    of its last build as the forecast runs them (:func:`split_units`) with their seconds, and the memory
    record of each (its peak, and when it came where the gate timed it)."""
    recorded, memory = _recorded(cache_root, package)
    times, _tail = split_units(recorded, memory, _ninja_units(history.read_build(cache_root, package)))
    return times, {u: memory[u] for u in times if u in memory}


def package_work(
    cache_root: Path,
    patches_dir: Path,
    pkg: Package,
    *,
    slots: int,
    profile: str = "default",
    predicted: UnitForecast | None = None,
) -> tuple[PackageWork, str, tuple[float, float] | None]:
    """``pkg``'s work for the forecast, where its figures come from (``cache``, ``hints`` or ``none``) and,
    without a record of this cache, the range its lock's hints give (else None). The hints are the
    ``profile``'s (tasks/store/history.py ``hints_path``). With ``predicted`` (and a record of its last
    build), its units are those, at their predicted seconds."""
    default_mb = pkg.mem_per_job_gb * 1024
    recorded, memory = _recorded(cache_root, pkg.name)
    times_hints = history.hints_path(patches_dir / pkg.name, history.TIMES_HINTS_FILE, profile)
    hints = history.load_times(times_hints)
    record = history.read_build(cache_root, pkg.name)
    times, origin = (recorded, "cache") if recorded or record else (hints, "hints" if hints else "none")
    expect = admission.Expectations(
        records=memory,
        hints=history.load_memory(history.hints_path(patches_dir / pkg.name, history.MEMORY_HINTS_FILE, profile)),
        default_mb=default_mb,
    )
    tail = 0.0
    if origin == "cache":
        times, tail = split_units(times, memory, _ninja_units(record))
    units = tuple(UnitWork(u, s, expect.expect(u).peak_mb, expect.expect(u)) for u, s in sorted(times.items()))
    serial = serial_seconds(record, units, slots) if record else 0.0
    if predicted is not None and origin == "cache" and record:
        last = tuple(UnitWork(u, s, expect.expect(u).peak_mb, expect.expect(u)) for u, s in predicted.last)
        serial = serial_seconds(record, last, slots)
        units = tuple(
            UnitWork(u, s, expect.expect(m).peak_mb, expect.expect(m)) if m else UnitWork(u, s)
            for u, s, m in predicted.next
        )
    prio = admission.priority(history.known_times(cache_root, times_hints, pkg.name), slots)
    span = hint_range(hints.values(), slots) if origin != "cache" and hints else None
    return PackageWork(pkg.name, units, serial, prio, tail), origin, span


def run_budget(settings: Settings, building: Sequence[Package]) -> tuple[int, float | None]:
    """The run's job slots and memory budget (MB; None: tokens only), as a run's job server sizes them
    (without starting ninja to ask its version: memory=unit counts as per unit)."""
    from tasks.engine.admission import plan_budget
    from tasks.engine.broker import available_memory_gb

    mem = settings.mem_gb
    if mem is None:
        mem = available_memory_gb()
    per_unit = settings.memory == "unit"
    budget = plan_budget(
        cores=os.cpu_count() or 1,
        mem_gb=mem,
        heaviest_gb=max((p.mem_per_job_gb for p in building), default=0.0),
        jobs=settings.jobs,
        per_unit=per_unit,
    )
    return budget.slots, (mem * 1024 if per_unit and mem is not None else None)


def forecast_run(
    cache_root: Path,
    patches_dir: Path,
    settings: Settings,
    building: Sequence[Package],
    budget: tuple[int, float | None] | None = None,
    predicted: Mapping[str, UnitForecast] | None = None,
) -> tuple[Forecast, dict[str, tuple[str, Any]]]:
    """The forecast of building ``building`` with this cache's history and the lock's hints (on ``budget``:
    slots and MB, else :func:`run_budget`'s; ``predicted``: units predicted by package), and for each package
    where its figures come from and, without a record, its range from the lock's hints."""
    slots, budget_mb = budget or run_budget(settings, building)
    work, where = [], {}
    for pkg in building:
        w, origin, span = package_work(
            cache_root,
            patches_dir,
            pkg,
            slots=slots,
            profile=settings.profile,
            predicted=(predicted or {}).get(pkg.name),
        )
        work.append(w)
        where[pkg.name] = (origin, span)
    return simulate(work, slots=slots, budget_mb=budget_mb), where
