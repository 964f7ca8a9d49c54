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
`pip wheel --no-build-isolation --no-deps` one after another (``--deadline``
stops them and reports what did not finish). ``--remote`` uploads the cold
build to a loopback HTTP cache (scripts/cache_server.py) and times a fresh
workspace restoring from it; ``--edit PKG:FILE`` times the rebuild after a
patch adds one line of code to one source file, then rebuilds the unedited
package from the object cache and compares its wheel with the cold one.
``--shards N`` builds the lock again in N shards (``shard=i/N``), one after
another (``--shards-at-once``: all at once on this host), each in an empty
workspace on one fresh loopback cache, then assembles the wheelhouse in
another empty workspace: the makespan of N machines is the slowest shard
plus the assembly, and the assembled wheels, built a second time in other
directories, are compared byte for byte with the cold build's. With
``--reference BENCH_JSON`` the cold build is skipped: the shards run,
compared with that earlier run's wheel hashes and cold time, then
``--verify`` checks the assembled wheelhouse; ``--baseline`` (with or
without ``--shards``) builds the plain baseline to set beside that run's
cold figures. ``--repro`` (with ``--stack``) then runs ``doit repro`` on the
same workspace, every package rebuilt once more without the wheel and object
caches, and prints its wall time beside the cold ``doit wheels``'s, with how
many wheels it found identical:

    python scripts/bench.py --stack --repro --lock sources.lock --profile no-fa2 --mirror DIR --jobs 16
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]  # tasks.* and cache_server, imported where a figure needs them


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


