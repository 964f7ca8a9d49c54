#!/usr/bin/env python3
"""Build the example lock's image several times from the same inputs: time each `doit image`, compare digests.

    .venv/bin/python scripts/bench_image_repro.py [--base IMAGE_ID] [--runs 2] [--repo CHECKOUT] [--out f.json]

The example lock's ``quick`` profile (repro_pure with its patch, repro_pybind,
repro_cuda for sm_90a), its sources served on loopback. The wheelhouse is
built once (cold) in the first workspace; every run then gets a workspace of
its own (another directory, a copy of the cache, so the same wheels) and a
cold `doit image`: the previous run's image removed first, and the docker
build cache of an install stage (``label=org.reprostack.stage=install``, made
by checkouts that still `docker build`) pruned. Prints each run's time, image
ID and last layer's diff_id, and whether they are all the same.

``--repo`` runs another checkout's dodo.py and docker/ (say, main's, for the
figures before a change) with this interpreter. The sources are served on
the example lock's own port (8737) by default, so the lock, and with it the
image ID, is the same from one invocation to the next.
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from bench_image import run  # noqa: E402  (one way to run and log a command for both image benchmarks)

PROFILE = "quick"
NAME = "reprostack-bench-repro"


def docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=False).stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="base image ID (default: scripts/make-base-image.sh runtime)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose dodo.py and docker/ run")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    ap.add_argument(
        "--port", type=int, default=8737, help="the sources' server port: the example lock's 8737 keeps its hash"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    repo = args.repo.resolve()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-image-repro-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "bench.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PATH=f"/usr/local/cuda/bin:{os.environ.get('PATH', '')}")
    env = {k: v for k, v in env.items() if not k.startswith("REPRO_")}
    base = args.base or run(["bash", str(REPO / "scripts" / "make-base-image.sh"), "runtime"], env=env, log=log)[1]
    base = base.strip().splitlines()[-1]

    sys.path.insert(0, str(REPO / "tests" / "fixtures"))
    from make_fixtures import publish
    from serve import FixtureServer

    publish(work / "upstream")
    server = FixtureServer(work / "upstream", port=args.port).start()
    runs: list[dict[str, Any]] = []
    try:
        lock_text = (repo / "examples" / "example.lock").read_text().replace("http://127.0.0.1:8737", server.url)
        lock_text = lock_text.replace('docker_dir = "../docker"', f'docker_dir = "docker"\nname = "{NAME}"')
        env.update(PIP_INDEX_URL=f"{server.url}/simple", PIP_CONFIG_FILE=os.devnull)
        for n in range(1, args.runs + 1):
            ws = work / f"run-{n}"
            shutil.rmtree(ws, ignore_errors=True)
            ws.mkdir()
            (ws / "example.lock").write_text(lock_text)
            shutil.copytree(repo / "examples" / "patches", ws / "patches")
            shutil.copytree(repo / "docker", ws / "docker")
            if n > 1:
                shutil.copytree(work / "run-1" / "cache", ws / "cache", ignore=shutil.ignore_patterns("*.lock"))
            settings = [f"lock={ws / 'example.lock'}", f"cache={ws / 'cache'}", f"profile={PROFILE}", f"base={base}"]

            def doit(target: str, ws: Path = ws, settings: list[str] = settings) -> tuple[float, str]:
                cmd = [sys.executable, "-m", "doit", "-f", str(repo / "dodo.py"), "-d", str(ws), target, *settings]
                return run(cmd, env=env, log=log)

            doit("wheels")
            for tag in docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}", NAME).split():
                docker("image", "rm", tag)
            docker("image", "prune", "--force", "--filter", "label=org.reprostack.stage=install")
            seconds, out = doit("image")
            tag = next(line.split()[2] for line in out.splitlines() if line.startswith("built image "))
            info = json.loads(docker("image", "inspect", tag))[0]
            runs.append(
                {
                    "run": n,
                    "image_s": round(seconds, 2),
                    "tag": tag,
                    "id": info["Id"],
                    "layers": info["RootFS"]["Layers"],
                }
            )
            print(f"run {n}: doit image {seconds:.1f} s  {tag}  id {info['Id']}  layer {info['RootFS']['Layers'][-1]}")
    finally:
        server.stop()
        for tag in docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}", NAME).split():
            docker("image", "rm", tag)
    same = len({r["id"] for r in runs}) == 1 and len({tuple(r["layers"]) for r in runs}) == 1
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    result = {
        "host": {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "docker": docker("version", "--format", "{{.Server.Version}}").strip(),
        "repo_commit": commit.stdout.strip() or "unknown",
        "base": base,
        "runs": runs,
        "identical": same,
    }
    print(
        f"{'identical' if same else 'DIFFERENT'}: {args.runs} builds, image IDs {sorted({r['id'][7:19] for r in runs})}"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
