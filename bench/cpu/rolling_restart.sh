#!/usr/bin/env bash
# A rolling restart measured on this machine: scripts/device/rolling-restart.sh
# on two CPU replicas with a small cache (defaults below; any of that script's
# variables may be set), the binaries from BUILD_DIR (default build). Writes
# $OUT/rolling-restart.csv (default bench/results/rolling-restart-cpu).
# Usage: [BUILD_DIR=build] [OUT=DIR] [SEQS=16] [CONTEXT=2048] [LAYERS=2] [TOKENS=200]
#        [TRANSPORTS="auto grpc"] [RUNS=3] bench/cpu/rolling_restart.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD_DIR:-build}
for b in server/attnserve client/attnctl; do
  [ -x "$build/$b" ] || { echo "no $build/$b (ninja -C $build attnserve attnctl)" >&2; exit 2; }
done
bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
ln -s "$PWD/$build/server/attnserve" "$PWD/$build/client/attnctl" "$bin/"
export bin BACKEND=cpu
export OUT=${OUT:-$PWD/bench/results/rolling-restart-cpu}
export SEQS=${SEQS:-16} CONTEXT=${CONTEXT:-2048} LAYERS=${LAYERS:-2} TOKENS=${TOKENS:-200}
export MIN_TOKENS=${MIN_TOKENS:-20} RUNS=${RUNS:-3} CONCURRENCY=${CONCURRENCY:-2}
export HEADS_Q=${HEADS_Q:-8} HEADS_KV=${HEADS_KV:-2} HEAD_DIM=${HEAD_DIM:-64} DTYPE=${DTYPE:-fp16}
export PAGE=${PAGE:-16} UCX_TLS=${UCX_TLS:-sm,tcp}
scripts/device/rolling-restart.sh