def cores() -> int:
    """The CPUs this process may run on (taskset and cgroup cpusets included), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def timed(cmd: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> tuple[float, float, float]:
    """Run cmd; return (wall s, CPU s of its process tree, peak host memory above the start, GB)."""
    wall, cpu, mem, code = run_until(cmd, cwd=cwd, env=env, log=log)
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed ({code}); see {log}")
    return wall, cpu, mem


def run_until(
    cmd: list[str], *, cwd: Path, env: dict[str, str], log: Path, deadline: float | None = None
) -> tuple[float, float, float, int | None]:
    """Like timed, but stops the command's process group at ``deadline`` (time.monotonic()).

    Returns (wall s, CPU s, peak GB, exit code), the exit code None where the deadline stopped it.
    """
    with log.open("ab") as out, MemorySampler() as mem:
        start = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        stopped = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if deadline is not None and not stopped and time.monotonic() >= deadline:
                os.killpg(proc.pid, 9)
                stopped = True
            time.sleep(0.2)
        wall = time.monotonic() - start
    code = None if stopped else os.waitstatus_to_exitcode(status)
    return wall, usage.ru_utime + usage.ru_stime, max(0.0, mem.peak - mem.base), code


def doit_cmd(args: argparse.Namespace, work: Path, *targets: str, lock: Path | None = None) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "doit",
        "-f",
        str(REPO / "dodo.py"),
        "-d",
        str(work),
        *targets,
        f"lock={(lock or args.lock).resolve()}",
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
    from tasks.lock.lockfile import load_lock

    return [p.name for p in load_lock(args.lock.resolve()).resolve(args.profile)]


def one_line_patch(tree: Path, rel: str, number: int) -> str:
    """A patch (for `patches/<pkg>/`) that adds one line of code at the end of ``rel`` in the staged ``tree``."""
    import difflib

    old = (tree / rel).read_text().splitlines(keepends=True)
    if old and not old[-1].endswith("\n"):
        old[-1] += "\n"
    new = [*old, f"[[maybe_unused]] static const int reprostack_bench_edit_{number} = {number};\n"]
    body = "".join(difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}"))
    return f"Benchmark edit: one added line of code in {rel}.\n\n{body}"


def edited_lock(args: argparse.Namespace, work: Path, pkg: str, rel: str) -> Path:
    """A copy of the lock (and its patches/) whose ``pkg`` carries one more patch, adding a line to ``rel``."""
    import tomlkit

    dest = work / "edit"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    doc = tomlkit.parse(args.lock.read_text())
    patches_dir = str(doc.get("patches_dir", "patches"))
    src = args.lock.resolve().parent / patches_dir
    if src.is_dir():
        shutil.copytree(src, dest / patches_dir)
    table: Any = doc["packages"][pkg]
    patches = list(table.get("patches", []))
    name = "9999-bench-one-line-edit.patch"
    staged = work / "build" / "stage" / pkg
    (dest / patches_dir / pkg).mkdir(parents=True, exist_ok=True)
    (dest / patches_dir / pkg / name).write_text(one_line_patch(staged, rel, 1))
    table["patches"] = [*patches, name]
    out = dest / Path(args.lock).name
    out.write_text(tomlkit.dumps(doc))
    return out


def critical_paths(trace: dict[str, Any]) -> dict[str, float]:
    """Each built package's own critical path in a parallel run, from its timeline.

    The time before its first compile unit started (setup, configure) plus its
    longest unit plus the time after its last unit ended (link, wheel). Where
    its first unit waited for a job slot, that wait is counted too, so the
    figure is exact for the package that started compiling first (the one
    that sets the bound in practice) and an over-estimate for the others;
    unit times are as measured under the run's load. A package without units
    counts its whole wall time.
    """
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    units: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("cat") == "compile" and e.get("ph") == "X":
            units.setdefault(names.get(e["tid"], ""), []).append(e)
    paths = {}
    for e in events:
        if e.get("cat") != "package":
            continue
        name = e["name"].removeprefix("build ")
        mine = units.get(name)
        if not mine:
            paths[name] = round(e["dur"] / 1e6, 1)
            continue
        before = min(u["ts"] for u in mine) - e["ts"]
        after = e["ts"] + e["dur"] - max(u["ts"] + u["dur"] for u in mine)
        paths[name] = round((max(0, before) + max(u["dur"] for u in mine) + max(0, after)) / 1e6, 1)
    return paths


@dataclass(frozen=True)
class Bench:
    """What the steps of one benchmark run share: its options, scratch directory, environment, log and result."""

    args: argparse.Namespace
    work: Path
    env: dict[str, str]
    log: Path
    names: list[str]
    result: dict[str, Any]

    def save(self) -> None:
        if self.args.out:
            self.args.out.write_text(json.dumps(self.result, indent=2) + "\n")


def shard_figures(bench: Bench, cold_wheels: dict[str, Any]) -> None:
    """N shards, each in an empty workspace (as on its own machine), then the assembly.

    Each shard runs `doit wheels shard=i/N remote=URL remote_write=on` with
    empty wheel and object caches against a fresh loopback cache; then an
    empty workspace runs `doit wheels remote=URL`, which must compile
    nothing. The makespan of N machines doing this at once is the slowest
    shard plus the assembly; the single-machine figure beside it is this
    run's cold build. The shards run one after another, or with
    ``--shards-at-once`` all at the same time on this host, where each shard's
    time is then an upper bound of its time on a machine of its own (they
    share the cores; memory peaks are host-wide). Every assembled wheel is
    compared with the cold build's, made in another directory at another
    time: the per-package count of identical wheels, and for each that
    differs, what differs (tasks.verify.wheeldiff).
    """
    from cache_server import CacheServer

    args, work, env, log, names, result = bench.args, bench.work, bench.env, bench.log, bench.names, bench.result
    n = args.shards
    server = CacheServer(work / "shard-remote").start()
    try:
        url = [f"remote={server.url}"]
        spaces = [work / f"shard-{i}-of-{n}" for i in range(1, n + 1)]
        cmds = []
        for i, ws in enumerate(spaces, 1):
            ws.mkdir(exist_ok=True)
            cmds.append(doit_cmd(args, ws, "wheels") + url + ["remote_write=on", f"shard={i}/{n}"])
        if args.shards_at_once:
            figures = timed_together(cmds, cwd=work, env=env, logs=[ws / "shard.log" for ws in spaces])
        else:
            figures = [timed(cmd, cwd=work, env=env, log=log) for cmd in cmds]
        shards: list[dict[str, Any]] = []
        for i, (ws, (wall, cpu, mem)) in enumerate(zip(spaces, figures, strict=True), 1):
            built = [p for p in names if (ws / "build" / "logs" / f"build-{p}.log").exists()]
            shards.append(
                {
                    "shard": f"{i}/{n}",
                    "wall_s": round(wall, 1),
                    "cpu_s": round(cpu, 1),
                    "peak_mem_gb": round(mem, 1),
                    "built": built,
                }
            )
            print(f"shard {i}/{n}: {wall:.1f} s wall, {cpu:.0f} s CPU, peak {mem:.1f} GB; built {built}", flush=True)
        asm = work / f"shard-assemble-{n}"
        asm.mkdir(exist_ok=True)
        sent = server.bytes_sent
        wall, _, _ = timed(doit_cmd(args, asm, "wheels") + url, cwd=work, env=env, log=log)
        compiled = [p for p in names if (asm / "build" / "logs" / f"build-{p}.log").exists()]
        manifest = json.loads((asm / "wheels" / "manifest.json").read_text())
        identical, differing = compare_with_cold(work, asm, manifest, cold_wheels)
        same = not differing
    finally:
        server.stop()
    slowest = max(s["wall_s"] for s in shards)
    single = result.get("stack", {}).get("cold_wall_s") or result.get("cold_total_s")
    result["shards"] = {
        "n": n,
        "shards": shards,
        "assemble_s": round(wall, 1),
        "assemble_bytes": server.bytes_sent - sent,
        "assemble_compiled": compiled,
        "identical_to_cold": same,
        "identical": identical,
        "differing": differing,
        "at_once": bool(args.shards_at_once),
        "makespan_s": round(slowest + wall, 1),
        "single_machine_cold_s": single,
    }
    print(
        f"{n} shards: makespan {slowest + wall:.1f} s (slowest shard {slowest:.1f} s + assembly {wall:.1f} s, "
        f"{(server.bytes_sent - sent) / 1e6:.1f} MB, compiled: {compiled or 'nothing'}; wheels identical to the "
        f"cold build: {same}) beside one machine's cold build {single} s"
        + (" (shards run at the same time on this host: each an upper bound)" if args.shards_at_once else ""),
        flush=True,
    )
    print(
        f"built twice (the cold build{' of the reference run' if args.reference else ''}, then the shards in "
        f"other directories): {len(identical)} of "
        f"{len(identical) + len(differing)} wheels identical",
        flush=True,
    )
    for name, text in differing.items():
        print(f"{name} differs:\n{text}", flush=True)


def timed_together(
    cmds: list[list[str]], *, cwd: Path, env: dict[str, str], logs: list[Path]
) -> list[tuple[float, float, float]]:
    """Start every command at once (run_until in a thread each); their figures as timed() gives them.

    A command that fails ends the benchmark once every command has finished.
    """
    with ThreadPoolExecutor(max_workers=len(cmds)) as pool:
        runs = list(pool.map(lambda cmd, path: run_until(cmd, cwd=cwd, env=env, log=path), cmds, logs))
    for cmd, path, (_, _, _, code) in zip(cmds, logs, runs, strict=True):
        if code != 0:
            sys.exit(f"{' '.join(cmd)} failed ({code}); see {path}")
    return [(wall, cpu, mem) for wall, cpu, mem, _ in runs]


def compare_with_cold(
    work: Path, other: Path, manifest: dict[str, Any], cold_wheels: dict[str, Any]
) -> tuple[list[str], dict[str, str]]:
    """Which of other/wheels are byte-identical to the cold build's, and what differs in the rest."""
    from tasks.verify.wheeldiff import compare_wheels

    identical, differing = [], {}
    for w in manifest["wheels"]:
        if w.get("origin") == "fetched":
            continue  # the runtime closure's, downloaded by both
        cold = cold_wheels.get(w["package"], {"sha256": ""})
        if cold["sha256"] == w["sha256"]:
            identical.append(w["package"])
        elif "filename" not in cold:
            differing[w["package"]] = f"sha256 {cold['sha256'][:16]}… -> {w['sha256'][:16]}… (no wheel to compare)"
        else:
            diff = compare_wheels(work / "wheels" / cold["filename"], other / "wheels" / w["filename"])
            differing[w["package"]] = diff.render()
    return identical, differing


