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
# container where dockerd cannot start) is not an error: one line says which step is skipped and why,
# nothing is printed on stdout, it exits 0, and the tests that need docker skip with that reason (written
# to build/ci-docker.skipped for them). With CI=true it fails. dockerd needs CAP_NET_ADMIN and CAP_SYS_ADMIN:
# where this process (or sudo) lacks either (root in a container without --privileged, on docker's default
# network or on the host's, where CI's bridge may already exist), neither the docker packages are installed
# nor the bridge touched, only nginx (the remote-cache tests' server). Any other step that fails is named
# in the same one line, never a bare error from the command.
#
# `scripts/ci-docker.sh --daemon` stops once the daemon is ready and prints its DOCKER_HOST instead.
set -eEuo pipefail
cd "$(dirname "$0")/.."
SKIPPED=build/ci-docker.skipped  # why the docker tests skip (tests/conftest.py reads it)
rm -f "$SKIPPED"
DAEMON_ONLY=0
[ "${1:-}" = --daemon ] && DAEMON_ONLY=1
log() { echo "ci-docker: $*" >&2; }
case "$(printf %s "${CI:-}" | tr '[:upper:]' '[:lower:]')" in
    1|true|yes|on) IN_CI=1 ;;
    *) IN_CI=0 ;;
esac
give_up() {
    trap - ERR
    log "$*"
    if [ "$IN_CI" = 1 ]; then exit 1; fi
    mkdir -p "$(dirname "$SKIPPED")" && echo "scripts/ci-docker.sh: $*" >"$SKIPPED" || true
    log "not CI: the tests that need docker, nginx or a registry skip with the reason (CI=true makes them required)"
    exit 0
}
# A step that fails where nothing above expected it: one line naming it, and the same fallback.
trap 'give_up "step failed (exit $?), skipped with what follows it: $BASH_COMMAND (line $LINENO)"' ERR
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO="sudo"; else SUDO="none"; fi
fi

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

# Whether dockerd could run here: root (or sudo) holding CAP_NET_ADMIN (bridges, iptables) and CAP_SYS_ADMIN
# (mounts). A container without --privileged has neither, whatever its network.
dockerd_privileges() {
    local hex caps
    [ "$SUDO" = none ] && return 1
    hex=$($SUDO sh -c 'sed -n "s/^CapEff:[[:space:]]*//p" /proc/self/status' 2>/dev/null) || return 1
    [ -n "$hex" ] || return 1
    caps=$((16#$hex))
    [ $(( (caps >> 12) & 1 )) = 1 ] && [ $(( (caps >> 21) & 1 )) = 1 ]
}
NEEDS_DAEMON=0  # our own dockerd must be started (or restarted): it does not answer, or its bridge is gone
if [ "$DOCKER_HOST" = "$CI_DOCKER_HOST" ] && ! daemon_works; then NEEDS_DAEMON=1; fi
NO_PRIVILEGE=""
if [ "$NEEDS_DAEMON" = 1 ] && ! dockerd_privileges; then
    NO_PRIVILEGE="this process lacks CAP_NET_ADMIN or CAP_SYS_ADMIN (root in a container without --privileged, or neither root nor sudo): dockerd cannot run"
fi

missing=()
if [ -z "$NO_PRIVILEGE" ]; then
    if ! docker info >/dev/null 2>&1 && ! { command -v dockerd && command -v docker; } >/dev/null; then
        missing+=(docker.io)
    fi
    if [ "$DAEMON_ONLY" = 0 ]; then
        command -v skopeo >/dev/null || missing+=(skopeo)
        command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
        command -v docker-registry >/dev/null || missing+=(docker-registry)
    fi
fi
if [ "$DAEMON_ONLY" = 0 ]; then
    command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)  # the remote cache tests' server (Ubuntu 24.04 has no nginx-light)
fi
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$SUDO" = none ] || ! command -v apt-get >/dev/null; then
        give_up "skipping the install of ${missing[*]}: it needs root or sudo, and apt-get${NO_PRIVILEGE:+; and $NO_PRIVILEGE}"
    fi
    [ "$SUDO" = none ] && SUDO=""
    # apt's transcript (some 60 lines) goes to its own log: one line here says what was installed, or on failure
    # the log's last lines and its path.
    APT_LOG=build/ci-docker-apt.log
    mkdir -p build
    if ! { $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q \
            --no-install-recommends "${missing[@]}"; } >"$APT_LOG" 2>&1; then
        tail -15 "$APT_LOG" | sed 's/^/    /' >&2 || true
        give_up "apt-get could not install ${missing[*]} (log: $APT_LOG)${NO_PRIVILEGE:+; and $NO_PRIVILEGE}"
    fi
    log "installed ${missing[*]} with apt-get ($(grep -c '^Setting up ' "$APT_LOG" || true) packages set up; log: $APT_LOG)"
fi
[ "$SUDO" = none ] && SUDO=""
if [ -n "$NO_PRIVILEGE" ]; then
    give_up "skipping docker.io, skopeo, mmdebstrap, docker-registry, CI's dockerd and its bridge: $NO_PRIVILEGE"
fi

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
    local out
    if ! ip link show "$CI_DOCKER_BRIDGE" >/dev/null 2>&1; then
        out=$($SUDO ip link add "$CI_DOCKER_BRIDGE" type bridge 2>&1) ||
            give_up "skipping CI's dockerd: cannot make its bridge $CI_DOCKER_BRIDGE (ip: ${out:-failed}; needs CAP_NET_ADMIN)"
    fi
    # The bridge may be there already, set up (another run's, or the host's seen from a container on its network):
    # change only what differs, so that a process without CAP_NET_ADMIN is not stopped by a step with nothing to do.
    if ! ip -o addr show dev "$CI_DOCKER_BRIDGE" 2>/dev/null | grep -q " ${CI_DOCKER_BRIDGE_IP} "; then
        out=$($SUDO ip addr replace "$CI_DOCKER_BRIDGE_IP" dev "$CI_DOCKER_BRIDGE" 2>&1) ||
            give_up "skipping CI's dockerd: cannot give its bridge $CI_DOCKER_BRIDGE the address $CI_DOCKER_BRIDGE_IP (ip: ${out:-failed}; needs CAP_NET_ADMIN)"
    fi
    if ! ip -o link show "$CI_DOCKER_BRIDGE" 2>/dev/null | grep -qE '[<,]UP[,>]'; then
        out=$($SUDO ip link set "$CI_DOCKER_BRIDGE" up 2>&1) ||
            give_up "skipping CI's dockerd: cannot bring its bridge $CI_DOCKER_BRIDGE up (ip: ${out:-failed}; needs CAP_NET_ADMIN)"
    fi
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
