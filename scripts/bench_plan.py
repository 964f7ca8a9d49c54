#!/usr/bin/env python3
"""`doit plan`'s forecast against the build it forecasts, for the kinds of change of issue 39, side by side.

Runs the installed tool (or the checkout's doit) in a directory holding the lock and its patches, each
scenario as a plan (``plan format=json``: its forecast, its predicted units, how long the plan took) and
then the build it forecast (``wheels``: its wall time, each package's object-cache hits and misses):

- ``cold``: empty caches, the lock's hints alone;
- ``hints``: the plan of ``cold`` alone, without its build (where a build of the same kind ran elsewhere on
  this host: the docs walk's, ``--hints-actual`` gives its seconds);
- ``records``: empty wheel and object caches, but the build records (``timings/``) of ``cold``'s run (or of
  the cache ``--records-from`` names);
- ``patchline``: a patch of ``--package`` gains a trailing empty line (the patched tree is the same);
- ``edit``: a line of code appended to one ``.cu`` file of ``--package`` (a hunk added to its last patch);
- ``noop``: nothing changed since the last build (one unmeasured ``wheels`` first settles the earlier scenario's
  restored patches: its wheel placed from the cache).

The lock directory's patches are restored after each scenario. Standard library only::

    python3 scripts/bench_plan.py --tool ~/reprostack/bin/reprostack --dir LOCKDIR --lock sources.lock \\
        --profile no-fa2 --mirror MIRROR --work /tmp/bench-plan --package transformer_engine

prints a Markdown table (also ``--out FILE``) and writes every run's output under ``--work``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCENARIOS = ("cold", "hints", "records", "patchline", "edit", "noop")


def run(cmd: list[str], cwd: Path, log: Path) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    took = time.monotonic() - start
    log.write_text(f"$ {' '.join(cmd)}\n# exit {done.returncode} in {took:.1f} s\n{done.stdout}\n{done.stderr}")
    return done.returncode, done.stdout + done.stderr, took


def built(output: str) -> dict[str, tuple[float, int, int]]:
    """package -> (seconds, object-cache hits, misses) from a build's 'built PKG in Xs ...' lines."""
    found = {}
    for m in re.finditer(r"^built (\S+) in ([\d.]+)s(.*)$", output, re.M):
        counts = re.search(r"object cache (\d+) hits / (\d+) misses", m.group(3))
        hits, misses = (int(counts.group(1)), int(counts.group(2))) if counts else (0, 0)
        found[m.group(1)] = (float(m.group(2)), hits, misses)
    return found


def predicted(plan: dict[str, Any]) -> dict[str, str]:
    """package -> 'hit/preprocessed/compile' of the plan's unit prediction, or its action."""
    out = {}
    for p in plan.get("packages", []):
        units = p.get("units")
        if p.get("action") == "build" and units:
            c = units.get("counts", {})
            out[p["package"]] = f"{c.get('hit', 0)}/{c.get('preprocessed', 0)}/{c.get('compile', 0)}"
        elif p.get("action") == "build":
            out[p["package"]] = "build (no unit record)"
    return out


def source_file(cache: Path, package_dir: str) -> tuple[Path, str]:
    """A .cu file of the package's cached source tree, and its path relative to the tree."""
    for tree in sorted(cache.glob("sources/*/tree")):
        files = sorted(tree.glob(f"{package_dir}/**/*.cu"))
        if files:
            smallest = min(files, key=lambda p: (p.stat().st_size, str(p)))
            return smallest, smallest.relative_to(tree).as_posix()
    raise SystemExit(f"no .cu file under {package_dir}/ in any source tree of {cache}")


