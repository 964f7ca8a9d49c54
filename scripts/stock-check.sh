#!/usr/bin/env bash
# Run the README's two commands as a new user would, on stock distributions: fresh Debian bookworm
# (Python 3.11), Ubuntu 24.04 (3.12) and Debian trixie (3.13) containers holding only the
# distribution's python3, python3-venv, python3-pip, python3-dev, git, build-essential, curl and
# ca-certificates, what a user's build machine has (no nvcc, no GPU, no docker privileges: a plain
# `docker run`, no socket, not --privileged), each on a clean clone of this repository's HEAD (commit
# first: this checks what is committed). python3-dev is there so that the tests that compile Python
# extensions run, as they run on a user's machine, instead of skipping.
#
#   bash scripts/stock-check.sh                          # all three
#   bash scripts/stock-check.sh bookworm noble trixie    # any of them, in this order
#
# Prints, per distribution and command, the exit status and the wall time, and for `.ci/run` the
# reasons of the tests it skipped (only docker privileges, nginx, a GPU or nvcc should be among them);
# full logs in build/stock-check/<distribution>-<command>.log. Exits 1 if any command failed.
# Needs docker and mmdebstrap on this host, and the distributions' mirrors and PyPI from the
# containers (the default bridge network). The root file systems are made by mmdebstrap and
# imported with `docker import`, tagged by the sha256 of their recipe (a second run reuses them).
# Where this host reaches the network through a TLS-intercepting proxy and says so (SSL_CERT_FILE or
# PIP_CERT naming its CA bundle), that bundle is copied into the containers and named to pip, git and
# Python the same way; nothing else of the host goes in.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "stock-check: $*" >&2; }
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
trap 'rm -rf "$work"; [ -n "${CID:-}" ] && docker rm -f "$CID" >/dev/null 2>&1 || true' EXIT

image_for() {  # distribution -> image ID (made once per recipe)
    local dist=$1 tag args=()
    tag="reprostack-stock:$dist-$( { cat "$0"; echo "$dist $PACKAGES"; } | sha256sum | cut -c1-12)"
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

git clone --quiet . "$work/repo"
log "checking $(git -C "$work/repo" rev-parse --short HEAD) (a clean clone of HEAD)"
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
    CID=$(docker run -d --env HOME=/root ${ca_env[@]+"${ca_env[@]}"} "$image" sleep infinity)
    [ ${#ca_env[@]} -gt 0 ] && docker cp "$ca" "$CID:/etc/ssl/host-ca.crt" >/dev/null
    docker cp "$work/repo" "$CID:/root/reprostack" >/dev/null
    python=$(docker exec "$CID" python3 -V 2>&1)
    for cmd in "bash examples/quickstart.sh" "bash .ci/run"; do
        name="$dist-$(echo "$cmd" | tr -c 'a-z' '-' | sed 's/-*$//')"
        start=$(date +%s)
        set +e
        docker exec -w /root/reprostack "$CID" bash -c "$cmd" >"$out/$name.log" 2>&1
        rc=$?
        set -e
        [ "$rc" = 0 ] || status=1
        printf 'stock-check: %-8s %-26s exit %-3s %5ss  (%s; log: %s)\n' "$dist" "$cmd" "$rc" "$(( $(date +%s) - start ))" \
            "$python" "$out/$name.log"
        tail -3 "$out/$name.log" | sed 's/^/    /'
        if [ "$cmd" = "bash .ci/run" ]; then  # pytest -ra: one SKIPPED line per reason
            grep -E '^SKIPPED \[[0-9]+\]' "$out/$name.log" | sed -E 's/^SKIPPED \[([0-9]+)\] [^:]*:[0-9]+: /\1 /' |
                awk '{n=$1; $1=""; c[$0]+=n} END {for (r in c) printf "    skipped %3d:%s\n", c[r], r}' | sort || true
        fi
    done
    docker rm -f "$CID" >/dev/null
    CID=""
done
exit $status
