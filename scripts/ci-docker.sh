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
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "ci-docker: $*" >&2; }
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"

missing=()
if ! docker info >/dev/null 2>&1 && ! { command -v dockerd && command -v docker; } >/dev/null; then
    missing+=(docker.io)
fi
command -v skopeo >/dev/null || missing+=(skopeo)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v docker-registry >/dev/null || missing+=(docker-registry)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx-light)  # the remote cache tests' server
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]}"
    $SUDO apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
fi

if ! docker info >/dev/null 2>&1; then
    command -v dockerd >/dev/null || { log "no dockerd to start and no daemon to reach (DOCKER_HOST?)"; exit 1; }
    mkdir -p build
    log "starting dockerd (log: build/dockerd.log)"
    # setsid: the daemon outlives this script and is not stopped with CI's process group.
    $SUDO setsid dockerd >build/dockerd.log 2>&1 < /dev/null &
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && break
        sleep 1
    done
    docker info >/dev/null 2>&1 || { log "dockerd did not come up; last lines of build/dockerd.log:"; tail -20 build/dockerd.log >&2; exit 1; }
fi
log "docker $(docker version --format '{{.Server.Version}}') ready"
bash scripts/make-base-image.sh runtime
