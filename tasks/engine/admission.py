"""Which compile runs next: the run's admission policy, as pure functions.

The broker (tasks/engine/jobserver.py) keeps the sockets, the token fifo and the
selector loop; each time a token may be handed out it asks :func:`choose`
which waiting compile gets it. The rules, in the order they apply:

1. the package that sets the run's wall time, and its longest compiles: waiters
   line up by their package's :func:`priority` plus their own recorded seconds
   (:func:`unit_priority`; a compile killed for memory and run once more goes
   first of all, and a short unit that its package waits on alone, running no
   compile, a serial step's, before the others), then first come;
2. the held token: while the package of the highest priority builds and runs
   no compile, the last free token is kept for it (four slots or more);
3. memory: a compile starts only when what it is expected to hold (:class:`Expectations`), from now on,
   fits in the budget beside what the running ones hold or are expected to hold (:func:`outlook`: where
   the records say when a unit's peak comes and for how long, its peak only then, else its peak for all
   of it or until its peak process has ended, :func:`reserved`), and in what the host really has left; a
   compile that does not fit waits, and those behind it start only where they leave its room free from
   when it is expected to fit. Alone, any compile runs.

No sockets, processes or threads: tests/unit/test_admission.py calls these
with plain values; the forecast (tasks/engine/forecast.py) calls :func:`choose` on a simulated clock.
"""

from __future__ import annotations

import bisect
import collections
import fnmatch
import functools
import heapq
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from tasks.outside.gate import HIGH_SHARE as HIGH_SHARE  # (the gate times the peak by it: one figure)

#: What a preprocessor-only run (ccache's, nvcc -E) is expected to hold without a record of its own.
PREPROCESS_MB = 2048.0
#: How far a unit's recorded timing is trusted: its peak is expected from its recorded start divided by this
#: to its recorded end times this (a loaded host, a cold page cache, another host's records).
STRETCH = 1.5

#: What a unit is expected to hold from now on: ``(seconds from now, MB)`` steps, the first at 0, each held
#: until the next; the last for as long as the unit runs.
Steps = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Expect:
    """What the broker expects a unit to hold (MB): its peak, the process the peak comes in (cicc), and what
    it holds after its peak (None: unknown, so the peak is kept for all of the unit).

    Where the gate timed the unit's peak (``timed``): it held less than half its peak (``HIGH_SHARE``) until
    ``peak_from_s`` seconds into the unit, at most ``before_mb``; at least half of it for ``peak_for_s``
    seconds; and at most ``after_mb`` after that. Without timing, ``after_mb`` is what it holds once the
    process its peak came in (``peak_in``) has ended."""

    peak_mb: float
    peak_in: str = ""
    after_mb: float | None = None
    before_mb: float | None = None
    peak_from_s: float | None = None
    peak_for_s: float | None = None

    @property
    def timed(self) -> bool:
        return self.before_mb is not None and self.peak_from_s is not None and self.peak_for_s is not None


def _figure(value: object) -> float | None:
    """A record's number: finite and not negative (a bool, a string, NaN or 1e999 is none)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def expectation(found: Mapping[str, object] | None, default_mb: float) -> Expect:
    """An :class:`Expect` from a record or hint (``peak_mb``, ``peak_in``, ``after_mb``; ``before_mb``,
    ``peak_from_s``, ``peak_for_s`` where the peak was timed), else the default."""
    if not found:
        return Expect(default_mb)
    peak = _figure(found.get("peak_mb"))
    after = _figure(found.get("after_mb"))
    peak_in = found.get("peak_in")
    return Expect(
        peak_mb=peak if peak else default_mb,
        peak_in=peak_in if isinstance(peak_in, str) else "",
        after_mb=after if after else None,
        before_mb=_figure(found.get("before_mb")),
        peak_from_s=_figure(found.get("peak_from_s")),
        peak_for_s=_figure(found.get("peak_for_s")),
    )


@dataclass(frozen=True)
class Expectations:
    """A package's expectations: the cache's records by unit, the lock's hints by unit or pattern, a default."""

    records: dict[str, dict[str, object]]
    hints: dict[str, dict[str, object]]
    default_mb: float

    def expect(self, unit: str) -> Expect:
        """The cache's record of ``unit``, else the lock's hint (by name, then the first matching pattern),
        capped at the package's ``mem_per_job_gb`` (a profile that builds less, FA3's ``minimal``, states
        less), else that figure."""
        if unit in self.records:
            return expectation(self.records[unit], self.default_mb)
        hint = self.hints.get(unit)
        if hint is None:
            hint = next((v for k, v in self.hints.items() if fnmatch.fnmatchcase(unit, k)), None)
        if hint is not None:
            found = expectation(hint, self.default_mb)
            if found.peak_mb <= self.default_mb:
                return found
            cap = self.default_mb
            return replace(
                found,
                peak_mb=cap,
                after_mb=min(found.after_mb or cap, cap),
                before_mb=None if found.before_mb is None else min(found.before_mb, cap),
            )
        if unit.endswith(".E"):  # a preprocessor run: seconds, hundreds of MB
            return Expect(min(self.default_mb, PREPROCESS_MB))
        return Expect(self.default_mb)


