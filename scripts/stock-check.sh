#!/usr/bin/env bash
# Run the README's two commands as a new user would, on stock distributions: fresh Debian bookworm
# (Python 3.11), Ubuntu 24.04 (3.12) and Debian trixie (3.13) containers holding only the
# distribution's python3, python3-venv, python3-pip, python3-dev, git, build-essential, curl and
# ca-certificates, what a user's build machine has (no nvcc, no GPU, no docker privileges: a plain
# `docker run` as root, no socket, not --privileged), each on a clean clone of this repository's HEAD
# (commit first: this checks what is committed). python3-dev is there so that the tests that compile
# Python extensions run, as they run on a user's machine, instead of skipping.
#
# Each distribution runs twice, in a fresh container each time: on the host's network (`--network host`:
# root without CAP_NET_ADMIN beside the host's interfaces, where CI's bridge may already exist) and on
# docker's default network.
#
#   bash scripts/stock-check.sh                          # all three, both networks
#   bash scripts/stock-check.sh bookworm noble trixie    # any of them, in this order
#   STOCK_NETWORKS=host bash scripts/stock-check.sh noble   # one network variant only (host or default)
#   STOCK_COMMANDS=quickstart bash scripts/stock-check.sh   # some commands only (quickstart, ci, tool)
#   STOCK_COMMANDS=tool bash scripts/stock-check.sh noble   # the offline checks only (no network in them)
#   bash scripts/stock-check.sh --images noble           # only make the images; prints "<dist> <image ID>"
#
# `tool` (after the two commands): the tool installed offline on each distribution's Python from one mirror
# written on this host (`doit mirror tool_python=3.11,3.12,3.13` by this checkout's .venv, whatever its Python):
# in a container without network (`--network none`) as docs/offline.md says (a venv, pip --no-index
# --require-hashes), then `reprostack --version` and `pip check`; and with the distribution's own pipx (installed
# by apt in a container on the first network asked for, kept as an image) the pipx block of that page as it is
# printed (read from the clone's page with the docs walk's parser, scripts/docs_walk.py), run by `bash -euo
# pipefail` with DEST=/mirror in a container of that image without network. A `Traceback` in its log fails it.
# And "the example offline": the mirror is of examples/example.lock (its upstreams served on loopback here while
# `doit mirror` runs, the lock's URLs at that port); in a container without network, the page's venv block, then
# its block that builds and verifies (`reprostack wheels lock=... mirror=...`, then verify) with LOCKDIR=/lock,
# LOCK=example.lock, DEST=/mirror: the build closures' wheels come from the mirror alone.
#
# Prints, per distribution, network and command, the exit status and the wall time, what the command
# left on disk (the checkout, its .venv, and outside it: ~/.cache/reprostack, ~/.cache/pip, pytest's
# /tmp/pytest-of-root, CI's docker data, the Debian packages installed), and for `.ci/run` the reasons of the tests it skipped (only docker privileges,
# nginx, a GPU or nvcc should be among them); full logs in
# build/stock-check/<distribution>-<network>-<command>.log. Exits 1 if any command failed.
# Needs docker and mmdebstrap on this host, and the distributions' mirrors and PyPI from the
# containers. The root file systems are made by mmdebstrap and imported with `docker import`, tagged by
# the sha256 of their recipe (a second run reuses them).
# Where this host reaches the network through a TLS-intercepting proxy and says so (SSL_CERT_FILE or
# PIP_CERT naming its CA bundle), that bundle is copied into the containers and named to pip, git and
# Python the same way; nothing else of the host goes in.
{  # read whole before it runs: the script may be edited while a long check runs
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "stock-check: $*" >&2; }
IMAGES_ONLY=0
[ "${1:-}" = --images ] && { IMAGES_ONLY=1; shift; }
if [ $# -gt 0 ]; then DISTS=("$@"); else DISTS=(bookworm noble trixie); fi
for dist in "${DISTS[@]}"; do
    case "$dist" in bookworm|noble|trixie) ;; *) log "unknown distribution $dist (bookworm, noble or trixie)"; exit 2 ;; esac
