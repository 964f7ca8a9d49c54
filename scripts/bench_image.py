#!/usr/bin/env python3
"""Measure `doit image` against the reference images' way of building the same content.

    .venv/bin/python scripts/bench_image.py [--base IMAGE_ID] [--out bench-image.json]

One run, both sides on the same base (by default the Debian-made runtime base
of scripts/make-base-image.sh) and the same content: the example lock's
``quick`` profile (repro_pure with its patch, repro_pybind, repro_cuda for
sm_90a), its sources served on loopback.

- **reprostack**: a cold `doit wheels` (empty cache: fetch, patch, compile,
  normalise) then a cold `doit image` (the image stage's docker build cache
  pruned first), then three no-op `doit image` runs.
- **reference style**, as the public Dockerfiles do it: compilers
  (build-essential, python3-dev, git from Debian), the CUDA 13.0 compiler
  (nvcc and its pieces from PyPI), the patched sources copied in and built
  in the image with `pip install --no-build-isolation`, leaving the
  compilers, the sources and their build trees in the image. `docker build
  --no-cache`; apt fetches from the Debian mirror during the build (as
  theirs do), the PyPI wheels are downloaded beforehand into the context.

Prints the figures side by side (build time, image size, size above the
base, whether a compiler is in the image) and writes them as JSON with --out.
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
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PROFILE = "quick"
NAME = "reprostack-bench"
REFERENCE_TAG = "reprostack-bench-reference:latest"
CUDA_WHEELS = [
    "nvidia-cuda-nvcc==13.0.*",
    "nvidia-cuda-runtime==13.0.*",
    "nvidia-cuda-crt==13.0.*",
    "nvidia-nvvm==13.0.*",
    "nvidia-cuda-cccl==13.0.*",
]
REFERENCE_DOCKERFILE = """\
# The reference images' way (see the README's seeds): a toolchain in the image,
# the sources copied in and built there; nothing removed afterwards.
FROM {base}
RUN apt-get update && apt-get install -y --no-install-recommends build-essential python3-dev git
COPY pip/ /tmp/pip/
RUN python3 -m pip install --break-system-packages --no-index --find-links /tmp/pip \\
        setuptools wheel pybind11 {cuda}
ENV CUDA_HOME=/usr/local/lib/python3.11/dist-packages/nvidia/cu13 \\
    PATH=/usr/local/lib/python3.11/dist-packages/nvidia/cu13/bin:$PATH \\
    LIBRARY_PATH=/usr/local/lib/python3.11/dist-packages/nvidia/cu13/lib \\
    REPRO_CUDA_ARCHS=sm_90a
COPY src/ /workspace/
RUN cd /workspace/repro_pure && python3 -m pip install --break-system-packages --no-build-isolation --no-deps . \\
 && cd /workspace/repro_pybind && python3 -m pip install --break-system-packages --no-build-isolation --no-deps . \\
 && cd /workspace/repro_cuda && python3 -m pip install --break-system-packages --no-build-isolation --no-deps .