def priority(times: Mapping[str, float], slots: int) -> float:
    """A package's claim on the run's tokens: its recorded critical path, its longest compile unit, plus
    its work spread over the budget (tasks/outside/ninjaorder.py records unit times; patches/<pkg>/ holds hints
    for an empty cache). Packages without records get 0: after every package that has them."""
    if not times:
        return 0.0
    return round(max(times.values()) + sum(times.values()) / max(1, slots), 1)


def compile_of(preprocess: str, units: Iterable[str]) -> str | None:
    """The compile a preprocessor run (``core.cpp.E``, the object cache's) precedes among ``units``: ``core.o``
    or ``core.cpp.<something>``, the first by name; None if none is there."""
    source = preprocess[: -len(".E")]
    stem = source.rsplit(".", 1)[0]
    found = (n for n in sorted(units) if n != preprocess and (n == f"{stem}.o" or n.startswith(f"{source}.")))
    return next(found, None)


def unit_priority(times: Mapping[str, float], unit: str, package_priority: float) -> float:
    """A compile's place in line among every package's waiting compiles: its package's :func:`priority` plus
    its own recorded seconds. Within a package the longest unit goes first; across packages a long unit of
    one is not left behind the short units of another that ranks a little higher (FA2's 800-second units
    behind FA3's two-minute ones, when FA3's priority is 1310 and FA2's 1284). A preprocessor run
    (``core.cu.E``, the object cache's) ranks as the compile it precedes (``core.o``, ``core.cu.o``) plus its
    own seconds; a unit without a time (a new source, CMake's configure checks) as the package's longest:
    unknown work is not put last."""
    own = None
    if unit.endswith(".E"):
        target = compile_of(unit, times)
        if target is not None:
            own = float(times[target]) + float(times.get(unit, 0.0))
    elif unit in times:
        own = float(times[unit])
    if own is None:
        own = max((float(t) for t in times.values()), default=0.0)
    return package_priority + own


def reserved(expect: Expect, live_mb: float, past: bool) -> float:
    """The memory counted for a running unit without timing: what it holds (``live_mb``), or more, what it is
    expected to reach: its peak, or once the process its peak comes in has ended (``past``), its recorded
    rest."""
    rest = expect.after_mb if past and expect.after_mb is not None else expect.peak_mb
    return max(live_mb, rest)


def outlook(
    expect: Expect,
    *,
    elapsed_s: float = 0.0,
    live_mb: float = 0.0,
    past: bool = False,
    high_since_s: float | None = None,
) -> Steps:
    """What a unit ``elapsed_s`` seconds into its run is expected to hold from now on (:data:`Steps`).

    Without timing on record, :func:`reserved` for as long as it runs. With it (:attr:`Expect.timed`): its
    ``before_mb`` until its peak is due, its peak while it is, its ``after_mb`` (else its peak) after. The
    peak is due from its recorded start divided by :data:`STRETCH` to its recorded end times it, or from
    when the unit first held half its peak (``high_since_s``, or now where ``live_mb`` is that much) for
    its recorded span times :data:`STRETCH`; a unit holding half its peak past all that is expected to hold
    it for half its span more. What it holds now, if more, is what it is counted for now.
    """
    if not expect.timed:
        return ((0.0, reserved(expect, live_mb, past)),)
    assert expect.before_mb is not None and expect.peak_from_s is not None and expect.peak_for_s is not None
    peak = expect.peak_mb
    after = expect.after_mb if expect.after_mb is not None else peak
    span = expect.peak_for_s
    start = expect.peak_from_s / STRETCH
    end = (expect.peak_from_s + span) * STRETCH
    if live_mb >= HIGH_SHARE * peak:  # holding half its peak now: it is in its peak, whatever the clock says
        high_since_s = elapsed_s if high_since_s is None else min(high_since_s, elapsed_s)
        end = max(end, elapsed_s + span * (STRETCH - 1))
    if high_since_s is not None:
        start = min(start, high_since_s)
        end = max(end, high_since_s + span * STRETCH)
    if elapsed_s < start:
        steps = [(0.0, expect.before_mb), (start - elapsed_s, peak), (end - elapsed_s, after)]
    elif elapsed_s < end:
        steps = [(0.0, peak), (end - elapsed_s, after)]
    else:
        steps = [(0.0, after)]
    steps[0] = (0.0, max(live_mb, steps[0][1]))
    return _tidy(steps)


