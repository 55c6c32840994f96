#!/usr/bin/env bash
# On the GPU machine: the share of the unary K/V step's host tensors (q, k and
# v parsed from gRPC's slices into page-locked memory the H2D copy reads where
# it lies; o written there by the D2H copy and sent from it) in the 64 x 8k
# decode step's overhead. One carried build (.device-carry/bin, or BIN) runs
# as is (`host-tensors`) and with ATTNSERVE_KV_HOST_TENSORS=0 (`message`: the
# message's bytes staged through the pinned buffer and a heap o, as before),
# rounds interleaved, through bench/gpu/kv_step_overhead.sh; then
# `load-kv --check` against the host-tensors server, unary and stream (q and o
# of 32 KiB per step: read and written where they lie; k/v of 8 KiB: gathered).
# Usage: [ROUNDS=3] [BIN=DIR] scripts/device/kv-host-tensors-ab.sh   (OUT: results folder)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/kv-host-tensors-out}
mkdir -p "$OUT"
real=$(cd "${BIN:-.device-carry/bin}" && pwd)
wrap=$(mktemp -d)
for name in host-tensors message; do
  mkdir -p "$wrap/$name/bin"
  ln -s "$real/attnctl" "$wrap/$name/bin/attnctl"
done
printf '#!/bin/sh\nexec %s/attnserve "$@"\n' "$real" >"$wrap/host-tensors/bin/attnserve"
printf '#!/bin/sh\nATTNSERVE_KV_HOST_TENSORS=0 exec %s/attnserve "$@"\n' "$real" \
  >"$wrap/message/bin/attnserve"
chmod +x "$wrap"/*/bin/attnserve
OUT=$OUT bench/gpu/kv_step_overhead.sh "${ROUNDS:-3}" "$wrap/host-tensors" "$wrap/message"

use_carried_libs lib
port=50073
start_server "$OUT/check-server.log" 60 "$real/attnctl" --target="127.0.0.1:$port" -- \
  "$real/attnserve" --backend=cuda --host=127.0.0.1 --port="$port" --log_level=warn \
  --metrics_port=0 --http_port=0 --devices=0 --kv_cache_bytes=$((2 << 30)) ||
  { echo "check server did not start"; exit 1; }
pid=$SERVER_PID
for mode in unary stream; do
  flags=()
  [ $mode = stream ] && flags=(--stream)
  timeout 300 "$real/attnctl" --target="127.0.0.1:$port" --timeout=120s load-kv \
    --heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --page_size=64 --sequences=4 \
    --prompt=300 --tokens=6 --warmup_tokens=1 --layers=2 --check "${flags[@]}" \
    >"$OUT/check-$mode.txt" 2>&1
  echo "load-kv --check $mode: exit $? ($(grep -icE 'mismatch|fail' "$OUT/check-$mode.txt") lines naming a mismatch or failure)"
done
kill -TERM "$pid"
wait "$pid" 2>/dev/null
rm -rf "$wrap"
