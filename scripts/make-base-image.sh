#!/usr/bin/env bash
# Make small local images from Debian packages, for CI and the benchmarks,
# where no container registry is reachable:
#
#   scripts/make-base-image.sh runtime   python3, pip, venv, libstdc++: what the example wheels need at run time
#   scripts/make-base-image.sh builder   runtime + g++, python3-dev, setuptools, wheel, pybind11 (a builder image)
#   scripts/make-base-image.sh devel     runtime + build-essential, python3-dev, git (for scripts/bench_image.py)
#   scripts/make-base-image.sh node      builder + git: the docs walk's offline node (scripts/docs_walk.py), which
#                                        builds from a mirror with the installed tool (SUITE=trixie: Python 3.13)
#
# Prints the image ID on stdout (everything else goes to stderr). Each image is
# tagged by the sha256 of its recipe (this script, the suite, the package
# list), so a second run finds it and returns at once. The runtime image is a
# root file system made by mmdebstrap and imported with `docker import`; the
# others are built on it with apt from the Debian mirror (network needed the
# first time). The mirror moves, so the same tag made on another day may hold
# newer package versions: pin MIRROR to a snapshot.debian.org URL for bytes
# that never move.
set -euo pipefail
cd "$(dirname "$0")/.."
FLAVOR=${1:-runtime}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
REPO=reprostack-base
RUNTIME_PACKAGES="python3,python3-pip,python3-venv,libstdc++6,ca-certificates"
BUILDER_PACKAGES="g++ python3-dev python3-setuptools python3-wheel python3-pybind11"
DEVEL_PACKAGES="build-essential python3-dev git"
NODE_PACKAGES="$BUILDER_PACKAGES git"

log() { echo "make-base-image: $*" >&2; }
recipe_hash() { { cat "$0"; echo "$SUITE $MIRROR $*"; } | sha256sum | cut -c1-12; }
image_id() { docker image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }

docker info >/dev/null 2>&1 || { log "cannot reach the docker daemon: start dockerd (see .ci/run)"; exit 1; }

runtime_tag="$REPO:runtime-$SUITE-$(recipe_hash runtime "$RUNTIME_PACKAGES")"
if [ -z "$(image_id "$runtime_tag")" ]; then
    command -v mmdebstrap >/dev/null || { log "mmdebstrap is not installed (apt-get install mmdebstrap)"; exit 1; }
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    log "mmdebstrap $SUITE ($RUNTIME_PACKAGES) -> $runtime_tag"
    SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-1700000000} mmdebstrap --variant=apt --include="$RUNTIME_PACKAGES" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
        "$SUITE" "$work/rootfs.tar" "$MIRROR" >&2
    docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' \
        --change "LABEL org.reprostack.base.recipe=$runtime_tag" "$work/rootfs.tar" "$runtime_tag" >&2
fi

case "$FLAVOR" in
    runtime) image_id "$runtime_tag"; exit 0 ;;
    builder) packages=$BUILDER_PACKAGES ;;
    devel) packages=$DEVEL_PACKAGES ;;
    node) packages=$NODE_PACKAGES ;;
    *) log "unknown flavor '$FLAVOR' (runtime, builder, devel, node)"; exit 2 ;;
esac
tag="$REPO:$FLAVOR-$SUITE-$(recipe_hash "$FLAVOR" "$packages" "$runtime_tag")"
if [ -z "$(image_id "$tag")" ]; then
    log "apt-get install $packages on $runtime_tag -> $tag"
    printf 'FROM %s\nRUN apt-get update && apt-get install -y --no-install-recommends %s && rm -rf /var/lib/apt/lists/*\nLABEL org.reprostack.base.recipe=%s\n' \
        "$(image_id "$runtime_tag")" "$packages" "$tag" | DOCKER_BUILDKIT=0 docker build --tag "$tag" - >&2
fi
image_id "$tag"