def _tidy(steps: Iterable[tuple[float, float]]) -> Steps:
    """``steps`` without a step that repeats the one before it."""
    out: list[tuple[float, float]] = []
    for start, mb in steps:
        if out and out[-1][0] == start:
            out[-1] = (start, mb)
            if len(out) > 1 and out[-2][1] == mb:
                out.pop()
        elif not out or out[-1][1] != mb:
            out.append((start, mb))
    return tuple(out)


def total(outlooks: Iterable[Steps]) -> Steps:
    """The sum of several units' :data:`Steps`."""
    deltas: dict[float, float] = {0.0: 0.0}
    for steps in outlooks:
        before = 0.0
        for start, mb in steps:
            deltas[start] = deltas.get(start, 0.0) + mb - before
            before = mb
    held = 0.0
    out = []
    for start in sorted(deltas):
        held += deltas[start]
        out.append((start, held))
    return _tidy(out)


def most(*parts: Steps, since: float = 0.0) -> float:
    """The most ``parts`` hold together at any time from ``since`` seconds from now on (one pass over their
    steps, merged in time: the broker asks this of every waiting unit, each time it may admit one)."""
    held = [0.0] * len(parts)
    together = 0.0
    found = 0.0
    changes = list(heapq.merge(*([(start, i, mb) for start, mb in steps] for i, steps in enumerate(parts))))
    for k, (start, i, mb) in enumerate(changes):
        together += mb - held[i]
        held[i] = mb
        last_at_start = k + 1 == len(changes) or changes[k + 1][0] != start
        if last_at_start and (start >= since or k + 1 == len(changes) or changes[k + 1][0] > since):
            found = max(found, together)
    return found


def shifted(steps: Steps, by: float) -> Steps:
    """``steps`` of a unit that starts ``by`` seconds from now (nothing held until then)."""
    return _tidy([(0.0, 0.0), *((start + by, mb) for start, mb in steps)]) if by > 0 else steps


@dataclass(frozen=True)
class Waiter:
    """A compile asking for a token: its package, its place in line (``priority``, highest first, then
    ``seq``, lowest first), the memory it is expected to reach, and whether it is a serial step's unit
    (:func:`is_step`)."""

    package: str
    priority: float
    seq: int
    expect: Expect
    step: bool = False


#: A unit recorded at this many seconds or fewer is a serial step's (CMake's compiler checks took 0.1 to
#: 2.1 s on the H200 host, megatron_core's link 0.2 s): while its package runs no compile, it goes first.
SERIAL_STEP_S = 5.0


#: The units of CMake's configure checks, by the names CMake gives them (a fresh host has no record of
#: them: the lock's hints hold compiles only): its try-compile targets (a new name each configure), its
#: compiler identification and ABI checks, a check's source (``src.cxx``), a preprocessor run on stdin and
#: nvcc's temporary files.
CONFIGURE_CHECKS = ("cmTC_*", "CMake*CompilerId*", "CMake*CompilerABI*", "src.c", "src.c.*", "src.cxx*", "src.cu*",
                    "-.E", "tmpxft_*")  # fmt: skip


def is_step(times: Mapping[str, float], unit: str) -> bool:
    """Whether ``unit`` is a serial step's: recorded (``times``) at :data:`SERIAL_STEP_S` or fewer, or, with no
    record, one of CMake's configure checks by its name (:data:`CONFIGURE_CHECKS`). A record says it first: a
    package's own ``src.cu`` is named like a check's source and may compile for minutes."""
    seconds = times.get(unit)
    if seconds is not None:
        return float(seconds) <= SERIAL_STEP_S
    return any(fnmatch.fnmatchcase(unit, pattern) for pattern in CONFIGURE_CHECKS)


