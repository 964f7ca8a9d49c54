#!/usr/bin/env bash
# CI's container side: a docker daemon, the tools the image tests use, and the
# runtime base image. Prints the base's image ID on stdout (for REPRO_TEST_BASE);
# progress goes to stderr.
#
#   - docker, skopeo, mmdebstrap, docker-registry, nginx: installed from Debian's
#     packages when missing (needs root or sudo, and the Debian mirror once);
#   - dockerd: started in the background when `docker info` fails, its log in
#     build/dockerd.log (it keeps running after CI, so the next run is quick);
#   - the base: scripts/make-base-image.sh runtime (cached by a content tag).
#
# Outside CI (CI unset or false) a machine that cannot do this (no root, an unprivileged
# container where dockerd cannot start) is not an error: one line says why, nothing is printed on
# stdout, and the tests that need docker skip with that reason. With CI=true it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "ci-docker: $*" >&2; }
case "$(printf %s "${CI:-}" | tr '[:upper:]' '[:lower:]')" in
    1|true|yes|on) IN_CI=1 ;;
    *) IN_CI=0 ;;
esac
give_up() {
    log "$*"
    if [ "$IN_CI" = 1 ]; then exit 1; fi
    log "not CI: the tests that need docker, nginx or a registry skip with the reason (CI=true makes them required)"
    exit 0
}
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo"; else SUDO="none"; fi
fi

missing=()
if ! docker info >/dev/null 2>&1 && ! { command -v dockerd && command -v docker; } >/dev/null; then
    missing+=(docker.io)
fi
command -v skopeo >/dev/null || missing+=(skopeo)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v docker-registry >/dev/null || missing+=(docker-registry)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)  # the remote cache tests' server (Ubuntu 24.04 has no nginx-light)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$SUDO" = none ] || ! command -v apt-get >/dev/null; then
        give_up "cannot install ${missing[*]} (needs root or sudo, and apt-get)"
    fi
    [ "$SUDO" = none ] && SUDO=""
    log "installing ${missing[*]}"
    if ! { $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q \
            --no-install-recommends "${missing[@]}"; } >&2; then
        give_up "apt-get could not install ${missing[*]}"
    fi
fi
[ "$SUDO" = none ] && SUDO=""

if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || give_up "no dockerd to start and no daemon to reach (DOCKER_HOST?)"
    mkdir -p build
    log "starting dockerd (log: build/dockerd.log)"
    # setsid: the daemon outlives this script and is not stopped with CI's process group.
    $SUDO setsid dockerd >build/dockerd.log 2>&1 < /dev/null &
    for _ in $(seq 30); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    if ! docker info >/dev/null 2>&1; then
        tail -5 build/dockerd.log >&2 || true
        give_up "dockerd did not come up (an unprivileged container cannot run it; log: build/dockerd.log)"
    fi
fi
log "docker $(docker version --format '{{.Server.Version}}') ready"
bash scripts/make-base-image.sh runtime || give_up "could not make the image tests' base (scripts/make-base-image.sh runtime)"
