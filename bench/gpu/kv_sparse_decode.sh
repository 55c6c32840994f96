#!/usr/bin/env bash
# On the GPU machine: page-level sparsity for K/V decode (append-and-attend
# steps naming the history pages to attend, docs/kv-cache.md). One server, 64
# sequences x 32k context (Hq 32, Hkv 8, D 128, BF16, pages of 64, one layer),
# unary steps at concurrency 1; the dense decode loop and the same loop
# attending 1/8 of the pages (attnctl load-kv --attend_fraction), rounds
# interleaved; first a small loop (8 x 4k, 1/4 of the pages) --check'ed
# against the float64 reference on the GPU's kernels.
# DIR holds bin/attnserve and bin/attnctl (libraries from .device-carry/lib).
# Usage: bench/gpu/kv_sparse_decode.sh DIR [ROUNDS]   (OUT: results folder)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/kv-sparse-out}
mkdir -p "$OUT"
dir=$1; rounds=${2:-2}
use_carried_libs lib
port=50073
start_server "$OUT/server.log" 60 "$dir/bin/attnctl" --target="127.0.0.1:$port" -- \
  "$dir/bin/attnserve" --backend=cuda --host=127.0.0.1 --port="$port" --log_level=warn \
  --metrics_port=0 --http_port=0 --devices=0 --kv_cache_bytes=$((24 << 30)) ||
  { echo "server did not start"; tail -20 "$OUT/server.log"; exit 1; }
pid=$SERVER_PID
ctl=("$dir/bin/attnctl" --target="127.0.0.1:$port" --timeout=600s)
shape=(--heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --page_size=64 --sequences=64
  --prompt=32768 --layers=1 --tokens=24 --warmup_tokens=4 --prefill_attend=false)
timeout 200 "${ctl[@]}" load-kv --heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --page_size=64 \
  --sequences=8 --prompt=4096 --layers=1 --tokens=6 --warmup_tokens=1 --attend_fraction=0.25 --check \
  >"$OUT/check.txt" 2>&1
echo "check (8 x 4k, 1/4 of the pages) rc=$?: $(grep -ciE 'mismatch|fail' "$OUT/check.txt") failure lines"
for round in $(seq 1 "$rounds"); do
  for frac in 1 0.125; do
    label=dense; extra=()
    [ "$frac" = 1 ] || { label=frac$frac; extra=(--attend_fraction="$frac"); }
    timeout 280 "${ctl[@]}" load-kv "${shape[@]}" "${extra[@]}" \
      --csv="$OUT/kv-sparse.csv" --label="$label-r$round" >"$OUT/$label-r$round.txt" 2>&1
    echo "$label round $round rc=$?: $(grep -E 'layer-steps\): p50' "$OUT/$label-r$round.txt" | head -1)"
    grep -E 'compute|server means' "$OUT/$label-r$round.txt" | head -3 | sed 's/^/    /'
  done
done
kill -TERM "$pid"; wait "$pid" 2>/dev/null