@dataclass(frozen=True)
class Running:
    """A compile running on a token: its package, what is counted for it now and what it holds now, and what
    it is expected to hold from now on (its :func:`outlook`; empty: ``reserved_mb`` for as long as it runs)."""

    package: str
    reserved_mb: float
    live_mb: float = 0.0
    ahead: Steps = ()

    def steps(self) -> Steps:
        return self.ahead or ((0.0, self.reserved_mb),)

    def growth(self) -> Steps:
        """What it may still take beyond what it holds now, from now on."""
        return _tidy((start, max(0.0, mb - self.live_mb)) for start, mb in self.steps())


def _most_with(base: tuple[list[float], list[float]], steps: Steps) -> float:
    """:func:`most` of ``base`` (its steps' starts and MB, apart) and ``steps``, for a short ``steps`` beside
    a long ``base``: for each of ``steps``' spans, the most ``base`` holds in it (a slice's ``max``)."""
    starts, values = base
    found = 0.0
    for j, (start, mb) in enumerate(steps):
        lo = max(0, bisect.bisect_right(starts, start) - 1)  # the step of base holding at start
        hi = bisect.bisect_left(starts, steps[j + 1][0]) if j + 1 < len(steps) else len(starts)
        found = max(found, mb + max(values[lo : max(hi, lo + 1)], default=0.0))
    return found


@dataclass(frozen=True)
class Beside:
    """The running units together, from now on: what they are expected to hold (``held``, with the room kept
    for a unit that waits before the one asking), what they may still take beyond what they hold now
    (``growth``), and how many they are."""

    held: Steps
    growth: Steps
    count: int

    @classmethod
    def of(cls, running: Sequence[Running]) -> Beside:
        return cls(total(r.steps() for r in running), total(r.growth() for r in running), len(running))

    def keeping(self, kept: Steps) -> Beside:
        """The same, with the room ``kept`` for a unit that waits (:func:`kept_for`) held too."""
        return Beside(total([self.held, kept]), self.growth, self.count)

    @functools.cached_property
    def _held(self) -> tuple[list[float], list[float]]:
        return [start for start, _ in self.held], [mb for _, mb in self.held]

    @functools.cached_property
    def _growth(self) -> tuple[list[float], list[float]]:
        return [start for start, _ in self.growth], [mb for _, mb in self.growth]


def fits(
    steps: Steps,
    beside: Beside,
    *,
    budget_mb: float | None,
    available_mb: float | None,
    headroom_mb: float = 0.0,
) -> bool:
    """Whether a unit expected to hold ``steps`` from now on fits beside the running units, at every time
    ahead: in the budget, beside what they hold and the room kept for a unit that waits before it
    (:meth:`Beside.keeping`), and in what the host really has left (``available_mb``, MemAvailable, less
    what the running units may still grow by, less ``headroom_mb``)."""
    if budget_mb is None or not beside.count:
        return True  # no budget, or nothing else running: a unit larger than the budget runs alone
    if _most_with(beside._held, steps) > budget_mb:
        return False
    if available_mb is None:
        return True
    return _most_with(beside._growth, steps) <= available_mb - headroom_mb


def kept_for(head: Steps, beside: Beside, budget_mb: float) -> Steps:
    """The room kept for ``head``, a unit that waits for memory: what it is expected to hold from the first
    time ahead at which it would fit beside the running units (when one of them is expected past its peak),
    else its peak from now on. Units behind it start only where they leave that room free."""
    for start, _ in beside.held:
        if start > 0 and most(beside.held, shifted(head, start), since=start) <= budget_mb:
            return shifted(head, start)
    return ((0.0, most(head)),)


def _line(alone: set[str], w: Waiter) -> tuple[int, float, int]:
    """``w``'s place in line: a unit run once more after it was killed for memory first, then a serial
    step's unit (:func:`is_step`) of a package that runs no compile and has no other waiting (``alone``),
    then the rest; within each, by :func:`unit_priority`, then first come."""
    rank = 0 if math.isinf(w.priority) else 1 if w.step and w.package in alone else 2
    return rank, -w.priority, w.seq


