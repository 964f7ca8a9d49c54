#!/usr/bin/env bash
# One package cold, all cores here, then through a two-node Ray cluster on this one host (half the cores
# each), each on an empty cache; prints both wall times and the wheels' sha256 (BENCHMARKS.md, issue 30).
#   bash scripts/cluster_bench.sh [PACKAGE] [LOCK] [PROFILE] [MIRROR]
# Run from the checkout, with `reprostack` and `ray` (the venv's, with the `cluster` extra) on PATH.
set -u
PKG=${1:-transformer_engine}; LOCK=${2:-sources.lock}; PROFILE=${3:-no-fa2}; MIRROR=${4:-}
OUT=${OUT_DIR:-/tmp/cluster-bench}; mkdir -p "$OUT"
CORES=$(nproc); HALF=$((CORES / 2))
MEM_GB=${NODE_MEM_GB:-$(awk '/MemAvailable/ {print int($2 / 1048576 / 2)}' /proc/meminfo)}
PORT=${RAY_PORT:-6390}
C="lock=$LOCK profile=$PROFILE ${MIRROR:+mirror=$MIRROR}"
now() { date +%s%N; }
echo "host: $CORES cores; $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
s=$(now); reprostack "build:$PKG" $C cache="$OUT/c1" builddir="$OUT/b1" wheels="$OUT/w1" cluster=off > "$OUT/local.log" 2>&1
echo "local ($CORES cores): rc=$? wall $(( ($(now) - s) / 1000000 )) ms"
ray start --head --port="$PORT" --num-cpus=0 --node-name=head --include-dashboard=false --disable-usage-stats \
  --object-store-memory=1000000000 > "$OUT/ray.log" 2>&1
for n in 1 2; do
  ray start --address="127.0.0.1:$PORT" --num-cpus="$HALF" --memory=$((MEM_GB * 1024 * 1024 * 1024)) \
    --node-name="node-$n" --object-store-memory=1000000000 >> "$OUT/ray.log" 2>&1
done
s=$(now); reprostack "build:$PKG" $C cache="$OUT/c2" builddir="$OUT/b2" wheels="$OUT/w2" cluster="127.0.0.1:$PORT" > "$OUT/cluster.log" 2>&1
echo "cluster (2 nodes x $HALF CPUs): rc=$? wall $(( ($(now) - s) / 1000000 )) ms"
ray stop --force >> "$OUT/ray.log" 2>&1
sha256sum $(find "$OUT/c1/wheels" "$OUT/c2/wheels" -name "${PKG}*.whl")
grep ' start ' "$OUT/b2/logs/units.log" | grep -o 'node=[^ ]*' | sort | uniq -c
grep -h '^built \|job budget' "$OUT/local.log" "$OUT/cluster.log"
