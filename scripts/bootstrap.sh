#!/usr/bin/env bash
# Create .venv with this project's pinned dependencies and the example lock's build
# requirements (what the quickstart's build needs). The venv sees the system's site-packages,
# so a host's own torch and CUDA wheels (a GPU host's) stay in use.
#
#   bash scripts/bootstrap.sh           # the tool and the example's build requirements (extra `example`)
#   bash scripts/bootstrap.sh --tests   # also the test tools and Ray for the cluster tests (extras `test`,
#                                       # `cluster`: what .ci/run needs); CI=true implies it
#
# torch: an importable one is kept. Otherwise torch 2.13.0 is installed only where
# that costs little: when the index pip is configured with offers a CPU build of it
# (pip's dry run tells which file it would take, without downloading it), or when
# CI=true (the torch-extension tests need it). PyPI itself offers only the CUDA build
# (about 5 GB with the CUDA libraries it pulls in): then nothing is installed, one
# line says so, and the example lock's torch extension is left out of the quickstart.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "bootstrap: $*" >&2; }
is_ci() { case "$(printf %s "${CI:-}" | tr '[:upper:]' '[:lower:]')" in 1|true|yes|on) return 0 ;; esac; return 1; }
EXTRAS=example
for arg in "$@"; do
  case "$arg" in
    --tests) EXTRAS=example,test,cluster ;;
    *) say "unknown argument $arg (--tests: also the test and cluster extras)"; exit 2 ;;
  esac
done
if is_ci; then EXTRAS=example,test,cluster; fi
command -v git >/dev/null || { say "git is required (apt-get install git)"; exit 1; }
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    say "Python >= 3.11 is required ($PY is $("$PY" -V 2>&1)); set PYTHON=python3.11 or newer"; exit 1; }
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv || {
    say "cannot create the venv: install your distribution's venv module (apt-get install python3-venv)"; exit 1; }
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
# compat: a plain .pth entry for this checkout (the default import hook costs every run's start-up time).
"${PIP[@]}" install -q -e ".[$EXTRAS]" --config-settings editable_mode=compat
# Our modules' bytecode, written once here: a shell with PYTHONDONTWRITEBYTECODE set (as some
# hosts and CI runners do) would otherwise compile them on every run, a third of a no-op's time.
.venv/bin/python -m compileall -q tasks dodo.py >/dev/null

TORCH="torch==2.13.0"
if .venv/bin/python -c 'import torch' 2>/dev/null; then
  say "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)') (already installed)"
elif is_ci; then
  say "installing $TORCH (CI: the torch-extension tests need it)"
  "${PIP[@]}" install -q "$TORCH"
else
  # The file pip would install, from its dry run's report (no download of the wheel itself).
  url=$("${PIP[@]}" install -q --dry-run --no-deps --ignore-installed --report - "$TORCH" 2>/dev/null |
        .venv/bin/python -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["download_info"]["url"])' \
        2>/dev/null || true)
  case "$url" in
    *%2Bcpu*|*+cpu*)
      say "installing $TORCH, CPU build (${url##*/})"
      "${PIP[@]}" install -q "$TORCH" ;;
    *)
      if [ -n "$url" ]; then
        say "torch not installed: your package index offers $TORCH only as a CUDA build (${url##*/}: about 5 GB with its CUDA libraries)."
      else
        say "torch not installed: your package index offers no wheel of $TORCH for this Python."
      fi
      say "  The example's torch extension (repro_torchext) is left out. To build it too, the CPU build (about 200 MB):"
      say "  .venv/bin/python -m pip install $TORCH --index-url https://download.pytorch.org/whl/cpu" ;;
  esac
fi
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  say "no nvcc: the example's CUDA extension (repro_cuda) is left out; the real stack needs a CUDA toolkit"
  say "  (bash examples/quickstart.sh --hermetic builds it with nvcc from PyPI wheels instead: about 150 MB)"
fi
say "ready: source .venv/bin/activate, then doit list (or .venv/bin/doit ... without activating)"