def edit_hunk(path: Path, rel: str) -> str:
    """A patch section appending one line of code to ``rel`` (context: its last line)."""
    lines = path.read_text().splitlines()
    if not path.read_text().endswith("\n"):
        raise SystemExit(f"{rel} does not end with a newline: pick another file")
    n = len(lines)
    return (
        f"diff --git a/{rel} b/{rel}\n--- a/{rel}\n+++ b/{rel}\n@@ -{n},1 +{n},2 @@\n {lines[-1]}\n"
        "+static const int reprostack_bench_plan_edit = 1;\n"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tool", required=True, help="the reprostack command (or 'PYTHON -m doit -f DODO')")
    ap.add_argument("--dir", required=True, type=Path, help="the directory of the lock and its patches/")
    ap.add_argument("--lock", default="sources.lock")
    ap.add_argument("--profile", default="no-fa2")
    ap.add_argument("--mirror", default="")
    ap.add_argument("--work", required=True, type=Path, help="caches, wheelhouses and logs of the runs")
    ap.add_argument("--package", default="transformer_engine", help="the package the patch and edit scenarios change")
    ap.add_argument("--package-dir", default="transformer_engine", help="where its .cu files are in its tree")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--extra", default="", help="more variables for every run, e.g. 'jobs=64'")
    ap.add_argument("--records-from", type=Path, help="the cache whose timings/ the records scenario starts from")
    ap.add_argument("--hints-actual", type=float, help="seconds of a cold build like the hints scenario's plan")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    tool = args.tool.split()
    lockdir = args.dir.resolve()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    patches = lockdir / "patches" / args.package
    listed = [p for p in sorted(patches.glob("*.patch"))]
    if not listed:
        raise SystemExit(f"no patches in {patches}")
    last = listed[-1]
    saved = {p: p.read_bytes() for p in listed}
    common = [f"lock={lockdir / args.lock}", f"profile={args.profile}", *args.extra.split()]
    if args.mirror:
        common.append(f"mirror={args.mirror}")
    rows = []
    cache = work / "cache-cold"
    wheels = work / "wheels-cold"
    for scenario in [s for s in args.scenarios.split(",") if s]:
        if scenario not in SCENARIOS:
            raise SystemExit(f"unknown scenario {scenario!r}: {', '.join(SCENARIOS)}")
        if scenario == "hints":
            cache, wheels = work / "cache-hints", work / "wheels-hints"
        if scenario == "records":  # a new cache that keeps only the build records of the cold run
            cache, wheels = work / "cache-records", work / "wheels-records"
            shutil.copytree((args.records_from or work / "cache-cold") / "timings", cache / "timings")
        try:
            if scenario == "patchline":
                listed[0].write_bytes(saved[listed[0]] + b"\n")
            elif scenario == "edit":
                path, rel = source_file(cache, args.package_dir)
                last.write_bytes(saved[last] + edit_hunk(path, rel).encode())
            variables = [*common, f"cache={cache}", f"wheels={wheels}"]
            if scenario == "noop":  # the earlier scenario's patches are restored: settle first (its cached wheel)
                code, _, _ = run([*tool, "wheels", *variables], lockdir, work / "noop-settle.log")
                if code != 0:
                    raise SystemExit(f"noop: the settling build failed, see {work / 'noop-settle.log'}")
            code, out, plan_s = run([*tool, "plan", "format=json", *variables], lockdir, work / f"{scenario}-plan.log")
            if code != 0:
                raise SystemExit(f"{scenario}: plan failed, see {work / f'{scenario}-plan.log'}")
            plan = json.loads(out[out.index("{") : out.rindex("}") + 1])
            if scenario == "hints":  # the build is the one --hints-actual names
                out, wall = "", args.hints_actual or 0.0
            else:
                code, out, wall = run([*tool, "wheels", *variables], lockdir, work / f"{scenario}-wheels.log")
                if code != 0:
                    raise SystemExit(f"{scenario}: wheels failed, see {work / f'{scenario}-wheels.log'}")
        finally:
            for p, data in saved.items():
                p.write_bytes(data)
        forecast = float(plan["forecast"]["wall_s"])
        got = built(out)
        units = predicted(plan)
        rows.append(
            {
                "scenario": scenario,
                "forecast_s": forecast,
                "actual_s": round(wall, 1),
                "ratio": round(forecast / wall, 2) if wall > 0 else None,
                "plan_s": round(plan_s, 2),
                # of which the staged trees re-derived and the units compared (the rest: start-up, the lock,
                # the keys, the toolchain's probe where the cache has not memoised it)
                "stage_s": round(sum((p.get("units") or {}).get("stage_s", 0.0) for p in plan["packages"]), 2),
                "complete": plan["forecast"].get("complete"),
                "predicted": units,
                "built": {k: {"s": v[0], "hits": v[1], "misses": v[2]} for k, v in got.items()},
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    lines = [
        f"`doit plan` against `doit wheels`, lock {args.lock}, profile {args.profile}, tool {' '.join(tool)}",
        "",
        "| change | forecast | actual | ratio | plan took (staging, units) | units predicted (hit/pre/compile) "
        "| built (hits/misses) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pred = "; ".join(f"{k} {v}" for k, v in r["predicted"].items()) or "nothing to build"
        made = "; ".join(f"{k} {v['hits']}/{v['misses']} in {v['s']:.0f} s" for k, v in r["built"].items()) or "none"
        lines.append(
            f"| {r['scenario']} | {r['forecast_s']:.1f} s | {r['actual_s']:.1f} s | {r['ratio']} "
            f"| {r['plan_s']:.2f} s ({r['stage_s']:.2f} s) | {pred} | {made} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
