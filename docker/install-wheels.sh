#!/bin/sh
# Install the wheelhouse into a virtual environment, offline and hash-checked.
# Runs inside `docker build --network none` (docker/Dockerfile):
#   install-wheels.sh PYTHON PREFIX WHEELS
# The venv sees the base's own packages (torch, CUDA libraries) through
# --system-site-packages; only what the wheelhouse holds is installed, and
# only from it.
set -eu
python=$1
prefix=$2
wheels=$3

echo "reprostack: step check the base's python ($python)"
command -v "$python" >/dev/null 2>&1 || {
    echo "reprostack: the base has no '$python' on PATH: set [image] python in the lock" >&2
    exit 1
}
"$python" -c 'import sys; print("python", sys.version.split()[0], sys.executable)'

echo "reprostack: step create the venv $prefix"
if "$python" -m venv --system-site-packages "$prefix" 2>/tmp/venv.err; then
    pip="$prefix/bin/python -m pip"
else
    # A base without ensurepip (Debian/Ubuntu without python3-venv): a venv
    # without pip, filled by the base's own pip (needs pip >= 22.3).
    cat /tmp/venv.err >&2
    rm -rf "$prefix"
    "$python" -m venv --system-site-packages --without-pip "$prefix"
    pip="$python -m pip --python $prefix/bin/python"
fi

echo "reprostack: step pip install --no-index --require-hashes -r requirements.txt"
# --no-deps: dependencies come from the base (torch) and are checked by `doit verify_image`.
PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
    $pip install --no-index --no-deps --no-cache-dir --require-hashes \
    --find-links "$wheels" -r "$wheels/requirements.txt"

echo "reprostack: step list what the venv holds"
$pip list --path "$(ls -d "$prefix"/lib/python*/site-packages)" --format freeze
