#!/usr/bin/env python3
"""The compile makespan a lock's recorded unit times predict on one host and on a Ray cluster, side by side.

    python scripts/cluster_forecast.py --lock sources.lock --packages flash_attn,flash_attn_3 \\
        --host-cores 32 --host-mem 256 --nodes 8 --cores 64 --mem 512

For each package, from the lock's hints (``patches/<pkg>/unit-times.json``, the seconds each unit took in
a recorded build, and ``unit-memory.json``, else the package's ``mem_per_job_gb``), the schedule the
run's broker would follow (tasks/engine/forecast.py ``simulate``, which asks tasks/engine/admission.py): on one host of
``--host-cores`` cores and ``--host-mem`` GB, and on ``--nodes`` nodes of ``--cores`` cores and ``--mem`` GB
(slots: cores over the package's ``NVCC_THREADS``, as each unit asks Ray for that many CPUs). The cluster's
memory is modelled as one budget (every node's), and each unit's expected peak is checked to fit one
node. Compiles only: the serial part (pip, configure, the link) is not in the hints and is not counted.

``--together``: the packages' compiles on the one host at once, as one run's broker admits them (one job slot a
core, as its job server has), each package's end and the run's::

    python scripts/cluster_forecast.py --lock sources.lock --together --host-cores 64 --host-mem 502.8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.engine import admission
from tasks.engine.forecast import PackageWork, UnitWork, simulate
from tasks.lock.lockfile import Package, load_lock
from tasks.outside import ninjaorder
from tasks.store import history


def _work(patches: Path, pkg: Package, slots: int, profile: str) -> PackageWork | None:
    times = ninjaorder.load_times(history.hints_path(patches / pkg.name, ninjaorder.HINTS_FILE, profile))
    if not times:
        return None
    expect = admission.Expectations(
        records={},
        hints=history.load_memory(history.hints_path(patches / pkg.name, history.MEMORY_HINTS_FILE, profile)),
        default_mb=pkg.mem_per_job_gb * 1024,
    )
    units = tuple(UnitWork(u, s, expect.expect(u).peak_mb, expect.expect(u)) for u, s in sorted(times.items()))
    return PackageWork(pkg.name, units, 0.0, admission.priority(times, slots), 0.0)


def _threads(pkg: Package) -> int:
    value = dict(pkg.env).get("NVCC_THREADS", "1")
    return max(1, int(value)) if value.isdigit() else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lock", type=Path, default=Path("sources.lock"))
    ap.add_argument("--profile", default="default")
    ap.add_argument("--packages", default="", help="comma-separated (default: every package with hints)")
    ap.add_argument("--host-cores", type=int, default=32)
    ap.add_argument("--host-mem", type=float, default=256.0, help="GB")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--cores", type=int, default=64, help="per node")
    ap.add_argument("--mem", type=float, default=512.0, help="GB per node")
    ap.add_argument("--together", action="store_true", help="the packages at once on the one host, and stop")
    args = ap.parse_args()
    lock = load_lock(args.lock)
    patches = lock.patches_dir
    wanted = {p for p in args.packages.split(",") if p}
    packages = [p for p in lock.resolve(args.profile) if not wanted or p.name in wanted]
    print(f"lock {args.lock} profile {args.profile}: compile makespan from the recorded unit times (seconds)")
    print(f"one host: {args.host_cores} cores, {args.host_mem:g} GB; cluster: {args.nodes} nodes x {args.cores} "
          f"cores, {args.mem:g} GB each")  # fmt: skip
    if args.together:
        works = [w for w in (_work(patches, p, args.host_cores, args.profile) for p in packages) if w is not None]
        run = simulate(works, slots=args.host_cores, budget_mb=args.host_mem * 1024)
        for name, pf in run.packages.items():
            print(f"  {name:20s} ends at {pf.end_s:7.1f} s")
        print(f"together on the one host ({args.host_cores} slots): {run.wall_s:.1f} s, "
              f"expected peak {run.peak_mb / 1024:.1f} GB")  # fmt: skip
        return 0
    head = ("package", "units", "CPU s", "longest s", "threads", "one host s", "cluster s", "speed-up")
    rows = [head]
    for pkg in packages:
        threads = _threads(pkg)
        host_slots = max(1, args.host_cores // threads)
        cluster_slots = max(1, args.nodes * (args.cores // threads))
        host = _work(patches, pkg, host_slots, args.profile)
        if host is None:
            rows.append((pkg.name, "-", "-", "-", str(threads), "no hints", "no hints", "-"))
            continue
        heaviest = max(u.peak_mb for u in host.units)
        if heaviest > args.mem * 1024:
            print(f"note: {pkg.name}: a unit is expected to hold {heaviest / 1024:.0f} GB, more than a node has")
        one = simulate([host], slots=host_slots, budget_mb=args.host_mem * 1024)
        work = _work(patches, pkg, cluster_slots, args.profile)
        assert work is not None
        many = simulate([work], slots=cluster_slots, budget_mb=args.nodes * args.mem * 1024)
        cpu = sum(u.seconds for u in host.units)
        longest = max(u.seconds for u in host.units)
        rows.append((pkg.name, str(len(host.units)), f"{cpu:.0f}", f"{longest:.0f}", str(threads),
                     f"{one.wall_s:.0f}", f"{many.wall_s:.0f}", f"{one.wall_s / many.wall_s:.1f}x"))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
