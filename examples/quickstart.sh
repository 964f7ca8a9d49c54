#!/usr/bin/env bash
# Newcomer's first run: set up .venv, publish the example upstreams (our fixture
# packages as git repositories, an archive and a package index) on loopback,
# build the example lock into wheels/ and verify the wheelhouse.
#
#   bash examples/quickstart.sh              # what this host can build (no nvcc: the CUDA fixture is left out)
#   bash examples/quickstart.sh --hermetic   # also the CUDA fixture with nvcc from PyPI wheels (examples/hermetic.lock,
#                                            # about 150 MB from PyPI), into wheels-hermetic/
#   bash examples/quickstart.sh --port 9000  # serve the upstreams on this port (or QUICKSTART_PORT=9000); by default
#                                            # the example lock's 8737, or any free port when 8737 is taken
# Other arguments go to doit (e.g. profile=quick).
set -euo pipefail
cd "$(dirname "$0")/.."
HERMETIC=0
PORT="${QUICKSTART_PORT:-}"
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --hermetic) HERMETIC=1 ;;
    --port) PORT="${2:?--port needs a number}"; shift ;;
    --port=*) PORT="${1#--port=}" ;;
    *) args+=("$1") ;;
  esac
  shift
done
say() { echo "quickstart: $*"; }
case "$PORT" in
  ""|[0-9]|[0-9][0-9]|[0-9][0-9][0-9]|[0-9][0-9][0-9][0-9]|[0-9][0-9][0-9][0-9][0-9]) ;;
  *) say "--port $PORT: give a port number (0: any free one)" >&2; exit 2 ;;
esac
bash scripts/bootstrap.sh
DOIT=.venv/bin/doit  # the venv's doit: it runs builds with the venv's pinned tools (ninja 1.13), activated or not
LOCK_PORT=8737  # the port examples/example.lock names
.venv/bin/python tests/fixtures/make_fixtures.py build/example-upstream >/dev/null
SERVED=build/example-upstream.serve.log
SERVER=""
trap '[ -z "$SERVER" ] || kill $SERVER 2>/dev/null || true' EXIT
serve() {  # serve the upstreams on port $1 (0: any free one); 0 once it listens
  .venv/bin/python tests/fixtures/serve.py build/example-upstream --port "$1" >"$SERVED" 2>&1 &
  SERVER=$!
  # Go on once it listens (it says so), not after a guess: a loaded host can take longer than a second.
  for _ in $(seq 300); do
    grep -q '^serving ' "$SERVED" 2>/dev/null && return 0
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 0.1
  done
  grep -q '^serving ' "$SERVED" 2>/dev/null
}
if [ -n "$PORT" ]; then
  serve "$PORT" || { say "cannot serve the example upstreams on 127.0.0.1:$PORT; the server said:" >&2
                     sed 's/^/  /' "$SERVED" >&2; exit 1; }
elif ! serve "$LOCK_PORT"; then
  say "port $LOCK_PORT is taken ($(head -1 "$SERVED")); serving on a free port instead"
  serve 0 || { say "cannot serve the example upstreams; the server said:" >&2; sed 's/^/  /' "$SERVED" >&2; exit 1; }
fi
PORT=$(sed -n 's|^serving .* at http://127\.0\.0\.1:\([0-9]*\) .*|\1|p' "$SERVED")
say "serving the example upstreams at http://127.0.0.1:$PORT (log: $SERVED)"
if [ "$PORT" != "$LOCK_PORT" ]; then
  # The lock names its upstreams at port 8737. Fetch them from this port through a copy of the lock
  # that names this one: the source cache keeps each tree by its hash, so the example lock's own
  # builds below find them there and never ask the lock's URLs.
  FETCH_LOCK=build/example-upstream/example-port-$PORT.lock
  sed -e "s|http://127.0.0.1:$LOCK_PORT/|http://127.0.0.1:$PORT/|g" \
      -e 's|^patches_dir = "patches"|patches_dir = "../../examples/patches"|' \
      -e 's|^docker_dir = "../docker"|docker_dir = "../../docker"|' examples/example.lock >"$FETCH_LOCK"
  PIP_INDEX_URL="http://127.0.0.1:$PORT/simple" "$DOIT" fetch lock="$FETCH_LOCK" ${args[@]+"${args[@]}"}
fi
# This workspace's default lock: a later `doit ...` without lock= keeps to the example.
if [ ! -e reprostack.toml ]; then
  printf '# Written by examples/quickstart.sh: defaults of this workspace (docs/tasks.md, "Variables").\nlock = "examples/example.lock"\n' >reprostack.toml
  say "wrote reprostack.toml: doit here now defaults to lock=examples/example.lock (edit or delete it to change that)"
fi
LOOPBACK="http://127.0.0.1:$PORT/simple"
# PyPI-kind sources are found through pip's configured index; point it at ours.
PIP_INDEX_URL="$LOOPBACK" "$DOIT" wheels lock=examples/example.lock ${args[@]+"${args[@]}"}
PIP_INDEX_URL="$LOOPBACK" "$DOIT" verify lock=examples/example.lock ${args[@]+"${args[@]}"}
if [ "$HERMETIC" = 1 ]; then
  # The hermetic toolchain's wheels come from PyPI, the fixture's sdist from our index.
  PIP_EXTRA_INDEX_URL="$LOOPBACK" "$DOIT" wheels lock=examples/hermetic.lock wheels=wheels-hermetic \
    ${args[@]+"${args[@]}"}
  PIP_EXTRA_INDEX_URL="$LOOPBACK" "$DOIT" verify lock=examples/hermetic.lock wheels=wheels-hermetic \
    ${args[@]+"${args[@]}"}
fi
if [ "$HERMETIC" = 1 ]; then
  say "done: the wheelhouses are in wheels/ (examples/example.lock) and wheels-hermetic/ (examples/hermetic.lock, with"
  say "  the CUDA fixture built by nvcc from PyPI wheels); each holds manifest.json, requirements.txt, simple/, sbom.cdx.json, provenance/;"
else
  say "done: the wheelhouse is in wheels/ (manifest.json, requirements.txt, simple/, sbom.cdx.json, provenance/);"
fi
say "  build logs in build/logs/, the build timeline in build/trace.json. Next (README, \"What next\"):"
say "  .venv/bin/doit list        # the tasks     .venv/bin/doit repro    # rebuild and compare bit for bit"
