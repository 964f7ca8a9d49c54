#!/usr/bin/env bash
# Create .venv with this project's pinned dependencies, the example lock's build
# requirements and the test tools. The venv sees the system's site-packages, so
# a host's own torch and CUDA wheels (a GPU host's) stay in use; where no torch
# is importable, the CPU build of torch 2.13.0 is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[example,test]'
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  .venv/bin/python -m pip install -q --disable-pip-version-check 'torch==2.13.0'
fi
command -v git >/dev/null || { echo "bootstrap: git is required (apt-get install git)" >&2; exit 1; }
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || \
  echo "bootstrap: warning: nvcc not found; the CUDA fixture and the real stack need a CUDA toolkit" >&2
echo "bootstrap: ready (.venv/bin/python -m doit)"