def entry_meta(work: Path, key: str) -> dict[str, Any]:
    d = work / "cache" / "wheels" / key[:2] / key
    return dict(json.loads((d / "entry.json").read_text()))


class Verify:
    """`doit verify` on ``ws``'s wheelhouse in the background, its report in WORK/verify.log."""

    def __init__(self, args: argparse.Namespace, ws: Path, work: Path, env: dict[str, str]) -> None:
        self.log = work / "verify.log"
        self.started = time.monotonic()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                doit_cmd(args, ws, "verify"), cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def finish(self, result: dict[str, Any], what: str) -> None:
        code = self.proc.wait()
        wall = round(time.monotonic() - self.started, 1)
        result["verify"] = {"exit": code, "wall_s": wall, "log": str(self.log)}
        print(f"doit verify ({what}): exit {code} in {wall} s; report in {self.log}", flush=True)


def plain_baseline(bench: Bench, began: float) -> None:
    """Plain builds of the same patched trees, one after another, no cache."""
    from tasks.stages.build import build_env
    from tasks.stages.context import Context

    args, work, env, log, names, result = bench.args, bench.work, bench.env, bench.log, bench.names, bench.result

    order = args.baseline_order.split(",") if args.baseline_order else names
    for name in order:
        timed(doit_cmd(args, work, f"stage:{name}"), cwd=work, env=env, log=log)
    vars_ = {"lock": str(args.lock.resolve()), "cache": str(work / "cache"), "profile": args.profile}
    ctx = Context.load(vars_)
    base_total = 0.0
    deadline = began + args.deadline if args.deadline else None
    for name in order:
        if deadline is not None and time.monotonic() >= deadline:
            result["packages"][name]["plain"] = "not started (deadline)"
            print(f"plain {name}: not started (deadline)", flush=True)
            continue
        pkg = ctx.package(name)
        tree = work / "build" / "stage" / name
        tree = tree / pkg.subdir if pkg.subdir else tree
        out = work / "plain" / name
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(out), str(tree)]
        jobs = args.jobs or result["host"]["cpus"]  # plain builds: one package at a time, all cores
        plog = work / f"plain-{name}.log"
        wall, cpu, mem, code = run_until(cmd, cwd=tree, env=build_env(ctx, pkg, jobs), log=plog, deadline=deadline)
        base_total += wall
        state = "ok" if code == 0 else ("stopped at the deadline" if code is None else f"failed ({code})")
        result["packages"][name] |= {
            "plain_wall_s": round(wall, 1),
            "plain_cpu_s": round(cpu, 1),
            "plain_peak_mem_gb": round(mem, 1),
            "plain": state,
        }
        ref_cold = result["packages"][name].get("reference_cold_wall_s")
        beside = f"; cold build in the reference run: {ref_cold} s" if ref_cold is not None else ""
        print(f"plain {name}: {wall:.1f} s wall, {cpu:.0f} s CPU ({state}){beside}; log {plog}", flush=True)
        bench.save()
    result["plain_total_s"] = round(base_total, 1)