done
PACKAGES="python3,python3-venv,python3-pip,python3-dev,git,build-essential,curl,ca-certificates"
# Ubuntu's archive key, for mmdebstrap on a Debian host (Debian does not package it): the
# ubuntu-keyring .deb of noble, pinned by the sha256 its Packages index lists.
UBUNTU_KEYRING_DEB=http://archive.ubuntu.com/ubuntu/pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb
UBUNTU_KEYRING_SHA256=36de43b15853ccae0028e9a767613770c704833f82586f28eb262f0311adb8a8

command -v docker >/dev/null && docker info >/dev/null 2>&1 || { log "needs a docker daemon"; exit 2; }
command -v mmdebstrap >/dev/null || { log "needs mmdebstrap (apt-get install mmdebstrap)"; exit 2; }
out=build/stock-check
mkdir -p "$out"
work=$(mktemp -d)
trap '[ -n "${SERVE:-}" ] && kill "$SERVE" 2>/dev/null; rm -rf "$work"; [ -n "${CID:-}" ] && docker rm -f "$CID" >/dev/null 2>&1
      [ -n "${PIPX_IMAGE:-}" ] && docker rmi -f "$PIPX_IMAGE" >/dev/null 2>&1 || true' EXIT

image_for() {  # distribution -> image ID (made once per recipe)
    local dist=$1 tag args=()
    # The tag: the sha256 of what makes the root file system (this function and the package list).
    tag="reprostack-stock:$dist-$( { declare -f image_for; echo "$dist $PACKAGES $UBUNTU_KEYRING_SHA256"; } |
        sha256sum | cut -c1-12)"
    if ! docker image inspect "$tag" >/dev/null 2>&1; then
        case "$dist" in
            bookworm) args=(bookworm - http://deb.debian.org/debian) ;;
            # trixie's Release is signed with bookworm's archive key too: a bookworm host's keyring checks it.
            trixie) args=(trixie - http://deb.debian.org/debian) ;;
            noble)
                curl -fsS -o "$work/keyring.deb" "$UBUNTU_KEYRING_DEB"
                echo "$UBUNTU_KEYRING_SHA256  $work/keyring.deb" | sha256sum -c --quiet - >&2
                dpkg-deb -x "$work/keyring.deb" "$work/keyring"
                # apt checks signatures as its _apt user: the keyring (and mktemp's 700 directory
                # above it) must be readable by others, or apt says NO_PUBKEY.
                chmod 755 "$work"
                chmod -R a+rX "$work/keyring"
                args=(--keyring="$work/keyring/usr/share/keyrings/ubuntu-archive-keyring.gpg"
                      --components=main,universe noble - http://archive.ubuntu.com/ubuntu) ;;
            *) log "unknown distribution $dist (bookworm, noble or trixie)"; exit 2 ;;
        esac
        log "mmdebstrap $dist ($PACKAGES) -> $tag"
        # into a file first: a failed mmdebstrap must not leave an (empty) image under the tag
        mmdebstrap --variant=apt --include="$PACKAGES" "${args[@]}" >"$work/$dist.tar" 2>"$out/$dist-mmdebstrap.log" ||
            { log "mmdebstrap $dist failed: $out/$dist-mmdebstrap.log"; exit 2; }
        docker import --change 'CMD ["bash"]' "$work/$dist.tar" "$tag" >/dev/null
        rm -f "$work/$dist.tar"
    fi
    docker image inspect --format '{{.Id}}' "$tag"
}

if [ "$IMAGES_ONLY" = 1 ]; then
    for dist in "${DISTS[@]}"; do echo "$dist $(image_for "$dist")"; done
    exit 0
