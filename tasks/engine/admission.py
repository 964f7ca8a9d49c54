"""Which compile runs next: the run's admission policy, as pure functions.

The broker (tasks/engine/jobserver.py) keeps the sockets, the token fifo and the
selector loop; each time a token may be handed out it asks :func:`choose`
which waiting compile gets it. The rules, in the order they apply:

1. a token for the package that sets the run's wall time: waiters line up by
   their package's :func:`priority` (a compile killed for memory and run once
   more goes first of all), then first come;
2. the held token: while the package of the highest priority builds and runs
   no compile, the last free token is kept for it (four slots or more);
3. memory: a compile starts only when its expected peak (:class:`Expectations`) fits
   in the budget beside what the running ones hold or are expected to reach
   (:func:`reserved`), and in what the host really has left; a compile that
   does not fit waits, and those behind it start only where they leave its
   room free. Alone, any compile runs.

No sockets, processes or threads: tests/unit/test_admission.py calls these
with plain values; the forecast (tasks/engine/forecast.py) calls :func:`choose` on a simulated clock.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: What a preprocessor-only run (ccache's, nvcc -E) is expected to hold without a record of its own.
PREPROCESS_MB = 2048.0


@dataclass(frozen=True)
class Expect:
    """What the broker expects a unit to hold (MB): its peak, the process the peak comes in (cicc), and what
    it holds once that process has ended (None: unknown, so the peak is kept for all of the unit)."""

    peak_mb: float
    peak_in: str = ""
    after_mb: float | None = None


def expectation(found: Mapping[str, object] | None, default_mb: float) -> Expect:
    """An :class:`Expect` from a record or hint (``peak_mb``, ``peak_in``, ``after_mb``), else the default."""
    if not found:
        return Expect(default_mb)
    peak = found.get("peak_mb")
    after = found.get("after_mb")
    return Expect(
        peak_mb=float(peak) if isinstance(peak, int | float) and peak > 0 else default_mb,
        peak_in=str(found.get("peak_in") or ""),
        after_mb=float(after) if isinstance(after, int | float) and after > 0 else None,
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
            return Expect(self.default_mb, found.peak_in, min(found.after_mb or self.default_mb, self.default_mb))
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


def reserved(expect: Expect, live_mb: float, past: bool) -> float:
    """The memory counted for a running unit: what it holds (``live_mb``), or more, what it is expected to
    reach: its peak, or once the process its peak comes in has ended (``past``), its recorded rest."""
    rest = expect.after_mb if past and expect.after_mb is not None else expect.peak_mb
    return max(live_mb, rest)


@dataclass(frozen=True)
class Waiter:
    """A compile asking for a token: its package, its place in line (``priority``, highest first, then
    ``seq``, lowest first) and the memory it is expected to reach."""

    package: str
    priority: float
    seq: int
    expect: Expect


@dataclass(frozen=True)
class Running:
    """A compile running on a token: its package, what it holds now, and what is counted for it."""

    package: str
    reserved_mb: float
    live_mb: float = 0.0


def fits(
    peak_mb: float,
    running: Sequence[Running],
    *,
    room_mb: float,
    budget_mb: float | None,
    available_mb: float | None,
) -> bool:
    """Whether a unit expected to reach ``peak_mb`` fits in ``room_mb`` of the budget and in what the host
    really has left (``available_mb``, MemAvailable, less what the running units are still expected to
    grow by)."""
    if budget_mb is None or not running:
        return True  # no budget, or nothing else running: a unit larger than the budget runs alone
    if peak_mb > room_mb:
        return False
    if available_mb is None:
        return True
    growth = sum(max(0.0, r.reserved_mb - r.live_mb) for r in running)
    return peak_mb <= available_mb - growth


def choose(
    waiting: Sequence[Waiter],
    running: Sequence[Running],
    *,
    slots: int,
    budget_mb: float | None,
    available_mb: float | None,
    building: Mapping[str, float],
) -> Waiter | None:
    """The waiter to admit next, if any: the first in line if it fits, else the first behind it that
    leaves the first one's room free.

    ``building`` maps each package whose build runs to its priority. While the package of the highest
    priority builds and runs no compile, the last free token is kept for it (on four slots or more): its
    serial phases (CMake's compiler checks, one compile after another, the compile after a link) then
    never wait for a long unit of another package to end. TransformerEngine's configure checks waited
    27 s for a token that way on the 16-core host. While it runs a compile, the other packages may take
    every other token.

    ``available_mb`` is the host's MemAvailable, where known (the broker reads it only with a budget and
    something running).
    """
    top = max(building.values(), default=0.0)
    first = {p for p, prio in building.items() if prio == top} if top > 0 else set()
    busy = any(r.package in first for r in running)
    keep = 1 if first and not busy and slots >= 4 else 0
    order = [
        w
        for w in sorted(waiting, key=lambda w: (-w.priority, w.seq))
        if not keep or w.package in first or len(running) < slots - keep
    ]
    if not order:
        return None
    head = order[0]
    room = (budget_mb or 0.0) - sum(r.reserved_mb for r in running)
    if fits(head.expect.peak_mb, running, room_mb=room, budget_mb=budget_mb, available_mb=available_mb):
        return head
    room -= head.expect.peak_mb
    return next(
        (
            w
            for w in order[1:]
            if fits(w.expect.peak_mb, running, room_mb=room, budget_mb=budget_mb, available_mb=available_mb)
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