def repro_figures(
    args: argparse.Namespace, work: Path, env: dict[str, str], result: dict[str, Any], names: list[str]
) -> None:
    """``doit repro`` on the cold stack's workspace (wheels/ current): every package rebuilt at once on the
    run's budget, without the wheel and object caches, and compared with the cold build's wheels."""
    log = work / "repro.log"
    wall, cpu, mem, code = run_until(doit_cmd(args, work, "repro"), cwd=work, env=env, log=log)
    report_file = work / "build" / "repro" / "report.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() else {}
    rows = report.get("results", [])
    cold = result["stack"]["cold_wall_s"]
    result["repro"] = {
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "peak_mem_gb": round(mem, 1),
        "exit_status": code,
        "identical": sum(bool(r["identical"]) for r in rows),
        "compared": len(rows),
        "packages": len(names),
        "ratio_to_cold": round(wall / cold, 3) if cold else None,
        "seconds": {r["package"]: r["seconds"] for r in rows},
    }
    print(repro_line(result), flush=True)


def repro_line(result: dict[str, Any]) -> str:
    r, cold = result["repro"], result["stack"]["cold_wall_s"]
    return (
        f"cold `doit wheels`: {cold} s wall | `doit repro`: {r['wall_s']} s wall, {r['cpu_s']} s CPU, "
        f"peak {r['peak_mem_gb']} GB | repro / cold = {r['ratio_to_cold']}; "
        f"{r['identical']} of {r['compared']} wheel(s) identical (exit status {r['exit_status']})"
    )


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
    ap.add_argument("--baseline-order", help="comma-separated plain-build order (default: the lock's)")
    ap.add_argument(
        "--deadline", type=float, help="stop plain builds this many seconds after the start (reported as stopped)"
    )
    ap.add_argument(
        "--verify", action="store_true", help="run `doit verify` on the wheelhouse (beside the shards and the baseline)"
    )
    ap.add_argument("--remote", action="store_true", help="upload to a loopback cache; time a fresh restore")
    ap.add_argument("--edit", metavar="PKG:FILE", help="rebuild PKG after a patch adds one line of code to FILE")
    ap.add_argument("--example", action="store_true", help="benchmark examples/example.lock on a loopback server")
    ap.add_argument(
        "--shards",
        type=int,
        metavar="N",
        help="also build in N shards (in turn unless --shards-at-once) on one loopback cache",
    )
    ap.add_argument(
        "--shards-at-once",
        action="store_true",
        help="run the N shards at the same time on this host (each figure an upper bound) instead of in turn",
    )
    ap.add_argument(
        "--reference",
        type=Path,
        metavar="BENCH_JSON",
        help="skip the cold build and use this earlier run's wheel hashes and cold times: with --shards "
        "(then --verify on the assembled wheelhouse) and/or --baseline",
    )
    ap.add_argument(
        "--repro",
        action="store_true",
        help="after the cold stack, time `doit repro` (every package rebuilt, compared) beside it",
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.repro and not args.stack:
        ap.error("--repro needs --stack: it compares `doit repro` with one cold `doit wheels` of the stack")
    if args.repro and args.reference:
        ap.error("--repro needs the cold build of this run, not --reference")
    if args.reference and not (args.shards or args.baseline):
        ap.error("--reference needs --shards or --baseline")
    if args.reference and args.verify and not args.shards:
        ap.error("--reference --verify needs --shards: it checks the wheelhouse the shards assemble")
    began = time.monotonic()
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
    ncores = cores()
    result: dict[str, Any] = {
        "host": {"machine": platform.node(), "cpus": ncores, "python": platform.python_version()},
        "lock": str(args.lock),
        "profile": args.profile,
        "packages": {n: {} for n in names},
    }

    bench = Bench(args, work, env, log, names, result)
    save = bench.save

    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        gpu = ""
    result["host"]["gpu"] = gpu or "none"
    print(f"host: {result['host']}", flush=True)

    cache_server = None
    if args.remote:
        from cache_server import CacheServer

        cache_server = CacheServer(work / "remote").start()
        remote_vars = [f"remote={cache_server.url}"]
    else:
        remote_vars = []
    # The cold builds upload to the loopback cache, per package or as a stack.
    upload = [*remote_vars, "remote_write=on"] if remote_vars else []

    if args.reference:
        # No cold build: it is an earlier run's (its bench.json), built in another directory at another time;
        # only hashes can be compared, as its wheels are not here.
        ref = json.loads(args.reference.read_text())
        result["reference"] = {"file": str(args.reference), "host": ref.get("host"), "stack": ref.get("stack")}
        cold_wheels = {n: {"sha256": p["sha256"]} for n, p in ref["packages"].items() if "sha256" in p}
        for n, p in ref["packages"].items():
            if n in result["packages"] and "cold_wall_s" in p:
                result["packages"][n]["reference_cold_wall_s"] = p["cold_wall_s"]
        if ref.get("stack"):
            result["stack"] = {"cold_wall_s": ref["stack"].get("cold_wall_s")}
        result["cold_total_s"] = ref.get("cold_total_s")
        if args.shards:
            shard_figures(bench, cold_wheels)
            save()
        # The assembled wheelhouse, checked after the shards (beside the plain builds, as without --reference).
        verifier = Verify(args, work / f"shard-assemble-{args.shards}", work, env) if args.verify else None
        if args.baseline:
            plain_baseline(bench, began)
        if verifier is not None:
            verifier.finish(result, "the assembled wheelhouse")
        save()
        if server is not None:
            server.stop()
        return 0

    # Sources first, so the per-package figures are compile time only: the profile's (a mirror made for
    # the profile, offline, has no others).
    from tasks.lock.lockfile import load_lock

    fetches = [f"fetch:{name}" for name in load_lock(args.lock, require_pins=False).sources_for(args.profile)]
    wall, cpu, _ = timed(doit_cmd(args, work, *fetches), cwd=work, env=env, log=log)
    result["fetch_s"] = round(wall, 2)
    if args.stack:
        cmd = doit_cmd(args, work, "wheels") + upload
        wall, cpu, mem = timed(cmd, cwd=work, env=env, log=log)
        result["stack"] = {
            "cold_wall_s": round(wall, 1),
            "cold_cpu_s": round(cpu, 1),
            "peak_mem_gb": round(mem, 1),
            "cores": ncores,
            "cpu_lower_bound_s": round(cpu / ncores, 1),
        }
        result["cold_total_s"] = round(wall + result["fetch_s"], 1)
        budget = [line for line in log.read_text().splitlines() if line.startswith("job budget:")]
        result["stack"]["budget"] = budget[-1] if budget else ""
        trace = json.loads((work / "build" / "trace.json").read_text())
        for ev in trace["traceEvents"]:
            if ev.get("cat") == "package":
                name = ev["name"].removeprefix("build ")
                result["packages"][name] |= {
                    "cold_wall_s": round(ev["dur"] / 1e6, 1),
                    "cold_cpu_s": ev["args"]["cpu_s"],
                    "peak_mem_gb": round(ev["args"]["max_rss_mb"] / 1024, 1),
                }
        paths = critical_paths(trace)
        for name, seconds in paths.items():
            result["packages"][name]["critical_path_s"] = seconds
        longest = max(paths, key=lambda n: paths[n], default="")
        critical = paths.get(longest, 0.0)
        result["stack"]["critical_path_s"] = critical
        result["stack"]["critical_package"] = longest
        bound = max(result["stack"]["cpu_lower_bound_s"], critical)
        result["stack"]["ratio_to_bound"] = round(wall / bound, 3) if bound else None
        cpu_bound = result["stack"]["cpu_lower_bound_s"]
        result["stack"]["ratio_to_cpu_bound"] = round(wall / cpu_bound, 3) if cpu_bound else None
        print(
            f"cold stack: {wall:.1f} s wall, {cpu:.0f} s CPU, peak {mem:.1f} GB; "
            f"CPU-bound lower bound {result['stack']['cpu_lower_bound_s']} s ({cpu:.0f} CPU s / {ncores} cores); "
            f"longest own critical path {critical} s ({longest}); "
            f"wall / max(the two) = {result['stack']['ratio_to_bound']}; "
            f"wall / CPU-bound = {result['stack']['ratio_to_cpu_bound']} "
            "(unit times, and so the critical path, are as measured under this run's load)",
            flush=True,
        )
    else:
        total = 0.0
        for name in names:
            wall, cpu, mem = timed(doit_cmd(args, work, f"build:{name}") + upload, cwd=work, env=env, log=log)
            total += wall
            result["packages"][name] |= {
                "cold_wall_s": round(wall, 1),
                "cold_cpu_s": round(cpu, 1),
                "peak_mem_gb": round(mem, 1),
            }
            print(f"cold {name}: {wall:.1f} s wall, {cpu:.0f} s CPU, peak {mem:.1f} GB", flush=True)
        wall, _, _ = timed(doit_cmd(args, work, "wheels"), cwd=work, env=env, log=log)
        result["assemble_s"] = round(wall, 2)
        result["cold_total_s"] = round(total + wall + result["fetch_s"], 1)
    save()
    noop = [timed(doit_cmd(args, work, "wheels"), cwd=work, env=env, log=log)[0] for _ in range(3)]
    result["noop_s"] = [round(x, 3) for x in noop]
    print(f"no-op doit wheels: {result['noop_s']} s", flush=True)
    manifest = json.loads((work / "wheels" / "manifest.json").read_text())
    # The lock's packages: the runtime closure's wheels ([runtime], origin "fetched") are downloaded, not built.
    cold_wheels = {w["package"]: w for w in manifest["wheels"] if w.get("origin") != "fetched"}
    shutil.rmtree(work / "wheels")
    for state in work.glob(".doit.db*"):
        state.unlink()
    wall, _, _ = timed(doit_cmd(args, work, "wheels"), cwd=work, env=env, log=log)
    result["restore_s"] = round(wall, 2)
    result["restore_per_wheel_s"] = round(wall / max(1, len(names)), 3)
    print(f"restore from cache: {result['restore_s']} s", flush=True)
    for name, w in cold_wheels.items():
        result["packages"][name]["wheel_mb"] = round(w["size"] / 1e6, 2)
        result["packages"][name]["sha256"] = w["sha256"]
    print("wheels: " + ", ".join(f"{n} {w['size'] / 1e6:.1f} MB" for n, w in cold_wheels.items()), flush=True)
    save()

    if args.repro:
        repro_figures(args, work, env, result, names)
        save()

    if cache_server is not None:
        # A second, empty workspace (no wheel cache, no object cache) restores everything from the remote.
        fresh = work / "fresh"
        fresh.mkdir(exist_ok=True)
        sent_before = cache_server.bytes_sent
        wall, cpu, _ = timed(doit_cmd(args, fresh, "wheels") + remote_vars, cwd=work, env=env, log=log)
        fresh_manifest = json.loads((fresh / "wheels" / "manifest.json").read_text())
        same = all(
            cold_wheels[w["package"]]["sha256"] == w["sha256"]
            for w in fresh_manifest["wheels"]
            if w.get("origin") != "fetched"
        )
        built = [n for n in names if (fresh / "build" / "logs" / f"build-{n}.log").exists()]
        result["remote"] = {
            "uploaded_bytes": cache_server.bytes_received,
            "fresh_restore_s": round(wall, 1),
            "fresh_restore_cpu_s": round(cpu, 1),
            "bytes_moved": cache_server.bytes_sent - sent_before,
            "identical_to_cold": same,
            "compiled": built,
        }
        print(
            f"fresh workspace from the remote cache (fetch from the mirror included): {wall:.1f} s, "
            f"{result['remote']['bytes_moved'] / 1e6:.1f} MB moved; wheels identical to the cold build: {same}; "
            f"compiled: {built or 'nothing'}",
            flush=True,
        )
        save()

    if args.edit:
        # One added line of code in one source file of one package: only its units should recompile.
        pkg, rel = args.edit.split(":", 1)
        timed(doit_cmd(args, work, f"stage:{pkg}"), cwd=work, env=env, log=log)
        lock2 = edited_lock(args, work, pkg, rel)
        key_cmd = doit_cmd(args, work, f"build:{pkg}", lock=lock2)
        wall, cpu, _ = timed(key_cmd, cwd=work, env=env, log=log)
        from tasks.stages.context import Context

        ctx2 = Context.load({"lock": str(lock2), "cache": str(work / "cache"), "profile": args.profile})
        meta = entry_meta(work, ctx2.key(ctx2.package(pkg))[0])
        cold = result["packages"][pkg].get("cold_wall_s")
        result["edit"] = {
            "package": pkg,
            "file": rel,
            "rebuild_wall_s": round(wall, 1),
            "rebuild_cpu_s": round(cpu, 1),
            "object_cache": meta.get("object_cache"),
            "cold_wall_s": cold,
            "fraction_of_cold": round(wall / cold, 3) if cold else None,
        }
        print(
            f"one-line patch edit in {pkg} ({rel}): rebuilt in {wall:.1f} s ({cpu:.0f} CPU s), "
            f"object cache {meta.get('object_cache')}; cold build {cold} s; "
            f"fraction {result['edit']['fraction_of_cold']}",
            flush=True,
        )
        # The unedited package again, from the object cache only: the wheel must equal the cold build's.
        key = cold_wheels[pkg]["action_key"]
        shutil.rmtree(work / "cache" / "wheels" / key[:2] / key)
        wall, cpu, _ = timed(doit_cmd(args, work, f"build:{pkg}"), cwd=work, env=env, log=log)
        meta = entry_meta(work, key)
        from tasks.core.treehash import file_sha256

        digest = file_sha256(work / "cache" / "wheels" / key[:2] / key / meta["filename"])
        result["edit"]["unedited_rebuild"] = {
            "wall_s": round(wall, 1),
            "object_cache": meta.get("object_cache"),
            "sha256": digest,
            "identical_to_cold": digest == cold_wheels[pkg]["sha256"],
        }
        print(
            f"{pkg} rebuilt unedited from the object cache: {wall:.1f} s, {meta.get('object_cache')}; "
            f"wheel identical to the cold build: {digest == cold_wheels[pkg]['sha256']}",
            flush=True,
        )
        save()

    # Check what was built before comparing its build time with anything.
    verifier = Verify(args, work, work, env) if args.verify else None
    if verifier is not None and not args.baseline and not args.shards:
        verifier.proc.wait()
    if args.shards:
        shard_figures(bench, cold_wheels)
        save()
    if args.baseline:
        plain_baseline(bench, began)
    if verifier is not None:
        verifier.finish(result, "the wheelhouse")
    if server is not None:
        server.stop()
    if cache_server is not None:
        cache_server.stop()

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
        plain = p.get("plain_wall_s", "-")
        if p.get("plain") not in (None, "ok"):
            plain = f"{plain}*" if plain != "-" else "-"
        print(
            f"{name:<22}{p.get('cold_wall_s', '-'):>12}{p.get('cold_cpu_s', '-'):>12}{p.get('peak_mem_gb', '-'):>9}"
            f"{p.get('wheel_mb', 0):>10}{plain:>14}{p.get('plain_cpu_s', '-'):>13}"
        )
    print(
        f"fetch {result['fetch_s']} s; cold total (fetch + builds + assemble) {result['cold_total_s']} s"
        + (f"; plain total {result['plain_total_s']} s (* = stopped or failed)" if args.baseline else "")
    )
    print(f"no-op doit wheels: {result['noop_s']} s (cold build of the same lock: {result['cold_total_s']} s)")
    print(
        f"restore from cache (wheels/ and doit state deleted): {result['restore_s']} s, "
        f"{result['restore_per_wheel_s']} s per wheel"
    )
    if args.repro:
        print(repro_line(result))
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
