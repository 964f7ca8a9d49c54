#!/usr/bin/env bash
# Newcomer's first run: set up, publish the example upstreams (our fixture
# packages as git repositories, an archive and a package index) on loopback,
# build the example lock into wheels/ and verify the wheelhouse.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/cuda/bin:$PATH"
bash scripts/bootstrap.sh
PORT=8737  # the port examples/example.lock names
.venv/bin/python tests/fixtures/make_fixtures.py build/example-upstream >/dev/null
.venv/bin/python tests/fixtures/serve.py build/example-upstream --port "$PORT" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
sleep 1
kill -0 "$SERVER" 2>/dev/null || { echo "quickstart: cannot serve on 127.0.0.1:$PORT (port busy?)" >&2; exit 1; }
# PyPI-kind sources are found through pip's configured index; point it at ours.
export PIP_INDEX_URL="http://127.0.0.1:$PORT/simple"
.venv/bin/python -m doit wheels lock=examples/example.lock "$@"
.venv/bin/python -m doit verify lock=examples/example.lock "$@"
