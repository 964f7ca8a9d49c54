#!/bin/sh
# The runtime image's definition: the base, pinned by digest, plus the venv this
# script makes from the wheelhouse, offline, hash-checked and reproducibly.
#
# Run by `doit image` (tasks/image/image.py), never by hand: in a container of the
# base with no network, as root, with this directory and wheels/ (the
# wheelhouse's wheels and hash-pinned requirements.txt) copied to /reprostack:
#   install-wheels.sh PYTHON PREFIX WHEELS
# doit image then copies PREFIX out of the container and writes it as the
# image's one new layer, with the config (VIRTUAL_ENV, PREFIX/bin first on
# PATH, the labels) itself (tasks/image/layer.py): fixed times, sorted entries, so
# the same inputs give the same image ID. Neither the wheel files nor pip's
# work files end up in the image.
#
# The venv sees the base's own packages (torch, CUDA libraries) through
# --system-site-packages; only what the wheelhouse holds is installed, and
# only from it, but all of it: a wheel of the version the base already has (a
# patched SGLang) is installed into the venv too, where it shadows the base's
# copy. Same bytes every time: SOURCE_DATE_EPOCH comes from doit image,
# PYTHONHASHSEED is fixed, pip installs without compiling, and compileall then
# writes every .pyc with --invalidation-mode checked-hash (the source's hash
# in the header, not its mtime). Where the base has uv on PATH, uv installs
# the wheels instead of pip, with the same options (no pip needed then).
set -eu
python=$1
prefix=$2
wheels=$3
: "${SOURCE_DATE_EPOCH:?doit image sets it}"
export PYTHONHASHSEED=0 PYTHONDONTWRITEBYTECODE=1

echo "reprostack: step check the base's python ($python)"
command -v "$python" >/dev/null 2>&1 || {
    echo "reprostack: the base has no '$python' on PATH: set [image] python in the lock" >&2
    exit 1
}
"$python" -c 'import sys; print("python", sys.version.split()[0], sys.executable)'

echo "reprostack: step create the venv $prefix"
err=$(mktemp)
if "$python" -m venv --system-site-packages "$prefix" 2>"$err"; then
    pip="$prefix/bin/python -m pip"
else
    # A base without ensurepip (Debian/Ubuntu without python3-venv): a venv
    # without pip, filled by the base's own pip (needs pip >= 22.3).
    cat "$err" >&2
    rm -rf "$prefix"
    "$python" -m venv --system-site-packages --without-pip "$prefix"
    pip="$python -m pip --python $prefix/bin/python"
fi
rm -f "$err"

# uv where the base has it on PATH, pip otherwise: the same wheels, options and checks.
uv=$(command -v uv || true)
uv_run() {
    # None of the base's uv settings (UV_* variables, uv.toml, pyproject.toml); no network, no cache.
    env -i PATH="$PATH" HOME="${HOME:-/root}" UV_NO_CONFIG=1 UV_OFFLINE=1 UV_NO_CACHE=1 UV_NO_PROGRESS=1 \
        UV_PYTHON_DOWNLOADS=never "$uv" "$@"
}
if [ -n "$uv" ]; then
    echo "reprostack: step uv pip install --no-index --require-hashes -r requirements.txt"
    uv_run --version
    # pip's options below, in uv's words: --reinstall is --ignore-installed (uv does not even see
    # the base's packages), files copied, not linked; uv compiles nothing unless asked to.
    uv_run pip install --python "$prefix/bin/python" --no-index --no-deps --reinstall --require-hashes \
        --link-mode copy --find-links "$wheels" -r "$wheels/requirements.txt"
else
    echo "reprostack: step pip install --no-index --require-hashes -r requirements.txt"
    # --no-deps: dependencies come from the base (torch) and are checked by `doit verify_image`.
    # --ignore-installed: without it pip takes a wheel whose version the base already has as
    # "already satisfied" and installs nothing, so the base's unpatched copy would stay in use.
    PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
        $pip install --no-index --no-deps --ignore-installed --no-cache-dir --require-hashes --no-compile \
        --find-links "$wheels" -r "$wheels/requirements.txt"
fi

site=$(ls -d "$prefix"/lib/python*/site-packages)
echo "reprostack: step list what the venv holds"
if [ -n "$uv" ]; then
    uv_run pip list --python "$prefix/bin/python" --format freeze
else
    $pip list --path "$site" --format freeze
fi

echo "reprostack: step compile the venv's .py files (checked-hash .pyc)"
# As pip does, a file that does not compile (a template, Python 2 code) is reported and skipped.
"$prefix/bin/python" -m compileall -q -f -j 0 --invalidation-mode checked-hash "$site" ||
    echo "reprostack: compileall could not compile the files above; they are left without .pyc"
