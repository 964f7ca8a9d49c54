#!/usr/bin/env python3
"""Time the no-op `doit wheels` of one or more workspaces, alternating, and print them side by side.

Each workspace is a checkout whose wheelhouse is up to date (after `bash examples/quickstart.sh`, or a
`doit wheels` of the lock given after ``--``); its own ``.venv/bin/doit`` runs in it. Runs alternate
between the workspaces, so load on the host falls on all of them alike. The baseline is another checkout
of an earlier commit (``git worktree add DIR COMMIT``, then its quickstart)::

    python scripts/bench_noop.py before=../base after=.                  # the example lock, 20 runs each
    python scripts/bench_noop.py --runs 30 after=. -- lock=sources.lock profile=no-fa2 mirror=DIR
    python scripts/bench_noop.py "with=." "without=.:lock=L2 wheels=W2"    # per-workspace arguments after ':'

``--tasks wheels,plan`` times each of those tasks in each workspace, alternating all of them (a no-op
`doit plan` beside a no-op `doit wheels`; labels ``NAME/TASK``).

A repeated no-op `doit wheels` is replayed from its record (tasks/core/replay.py, docs/building.md "The
no-op"): each workspace runs twice before the timed runs, the second after the record's two seconds, so that
the timed runs are what a user's repeated no-op is. ``--off`` times each workspace a second time, alternating,
with ``REPRO_NOOP_REPLAY=off`` (labels ``NAME/off``): the no-op without its record, the baseline, in the same
run.

``--bytecode`` lets Python write bytecode (unsets PYTHONDONTWRITEBYTECODE, as most users' shells are);
without it the environment is used as it is. Columns: median, minimum, the best of the first five
runs, the 90th percentile and the maximum. A run that exits non-zero, or that builds anything (a
line starting with ``.  build:`` or ``.  wheels``), stops the benchmark: it would not be a no-op.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "workspaces", nargs="+", metavar="NAME=DIR[:ARGS]", help="a label, a checkout with .venv/bin/doit, its own args"
    )
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--tasks", default="wheels", help="comma-separated tasks to time in each workspace")
    ap.add_argument("--bytecode", action="store_true", help="let Python write bytecode (unset PYTHONDONTWRITEBYTECODE)")
    ap.add_argument("--off", action="store_true", help="also time each workspace with REPRO_NOOP_REPLAY=off")
    args, extra = ap.parse_known_args()
    extra = [a for a in extra if a != "--"]
    env = dict(os.environ)
    if args.bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    off = {**env, "REPRO_NOOP_REPLAY": "off"}
    spaces = []
    for item in args.workspaces:
        name, _, where = item.partition("=")
        where, _, own = where.partition(":")
        root = Path(where or name).resolve()
        doit = root / ".venv" / "bin" / "doit"
        if not doit.is_file():
            ap.error(f"{doit} does not exist: run bash examples/quickstart.sh in {root} first")
        tasks = [t for t in args.tasks.split(",") if t]
        for task in tasks:
            label = f"{name}/{task}" if len(tasks) > 1 else name
            spaces.append((label, root, [str(doit), task, *own.split(), *extra], env))
            if args.off:
                spaces.append((f"{label}/off", root, [str(doit), task, *own.split(), *extra], off))
    # Each twice first: a toolchain probe or bytecode written is not a no-op's cost, and a record is replayed
    # once a second run has confirmed it, after its two seconds (tasks/core/replay.py).
    for warm_up in range(2):
        if warm_up:
            time.sleep(2.2)
        for _name, root, cmd, environ in spaces:
            subprocess.run(cmd, cwd=root, env=environ, capture_output=True, check=False)
    times: dict[str, list[float]] = {name: [] for name, _, _, _ in spaces}
    for _ in range(args.runs):
        for name, root, cmd, environ in spaces:
            start = time.perf_counter()
            res = subprocess.run(cmd, cwd=root, env=environ, capture_output=True, text=True, check=False)
            took = time.perf_counter() - start
            if res.returncode != 0 or any(
                line.startswith((".  build:", ".  wheels")) for line in res.stdout.splitlines()
            ):
                print(f"{name}: not a no-op (exit {res.returncode}):\n{res.stdout}{res.stderr}", file=sys.stderr)
                return 1
            times[name].append(took)
    bytecode = "written" if args.bytecode else f"PYTHONDONTWRITEBYTECODE={env.get('PYTHONDONTWRITEBYTECODE', '')!r}"
    print(f"no-op `doit {args.tasks} {' '.join(extra)}`, {args.runs} runs each, alternating; bytecode {bytecode}")
    print(f"{'workspace':<12} {'median ms':>9} {'min ms':>7} {'best of 5':>9} {'p90 ms':>7} {'max ms':>7}")
    for name, values in times.items():
        ms = [v * 1000 for v in values]
        p90 = sorted(ms)[max(0, round(0.9 * len(ms)) - 1)]
        best5 = min(ms[:5])
        print(f"{name:<12} {statistics.median(ms):>9.0f} {min(ms):>7.0f} {best5:>9.0f} {p90:>7.0f} {max(ms):>7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