fi
git clone --quiet . "$work/repo"
log "checking $(git -C "$work/repo" rev-parse --short HEAD) (a clean clone of HEAD)"
NETWORKS=(${STOCK_NETWORKS:-host default})
COMMANDS=(${STOCK_COMMANDS:-quickstart ci tool})
TOOL=0
for what in "${COMMANDS[@]}"; do
    case "$what" in quickstart|ci) ;; tool) TOOL=1 ;; *) log "unknown command $what (quickstart, ci or tool)"; exit 2 ;; esac
done
page_block() {  # text: the one block of docs/offline.md whose text holds it, as the docs walk's parser reads it
    .venv/bin/python - "$work/repo" "$1" <<'PY'
import sys
from pathlib import Path

sys.path.insert(0, f"{sys.argv[1]}/scripts")
import docs_walk

page = "docs/offline.md"
found = [b for b in docs_walk.parse_page(Path(sys.argv[1], page), page) if sys.argv[2] in b.text]
if len(found) != 1:
    sys.exit(f"{page}: {len(found)} blocks hold {sys.argv[2]!r}, not one")
print(f"# {found[0].label()}")
print(found[0].text, end="")
PY
}
if [ "$TOOL" = 1 ]; then  # one mirror of the tool, written here, for every distribution's Python
    [ -x .venv/bin/doit ] || { log "tool: needs this checkout's .venv to write the mirror (bash scripts/bootstrap.sh)"; exit 2; }
    # The example lock's upstreams, served on loopback here; the lock (its URLs at that port) and its patches
    # go to /lock in the containers, the mirror of it to /mirror.
    mkdir -p "$work/ws" "$work/lock"
    .venv/bin/python tests/fixtures/make_fixtures.py "$work/upstream" >/dev/null
    .venv/bin/python tests/fixtures/serve.py "$work/upstream" --port 0 >"$work/serve.log" 2>&1 &
    SERVE=$!
    for _ in $(seq 300); do grep -q '^serving ' "$work/serve.log" 2>/dev/null && break; sleep 0.1; done
    port=$(sed -n 's|^serving .* at http://127\.0\.0\.1:\([0-9]*\) .*|\1|p' "$work/serve.log")
    [ -n "$port" ] || { log "tool: the example upstreams could not be served: $(cat "$work/serve.log")"; exit 2; }
    sed "s|http://127.0.0.1:8737/|http://127.0.0.1:$port/|g" examples/example.lock >"$work/lock/example.lock"
    cp -r examples/patches "$work/lock/patches"
    log "tool: doit mirror of the example lock, tool_python=3.11,3.12,3.13, on this host ($(.venv/bin/python -V)) -> $out/tool-mirror.log"
    PIP_INDEX_URL="http://127.0.0.1:$port/simple" .venv/bin/doit -f dodo.py -d "$work/ws" mirror \
        lock="$work/lock/example.lock" mirror="$work/mirror" tool_python=3.11,3.12,3.13 >"$out/tool-mirror.log" 2>&1 ||
        { log "tool: doit mirror failed: $out/tool-mirror.log"; exit 1; }
    kill "$SERVE" 2>/dev/null || true
    chmod -R a+rX "$work/mirror" "$work/lock"
    # docs/offline.md's blocks as the page prints them: the one that runs `pipx install`, and the one that builds
    # and verifies from the mirror (`reprostack wheels lock=`).
    page_block "pipx install" >"$work/pipx-block.sh" || { log "tool: no pipx block in docs/offline.md"; exit 2; }
    page_block "reprostack wheels lock=" >"$work/build-block.sh" || { log "tool: no build block in docs/offline.md"; exit 2; }
    chmod a+r "$work/build-block.sh"
fi
TOOL_VENV='python3 -V && python3 -m venv /rs && /rs/bin/pip install -q --no-index --find-links /mirror/tool \
    --require-hashes -r /mirror/tool/requirements.txt && /rs/bin/reprostack --version && /rs/bin/pip check'
# docs/offline.md's venv block (the tool into ~/reprostack), then its build block as printed, for the example lock
EXAMPLE_OFFLINE='python3 -V && python3 -m venv ~/reprostack && ~/reprostack/bin/pip install -q --no-index \
    --find-links "$DEST"/tool --require-hashes -r "$DEST"/tool/requirements.txt && bash -euo pipefail /build-block.sh'