"""


def run(cmd: list[str], *, env: dict[str, str], log: Path, cwd: Path | None = None) -> tuple[float, str]:
    """Run cmd with its output appended to log; (wall seconds, output); exit on failure."""
    start = time.monotonic()
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    wall = time.monotonic() - start
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n{res.stdout}{res.stderr}\n")
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({res.returncode}); see {log}\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return wall, res.stdout


def image_size(ref: str) -> int:
    out = subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", ref], capture_output=True, text=True)
    return int(out.stdout.strip())


def has_compiler(ref: str) -> bool:
    probe = "command -v cc || command -v nvcc || ls /usr/local/lib/python3*/dist-packages/nvidia/cu13/bin/nvcc"
    res = subprocess.run(["docker", "run", "--rm", "--network", "none", ref, "sh", "-c", probe], capture_output=True)
    return res.returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="base image ID (default: scripts/make-base-image.sh runtime)")
    ap.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", action="store_true", help="keep the two images")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-image-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "bench.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PATH=f"/usr/local/cuda/bin:{os.environ.get('PATH', '')}")
    base = args.base or run(["bash", str(REPO / "scripts" / "make-base-image.sh"), "runtime"], env=env, log=log)[1]
    base = base.strip().splitlines()[-1]

    sys.path.insert(0, str(REPO / "tests" / "fixtures"))
    from make_fixtures import publish
    from serve import FixtureServer

    publish(work / "upstream")
    server = FixtureServer(work / "upstream", port=0).start()
    try:
        text = (REPO / "examples" / "example.lock").read_text().replace("http://127.0.0.1:8737", server.url)
        text = text.replace('docker_dir = "../docker"', f'docker_dir = "{REPO / "docker"}"\nname = "{NAME}"')
        (work / "example.lock").write_text(text)
        shutil.copytree(REPO / "examples" / "patches", work / "patches", dirs_exist_ok=True)
        env.update(PIP_INDEX_URL=f"{server.url}/simple", PIP_CONFIG_FILE=os.devnull)

        def doit(*targets: str) -> tuple[float, str]:
            settings = [
                f"lock={work / 'example.lock'}",
                f"cache={work / 'cache'}",
                f"profile={PROFILE}",
                f"base={base}",
            ]
            cmd = [sys.executable, "-m", "doit", "-f", str(REPO / "dodo.py"), "-d", str(work), *targets, *settings]
            return run(cmd, env=env, log=log)

        # reprostack, cold: empty cache, no docker build cache of the image stage.
        shutil.rmtree(work / "cache", ignore_errors=True)
        subprocess.run(["docker", "image", "prune", "-f", "--filter", "label=org.reprostack.stage=install"],
                       capture_output=True, check=False)  # fmt: skip
        wheels_s, _ = doit("wheels")
        image_s, out = doit("image")
        tag = next(line.split()[2] for line in out.splitlines() if line.startswith("built image "))
        noop = [round(doit("image")[0], 2) for _ in range(3)]

        # Reference style: the same patched sources, built inside the image.
        ctx = work / "reference"
        shutil.rmtree(ctx, ignore_errors=True)
        (ctx / "src").mkdir(parents=True)
        for pkg in ("repro_pure", "repro_pybind", "repro_cuda"):
            doit(f"stage:{pkg}")
            shutil.copytree(work / "build" / "stage" / pkg, ctx / "src" / pkg)
        pip_env = {k: v for k, v in os.environ.items() if k != "PIP_INDEX_URL"}
        run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary", ":all:", "--python-version", "3.11",
             "--platform", "manylinux2014_x86_64", "-d", str(ctx / "pip"), "setuptools", "wheel", "pybind11",
             *CUDA_WHEELS], env=pip_env, log=log)  # fmt: skip
        (ctx / "Dockerfile").write_text(
            REFERENCE_DOCKERFILE.format(base=base, cuda=" ".join(f'"{w}"' for w in CUDA_WHEELS))
        )
        reference_s, _ = run(["docker", "build", "--no-cache", "--force-rm", "--tag", REFERENCE_TAG, str(ctx)],
                             env=dict(env, DOCKER_BUILDKIT="0"), log=log)  # fmt: skip
    finally:
        server.stop()

    base_size = image_size(base)
    ours, theirs = image_size(tag), image_size(REFERENCE_TAG)
    result: dict[str, Any] = {
        "host": {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "base": base,
        "base_mb": round(base_size / 1e6, 1),
        "reprostack": {
            "tag": tag,
            "cold_wheels_s": round(wheels_s, 1),
            "cold_image_s": round(image_s, 1),
            "cold_total_s": round(wheels_s + image_s, 1),
            "image_mb": round(ours / 1e6, 1),
            "above_base_mb": round((ours - base_size) / 1e6, 1),
            "compiler_in_image": has_compiler(tag),
            "noop_image_s": noop,
        },
        "reference": {
            "tag": REFERENCE_TAG,
            "build_s": round(reference_s, 1),
            "image_mb": round(theirs / 1e6, 1),
            "above_base_mb": round((theirs - base_size) / 1e6, 1),
            "compiler_in_image": has_compiler(REFERENCE_TAG),
        },
    }
    r, f = result["reprostack"], result["reference"]
    print(f"\nhost: {result['host']}; base {base[:19]} ({result['base_mb']} MB); example lock, profile {PROFILE}")
    print(f"{'':<34}{'reprostack':>18}{'reference style':>18}")
    print(f"{'build time, cold (s)':<34}{r['cold_total_s']:>18}{f['build_s']:>18}")
    print(
        f"{'  of which wheels / image (s)':<34}{str(r['cold_wheels_s']) + ' / ' + str(r['cold_image_s']):>18}{'-':>18}"
    )
    print(f"{'image size (MB)':<34}{r['image_mb']:>18}{f['image_mb']:>18}")
    print(f"{'above the base (MB)':<34}{r['above_base_mb']:>18}{f['above_base_mb']:>18}")
    print(f"{'compiler in the image':<34}{r['compiler_in_image']!s:>18}{f['compiler_in_image']!s:>18}")
    print(f"{'no-op rebuild (s)':<34}{', '.join(map(str, r['noop_image_s'])):>18}{'-':>18}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if not args.keep:
        subprocess.run(["docker", "image", "rm", tag, REFERENCE_TAG], capture_output=True, check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
