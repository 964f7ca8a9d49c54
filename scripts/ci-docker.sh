#!/usr/bin/env bash
# CI's container side: a docker daemon, the tools the image tests use, and the
# runtime base image. Prints the base's image ID on stdout (for REPRO_TEST_BASE);
# progress goes to stderr.
#
#   - docker, skopeo, mmdebstrap, docker-registry, nginx: installed from Debian's
#     packages when missing (needs root or sudo, and the Debian mirror once);
#   - dockerd: CI's own daemon, with its own socket, bridge, data and pid file
#     (CI_DOCKER_* below), started in the background unless it runs and works; its log
#     in build/dockerd.log (it keeps running after CI, so the next run is quick). A daemon
#     another process started (the host's, at /var/run/docker.sock) is never used: one
#     stopped or restarted under us, or its default bridge docker0 deleted, failed the
#     image tests at setup with `could not find bridge docker0`. A DOCKER_HOST the
#     environment sets (a CI service's daemon) is used instead, as it is;
#   - the base: scripts/make-base-image.sh runtime (cached by a content tag).
#
# Outside CI (CI unset or false) a machine that cannot do this (no root, an unprivileged
# container where dockerd cannot start) is not an error: one line says why, nothing is printed on
# stdout, and the tests that need docker skip with that reason. With CI=true it fails.
#
# `scripts/ci-docker.sh --daemon` stops once the daemon is ready and prints its DOCKER_HOST instead.
set -euo pipefail
cd "$(dirname "$0")/.."
DAEMON_ONLY=0
[ "${1:-}" = --daemon ] && DAEMON_ONLY=1
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
if [ "$DAEMON_ONLY" = 0 ]; then
    command -v skopeo >/dev/null || missing+=(skopeo)
    command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
    command -v docker-registry >/dev/null || missing+=(docker-registry)
    command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)  # the remote cache tests' server (Ubuntu 24.04 has no nginx-light)
fi
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

# CI's own daemon (.ci/run exports DOCKER_HOST=$CI_DOCKER_HOST where the environment sets none).
CI_DOCKER_RUN=/run/reprostack-ci-docker
CI_DOCKER_HOST="unix://$CI_DOCKER_RUN/docker.sock"
CI_DOCKER_PID="$CI_DOCKER_RUN/docker.pid"
CI_DOCKER_BRIDGE=reprostack0          # its own bridge: another daemon's docker0 may go at any time
CI_DOCKER_BRIDGE_IP=172.31.213.1/24   # its own subnet, apart from docker0's 172.17.0.0/16
CI_DOCKER_DATA=/var/lib/reprostack-ci-docker
export DOCKER_HOST="${DOCKER_HOST:-$CI_DOCKER_HOST}"

# Whether the daemon at DOCKER_HOST answers and (ours) its bridge is there and is the one it uses.
daemon_works() {
    docker info >/dev/null 2>&1 || return 1
    [ "$DOCKER_HOST" = "$CI_DOCKER_HOST" ] || return 0
    ip link show "$CI_DOCKER_BRIDGE" >/dev/null 2>&1 || return 1
    [ "$(docker network inspect bridge --format '{{index .Options "com.docker.network.bridge.name"}}' 2>/dev/null)" \
        = "$CI_DOCKER_BRIDGE" ]
}

# The pid of our daemon from its pid file, if that process runs and is our dockerd (not a reused pid).
our_daemon() {
    local pid
    pid="$(cat "$CI_DOCKER_PID" 2>/dev/null)" || return 1
    [ -n "$pid" ] && tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -q "dockerd .*--pidfile $CI_DOCKER_PID" \
        && echo "$pid"
}

start_our_daemon() {
    local pid
    command -v dockerd >/dev/null || give_up "no dockerd to start and no daemon to reach (DOCKER_HOST?)"
    command -v ip >/dev/null || give_up "no ip command (iproute2) to make the daemon's bridge with"
    if pid="$(our_daemon)"; then  # running but broken (its bridge deleted under it): restart it
        log "restarting CI's dockerd (pid $pid): it does not answer, or its bridge $CI_DOCKER_BRIDGE is gone"
        $SUDO kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 20); do [ -d "/proc/$pid" ] || break; sleep 1; done
        $SUDO kill -KILL "$pid" 2>/dev/null || true
        for _ in $(seq 10); do [ -d "/proc/$pid" ] || break; sleep 1; done
    fi
    # What a daemon killed without cleaning up left: its pid file (dockerd refuses to start while the pid
    # in it runs, whatever that process is now) and its socket.
    $SUDO rm -f "$CI_DOCKER_PID" "$CI_DOCKER_RUN/docker.sock"
    $SUDO mkdir -p "$CI_DOCKER_RUN" "$CI_DOCKER_DATA"
    if ! ip link show "$CI_DOCKER_BRIDGE" >/dev/null 2>&1; then
        $SUDO ip link add "$CI_DOCKER_BRIDGE" type bridge || give_up "cannot make the bridge $CI_DOCKER_BRIDGE (needs CAP_NET_ADMIN)"
    fi
    $SUDO ip addr replace "$CI_DOCKER_BRIDGE_IP" dev "$CI_DOCKER_BRIDGE"
    $SUDO ip link set "$CI_DOCKER_BRIDGE" up
    mkdir -p build
    log "starting CI's dockerd on $CI_DOCKER_HOST, bridge $CI_DOCKER_BRIDGE (log: build/dockerd.log)"
    # setsid: the daemon outlives this script and is not stopped with CI's process group.
    $SUDO setsid dockerd --host "$CI_DOCKER_HOST" --pidfile "$CI_DOCKER_PID" --bridge "$CI_DOCKER_BRIDGE" \
        --data-root "$CI_DOCKER_DATA" --exec-root "$CI_DOCKER_RUN/exec" --group "$(id -g)" \
        >build/dockerd.log 2>&1 </dev/null &
    for _ in $(seq 60); do
        daemon_works && return 0
        sleep 1
    done
    tail -5 build/dockerd.log >&2 || true
    give_up "dockerd did not come up (an unprivileged container cannot run it; log: build/dockerd.log)"
}

if ! daemon_works; then
    if [ "$DOCKER_HOST" != "$CI_DOCKER_HOST" ]; then
        give_up "the docker daemon at DOCKER_HOST=$DOCKER_HOST does not answer"
    fi
    start_our_daemon
fi
log "docker $(docker version --format '{{.Server.Version}}') ready at $DOCKER_HOST"
if [ "$DAEMON_ONLY" = 1 ]; then
    echo "$DOCKER_HOST"
    exit 0
fi
bash scripts/make-base-image.sh runtime || give_up "could not make the image tests' base (scripts/make-base-image.sh runtime)"
