#!/usr/bin/env bash
# Newcomer's first run: set up .venv, publish the example upstreams (our fixture
# packages as git repositories, an archive and a package index) on loopback,
# build the example lock into wheels/ and verify the wheelhouse.
#
#   bash examples/quickstart.sh              # what this host can build (no nvcc: the CUDA fixture is left out)
#   bash examples/quickstart.sh --hermetic   # also the CUDA fixture with nvcc from PyPI wheels (examples/hermetic.lock,
#                                            # about 150 MB from PyPI), into wheels-hermetic/
# Other arguments go to doit (e.g. profile=quick).
set -euo pipefail
cd "$(dirname "$0")/.."
HERMETIC=0
args=()
for a in "$@"; do
  case "$a" in
    --hermetic) HERMETIC=1 ;;
    *) args+=("$a") ;;
  esac
done
say() { echo "quickstart: $*"; }
bash scripts/bootstrap.sh
DOIT=.venv/bin/doit  # the venv's doit: it runs builds with the venv's pinned tools (ninja 1.13), activated or not
PORT=8737  # the port examples/example.lock names
.venv/bin/python tests/fixtures/make_fixtures.py build/example-upstream >/dev/null
SERVED=build/example-upstream.serve.log
.venv/bin/python tests/fixtures/serve.py build/example-upstream --port "$PORT" >"$SERVED" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
# Go on once it listens (it says so), not after a guess: a loaded host can take longer than a second.
for _ in $(seq 300); do
  grep -q '^serving ' "$SERVED" 2>/dev/null && break
  kill -0 "$SERVER" 2>/dev/null || break
  sleep 0.1
done
grep -q '^serving ' "$SERVED" 2>/dev/null || {
  say "cannot serve the example upstreams on 127.0.0.1:$PORT; the server said:" >&2
  sed 's/^/  /' "$SERVED" >&2
  exit 1
}
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
say "done: the wheelhouse is in wheels/ (manifest.json, requirements.txt, simple/, sbom.cdx.json, provenance/);"
say "  build logs in build/logs/, the build timeline in build/trace.json. Next (README, \"What next\"):"
say "  .venv/bin/doit list        # the tasks     .venv/bin/doit repro    # rebuild and compare bit for bit"
