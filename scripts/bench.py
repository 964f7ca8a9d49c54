#!/usr/bin/env python3
"""Measure `doit wheels`: cold build per package, no-op, restore from cache; optionally plain pip builds.

Every figure comes from this one run and is printed side by side:

    python scripts/bench.py --lock sources.lock --profile minimal --mirror DIR --out bench.json
    python scripts/bench.py --example            # the example lock, served on loopback
    python scripts/bench.py --stack ...          # the whole lock in one parallel `doit wheels`

Cold builds run one package at a time (`doit build:<pkg>` on an empty cache)
so each package's wall time, CPU time (the build's process tree, from
wait4) and peak memory (host-wide, sampled from /proc/meminfo) are its own.
``--stack`` instead builds every package in one cold ``doit wheels`` (in
parallel, under the run's one job budget) and takes each package's figures
from that run's build timeline (``build/trace.json``); the whole run's wall
time, CPU time and peak memory are measured around it, beside the CPU-bound
lower bound (total CPU time over cores). ``--baseline`` also builds the same staged, patched trees with plain
`pip wheel --no-build-isolation --no-deps` one after another.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class MemorySampler:
    """Peak of host memory in use (MemTotal - MemAvailable) while active, in GB."""

    def __init__(self) -> None:
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def used_gb() -> float:
        info = {}
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0])
        return (info["MemTotal"] - info["MemAvailable"]) / 1024 / 1024

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used_gb())
            time.sleep(0.25)

    def __enter__(self) -> MemorySampler:
        self.base = self.used_gb()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def timed(cmd: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> tuple[float, float, float]:
    """Run cmd; return (wall s, CPU s of its process tree, peak host memory above the start, GB)."""
    with log.open("ab") as out, MemorySampler() as mem:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed ({code}); see {log}")
    return wall, usage.ru_utime + usage.ru_stime, max(0.0, mem.peak - mem.base)


def doit_cmd(args: argparse.Namespace, work: Path, *targets: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "doit",
        "-f",
        str(REPO / "dodo.py"),
        "-d",
        str(work),
        *targets,
        f"lock={args.lock.resolve()}",
        f"cache={work / 'cache'}",
        f"profile={args.profile}",
    ]
    if args.mirror:
        cmd.append(f"mirror={args.mirror.resolve()}")
    if args.jobs:
        cmd.append(f"jobs={args.jobs}")
    if args.mem:
        cmd.append(f"mem={args.mem}")
    return cmd


def packages(args: argparse.Namespace, env: dict[str, str]) -> list[str]:
    sys.path.insert(0, str(REPO))
    from tasks.lockfile import load_lock

    return [p.name for p in load_lock(args.lock.resolve()).resolve(args.profile)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lock", type=Path, default=REPO / "sources.lock")
    ap.add_argument("--profile", default="default")
    ap.add_argument("--mirror", type=Path)
    ap.add_argument("--jobs", type=int)
    ap.add_argument("--mem", type=float, help="memory budget in GB (doit's mem=)")
    ap.add_argument("--stack", action="store_true", help="one parallel `doit wheels` for all packages")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    ap.add_argument("--baseline", action="store_true", help="also build with plain pip wheel")
    ap.add_argument("--verify", action="store_true", help="run `doit verify` on the wheelhouse before the baseline")
    ap.add_argument("--example", action="store_true", help="benchmark examples/example.lock on a loopback server")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    server = None
    if args.example:
        sys.path.insert(0, str(REPO / "tests" / "fixtures"))
        from make_fixtures import publish
        from serve import FixtureServer

        pub = Path(tempfile.mkdtemp(prefix="bench-upstream-"))
        publish(pub)
        server = FixtureServer(pub, port=0).start()
        text = (REPO / "examples" / "example.lock").read_text().replace("http://127.0.0.1:8737", server.url)
        work0 = Path(tempfile.mkdtemp(prefix="bench-lock-"))
        (work0 / "example.lock").write_text(text)
        shutil.copytree(REPO / "examples" / "patches", work0 / "patches")
        args.lock = work0 / "example.lock"
        env.update(PIP_INDEX_URL=f"{server.url}/simple", PIP_CONFIG_FILE=os.devnull)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "bench.log"
    names = packages(args, env)
    result: dict[str, Any] = {
        "host": {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "lock": str(args.lock),
        "profile": args.profile,
        "packages": {},
    }
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        gpu = ""
    result["host"]["gpu"] = gpu or "none"

    # Sources first, so the per-package figures are compile time only.
    wall, cpu, _ = timed(doit_cmd(args, work, "fetch"), cwd=work, env=env, log=log)
    result["fetch_s"] = round(wall, 2)
    if args.stack:
        wall, cpu, mem = timed(doit_cmd(args, work, "wheels"), cwd=work, env=env, log=log)
        result["stack"] = {
            "cold_wall_s": round(wall, 1),
            "cold_cpu_s": round(cpu, 1),
            "peak_mem_gb": round(mem, 1),
            "cores": os.cpu_count(),
            "cpu_lower_bound_s": round(cpu / (os.cpu_count() or 1), 1),
        }
        budget = [line for line in log.read_text().splitlines() if line.startswith("job budget:")]
        result["stack"]["budget"] = budget[-1] if budget else ""
        trace = json.loads((work / "build" / "trace.json").read_text())
        for ev in trace["traceEvents"]:
            if ev.get("cat") == "package":
                name = ev["name"].removeprefix("build ")
                result["packages"][name] = {
                    "cold_wall_s": round(ev["dur"] / 1e6, 1),
                    "cold_cpu_s": ev["args"]["cpu_s"],
                    "peak_mem_gb": round(ev["args"]["max_rss_mb"] / 1024, 1),
                }
        result["cold_total_s"] = round(wall + result["fetch_s"], 1)
        print(
            f"cold stack: {wall:.1f} s wall, {cpu:.0f} s CPU, peak {mem:.1f} GB; "
            f"CPU-bound lower bound {result['stack']['cpu_lower_bound_s']} s",
            flush=True,
        )
    else:
        total = 0.0
        for name in names:
            wall, cpu, mem = timed(doit_cmd(args, work, f"build:{name}"), cwd=work, env=env, log=log)
            total += wall
            result["packages"][name] = {
                "cold_wall_s": round(wall, 1),
                "cold_cpu_s": round(cpu, 1),
                "peak_mem_gb": round(mem, 1),
            }
            print(f"cold {name}: {wall:.1f} s wall, {cpu:.0f} s CPU, peak {mem:.1f} GB", flush=True)
        wall, _, _ = timed(doit_cmd(args, work, "wheels"), cwd=work, env=env, log=log)
        result["assemble_s"] = round(wall, 2)
        result["cold_total_s"] = round(total + wall + result["fetch_s"], 1)
    noop = [timed(doit_cmd(args, work, "wheels"), cwd=work, env=env, log=log)[0] for _ in range(3)]
    result["noop_s"] = [round(x, 3) for x in noop]
    print(f"no-op doit wheels: {result['noop_s']} s", flush=True)
    shutil.rmtree(work / "wheels")
    for state in work.glob(".doit.db*"):
        state.unlink()
    wall, _, _ = timed(doit_cmd(args, work, "wheels"), cwd=work, env=env, log=log)
    result["restore_s"] = round(wall, 2)
    result["restore_per_wheel_s"] = round(wall / max(1, len(names)), 3)
    print(f"restore from cache: {result['restore_s']} s", flush=True)
    manifest = json.loads((work / "wheels" / "manifest.json").read_text())
    for w in manifest["wheels"]:
        result["packages"][w["package"]]["wheel_mb"] = round(w["size"] / 1e6, 2)

    if args.verify:
        # Check what was built before comparing its build time with anything.
        vlog = work / "verify.log"
        cmd = doit_cmd(args, work, "verify")
        started = time.monotonic()
        with vlog.open("wb") as out:
            code = subprocess.run(cmd, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
        result["verify"] = {"exit": code, "wall_s": round(time.monotonic() - started, 1), "log": str(vlog)}
        print(f"doit verify: exit {code} in {result['verify']['wall_s']} s; report in {vlog}", flush=True)
    if args.baseline:
        # Plain builds of the same patched trees, one after another, no cache.
        from tasks.build import build_env
        from tasks.context import Context

        for name in names:
            timed(doit_cmd(args, work, f"stage:{name}"), cwd=work, env=env, log=log)
        vars_ = {"lock": str(args.lock.resolve()), "cache": str(work / "cache"), "profile": args.profile}
        ctx = Context.load(vars_)
        base_total = 0.0
        for name in names:
            pkg = ctx.package(name)
            tree = work / "build" / "stage" / name
            tree = tree / pkg.subdir if pkg.subdir else tree
            out = work / "plain" / name
            cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(out), str(tree)]
            jobs = args.jobs or os.cpu_count() or 1  # plain builds: one package at a time, all cores
            wall, cpu, mem = timed(cmd, cwd=tree, env=build_env(ctx, pkg, jobs), log=log)
            base_total += wall
            result["packages"][name] |= {
                "plain_wall_s": round(wall, 1),
                "plain_cpu_s": round(cpu, 1),
                "plain_peak_mem_gb": round(mem, 1),
            }
            print(f"plain {name}: {wall:.1f} s wall, {cpu:.0f} s CPU", flush=True)
        result["plain_total_s"] = round(base_total, 1)
    if server is not None:
        server.stop()

    print(f"\nhost: {result['host']}  lock: {args.lock.name}  profile: {args.profile}")
    if args.stack:
        st = result["stack"]
        print(
            f"{st['budget']}\nwhole stack, one cold `doit wheels`: {st['cold_wall_s']} s wall, "
            f"{st['cold_cpu_s']} s CPU, "
            f"peak {st['peak_mem_gb']} GB; CPU-bound lower bound {st['cpu_lower_bound_s']} s "
            f"({st['cold_cpu_s']} CPU s / {st['cores']} cores); per-package rows below are from the parallel run "
            "(peak = largest process)"
        )
    print(
        f"{'package':<22}{'cold wall s':>12}{'cold CPU s':>12}{'peak GB':>9}{'wheel MB':>10}"
        f"{'plain wall s':>14}{'plain CPU s':>13}"
    )
    for name, p in result["packages"].items():
        print(
            f"{name:<22}{p['cold_wall_s']:>12}{p['cold_cpu_s']:>12}{p['peak_mem_gb']:>9}{p.get('wheel_mb', 0):>10}"
            f"{p.get('plain_wall_s', '-'):>14}{p.get('plain_cpu_s', '-'):>13}"
        )
    print(
        f"fetch {result['fetch_s']} s; cold total (fetch + builds + assemble) {result['cold_total_s']} s"
        + (f"; plain total {result['plain_total_s']} s" if args.baseline else "")
    )
    print(f"no-op doit wheels: {result['noop_s']} s (cold build of the same lock: {result['cold_total_s']} s)")
    print(
        f"restore from cache (wheels/ and doit state deleted): {result['restore_s']} s, "
        f"{result['restore_per_wheel_s']} s per wheel"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