PIPX_APT='apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends pipx'
pipx_offline() {  # image ca_mount...: the distribution's pipx installed (with network), then the page's block (none)
    local image=$1 rc=0 apt_net=()
    shift
    [ "${NETWORKS[0]}" = host ] && apt_net=(--network host)
    CID=reprostack-stock-pipx-$$
    docker run --name "$CID" ${apt_net[@]+"${apt_net[@]}"} ${ca_env[@]+"${ca_env[@]}"} "$@" "$image" \
        bash -c "$PIPX_APT" || rc=$?
    [ "$rc" = 0 ] && { PIPX_IMAGE=$(docker commit "$CID") || rc=$?; }
    docker rm -f "$CID" >/dev/null 2>&1
    CID=""
    [ "$rc" = 0 ] || { echo "stock-check: apt-get install pipx failed (exit $rc)"; return "$rc"; }
    echo "stock-check: docs/offline.md's pipx block as printed, with DEST=/mirror and --network none:"
    sed 's/^/    /' "$work/pipx-block.sh"
    docker run --rm --network none -v "$work/mirror:/mirror:ro" -v "$work/pipx-block.sh:/pipx-block.sh:ro" \
        --env HOME=/root --env DEST=/mirror "$PIPX_IMAGE" bash -c 'pipx --version && bash -euo pipefail /pipx-block.sh' ||
        rc=$?
    docker rmi -f "$PIPX_IMAGE" >/dev/null 2>&1
    PIPX_IMAGE=""
    return "$rc"
}
tool_check() {  # dist image: the tool offline, a venv and pipx
    local dist=$1 image=$2 how log rc start traceback ca_mount=()
    [ ${#ca_env[@]} -gt 0 ] && ca_mount=(-v "$ca:/etc/ssl/host-ca.crt:ro")
    for how in venv pipx example; do
        log=$out/$dist-tool-$how.log
        start=$(date +%s)
        set +e
        if [ "$how" = venv ]; then
            docker run --rm --network none -v "$work/mirror:/mirror:ro" --env HOME=/root \
                ${ca_env[@]+"${ca_env[@]}"} ${ca_mount[@]+"${ca_mount[@]}"} "$image" bash -c "$TOOL_VENV" >"$log" 2>&1
        elif [ "$how" = example ]; then  # the example lock built and verified from the mirror alone
            docker run --rm --network none -v "$work/mirror:/mirror:ro" -v "$work/lock:/lock:ro" \
                -v "$work/build-block.sh:/build-block.sh:ro" --env HOME=/root --env DEST=/mirror --env LOCKDIR=/lock \
                --env LOCK=example.lock "$image" bash -c "$EXAMPLE_OFFLINE" >"$log" 2>&1
        else
            pipx_offline "$image" ${ca_mount[@]+"${ca_mount[@]}"} >"$log" 2>&1
        fi
        rc=$?
        set -e
        # A traceback fails it even where the command went on (pipx logging an error it survived).
        traceback=$(grep -n -m1 Traceback "$log" | cut -d: -f1 || true)
        [ -n "$traceback" ] && [ "$rc" = 0 ] && rc=1
        [ "$rc" = 0 ] || status=1
        what="the tool offline, $how"
        [ "$how" = example ] && what="the example offline"
        printf 'stock-check: %-8s %-7s %-26s exit %-3s %5ss  (log: %s)\n' "$dist" none \
            "$what" "$rc" "$(( $(date +%s) - start ))" "$log"
        if [ "$how" = example ]; then  # what was built and what left out, from the log
            grep -E '^(built |skipped |  (repro_[a-z]+) +(built|skipped))|[0-9]+ passed, [0-9]+ failed' "$log" | sed 's/^/    /' || true
        fi
        [ -n "$traceback" ] && echo "    a Traceback in its log, line $traceback ($(wc -l <"$log") lines)"
        tail -2 "$log" | sed 's/^/    /'
    done
}
for net in "${NETWORKS[@]}"; do
    case "$net" in host|default) ;; *) log "unknown network $net (host or default)"; exit 2 ;; esac