def choose(
    waiting: Sequence[Waiter],
    running: Sequence[Running],
    *,
    slots: int,
    budget_mb: float | None,
    available_mb: float | None,
    building: Mapping[str, float],
    headroom_mb: float = 0.0,
) -> Waiter | None:
    """The waiter to admit next, if any: the first in line if it fits, else the first behind it that
    leaves the first one's room free from when that one is expected to fit (:func:`kept_for`).

    ``building`` maps each package whose build runs to its priority. A short unit (:func:`is_step`) that
    its package waits on alone, running no compile and asking for no other, is a serial step's (CMake's
    compiler checks one after another, a link): it goes before the others (:func:`_line`), so that the
    step waits for the next token that comes free, not for every unit of the packages above it. On the 16-core
    H200 host, with apex's records ranking it above TransformerEngine, TE's configure checks waited 72 s
    for their first token behind apex's units and about 100 s in all, and megatron_core's link 94 s.
    While the package of the highest priority builds and runs no compile, the last free token is also
    kept for it (on four slots or more): its serial steps then start at once, as TE's checks, which
    waited 27 s for a token without it. While it runs a compile, the other packages may take every
    other token.

    ``available_mb`` is the host's MemAvailable, where known (the broker reads it only with a budget and
    something running), of which ``headroom_mb`` stays free.
    """
    top = max(building.values(), default=0.0)
    first = {p for p, prio in building.items() if prio == top} if top > 0 else set()
    compiling = {r.package for r in running}
    keep = 1 if first and not first & compiling and slots >= 4 else 0
    asking = collections.Counter(w.package for w in waiting)
    alone = {p for p, n in asking.items() if n == 1 and p not in compiling}
    order = [
        w
        for w in sorted(waiting, key=functools.partial(_line, alone))
        if not keep or w.package in first or len(running) < slots - keep
    ]
    if not order:
        return None
    head = order[0]
    beside = Beside.of(running)
    ahead = outlook(head.expect)
    if fits(ahead, beside, budget_mb=budget_mb, available_mb=available_mb, headroom_mb=headroom_mb):
        return head
    if budget_mb is None:
        return None
    behind = beside.keeping(kept_for(ahead, beside, budget_mb))
    return next(
        (
            w
            for w in order[1:]
            if fits(outlook(w.expect), behind, budget_mb=budget_mb, available_mb=available_mb, headroom_mb=headroom_mb)
        ),
        None,
    )


@dataclass(frozen=True)
class Budget:
    """How many compiler jobs may run at once, and why."""

    slots: int
    reason: str


def plan_budget(
    *,
    cores: int,
    mem_gb: float | None,
    heaviest_gb: float,
    jobs: int | None,
    mem_source: str = "available",
    per_unit: bool = False,
) -> Budget:
    """The run's job budget: ``jobs`` (default: cores), lowered so that the heaviest
    package's jobs fit in memory (``mem_gb`` / ``heaviest_gb`` per job), unless the gate
    admits each unit against ``mem_gb`` by its own memory (``per_unit``)."""
    slots = jobs or cores
    reason = f"jobs={jobs}" if jobs else f"{cores} cores"
    if per_unit and mem_gb is not None:
        reason += f"; memory admitted per unit against {mem_gb:.0f} GB {mem_source}"
    elif mem_gb is not None and heaviest_gb > 0:
        fit = max(1, int(mem_gb // heaviest_gb))
        if fit < slots:
            slots = fit
            reason = f"{mem_gb:.0f} GB {mem_source} / {heaviest_gb:g} GB per job"
    return Budget(slots=max(1, slots), reason=reason)


def shard_packages(
    names: Sequence[str], shard: tuple[int, int], weights: Mapping[str, float] | None = None
) -> list[str]:
    """The packages of shard ``i`` of ``n``, from the lock alone, so every shard of a job agrees.

    Longest processing time first: packages by weight (their build's compile
    seconds, from the lock's ``unit-times.json`` files), heaviest first, each
    to the shard with the least weight so far, then the fewest packages, then
    the lowest number. Without weights this is round robin over the sorted names.
    """
    i, n = shard
    weights = weights or {}
    load = [(0.0, 0) for _ in range(n)]
    mine: list[str] = []
    for name in sorted(names, key=lambda x: (-weights.get(x, 0.0), x)):
        k = min(range(n), key=lambda j: (load[j][0], load[j][1], j))
        load[k] = (load[k][0] + weights.get(name, 0.0), load[k][1] + 1)
        if k == i - 1:
            mine.append(name)
    return sorted(mine)