done
# What a command left: the checkout and its .venv, and outside the checkout (MB, and Debian packages).
FOOTPRINT='du() { local n; n=$(command du -sm "$1" 2>/dev/null | cut -f1); echo "${n:-0}"; }
echo "checkout $(du /root/reprostack) MB (.venv $(du /root/reprostack/.venv) MB);" \
     "outside: ~/.cache/reprostack $(du /root/.cache/reprostack) MB, ~/.cache/pip $(du /root/.cache/pip) MB," \
     "/tmp/pytest-of-root $(du /tmp/pytest-of-root) MB, /var/lib/reprostack-ci-docker $(du /var/lib/reprostack-ci-docker) MB," \
     "$(dpkg-query -W -f "\${Status}\n" | grep -c "install ok installed") Debian packages"'
status=0
for dist in "${DISTS[@]}"; do
    image=$(image_for "$dist")
    ca=${SSL_CERT_FILE:-${PIP_CERT:-}}
    ca_env=()
    if [ -n "$ca" ] && [ -f "$ca" ]; then
        for v in SSL_CERT_FILE PIP_CERT REQUESTS_CA_BUNDLE GIT_SSL_CAINFO CURL_CA_BUNDLE; do
            ca_env+=(--env "$v=/etc/ssl/host-ca.crt")
        done
    fi
    for net in "${NETWORKS[@]}"; do
        [ "$TOOL" = 1 ] && [ "${COMMANDS[*]}" = tool ] && break  # only the tool's check asked for
        net_args=()
        [ "$net" = host ] && net_args=(--network host)
        CID=$(docker run -d ${net_args[@]+"${net_args[@]}"} --env HOME=/root ${ca_env[@]+"${ca_env[@]}"} "$image" \
            sleep infinity)
        [ ${#ca_env[@]} -gt 0 ] && docker cp "$ca" "$CID:/etc/ssl/host-ca.crt" >/dev/null
        docker cp "$work/repo" "$CID:/root/reprostack" >/dev/null
        python=$(docker exec "$CID" python3 -V 2>&1)
        log "$dist, $net network: before, $(docker exec "$CID" bash -c "$FOOTPRINT")"
        for what in "${COMMANDS[@]}"; do
            case "$what" in
                quickstart) cmd="bash examples/quickstart.sh" ;;
                ci) cmd="bash .ci/run" ;;
                tool) continue ;;
            esac
            name="$dist-$net-$what"
            start=$(date +%s)
            set +e
            docker exec -w /root/reprostack "$CID" bash -c "$cmd" >"$out/$name.log" 2>&1
            rc=$?
            set -e
            [ "$rc" = 0 ] || status=1
            printf 'stock-check: %-8s %-7s %-26s exit %-3s %5ss  (%s; log: %s)\n' "$dist" "$net" "$cmd" "$rc" \
                "$(( $(date +%s) - start ))" "$python" "$out/$name.log"
            echo "    after it: $(docker exec "$CID" bash -c "$FOOTPRINT")"
            tail -3 "$out/$name.log" | sed 's/^/    /'
            if [ "$what" = ci ]; then  # pytest -ra: one SKIPPED line per reason
                grep -E '^SKIPPED \[[0-9]+\]' "$out/$name.log" | sed -E 's/^SKIPPED \[([0-9]+)\] [^:]*:[0-9]+: /\1 /' |
                    awk '{n=$1; $1=""; c[$0]+=n} END {for (r in c) printf "    skipped %3d:%s\n", c[r], r}' | sort || true
                grep -E '^(ci-docker|\.ci/run):' "$out/$name.log" | sed 's/^/    /' || true
            fi
        done
        docker rm -f "$CID" >/dev/null
        CID=""
    done
    [ "$TOOL" = 1 ] && tool_check "$dist" "$image"
done
exit $status
}
