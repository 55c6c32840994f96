#!/usr/bin/env bash
# On the GPU machine: the K/V service's per-step overhead of one 64-sequence decode
# step (Hq 32, Hkv 8, D 128, BF16, 8k context, pages of 64, one layer, unary,
# concurrency 1), side by side for one or more server builds, rounds
# interleaved:
#   overhead = client p50 - server compute (append + attention kernels)
#              - Echo p50 of the same bytes (q [64,1,32,128], k/v [64,1,8,128])
# Each DIR holds bin/attnserve and bin/attnctl (a server built with CUDA;
# libraries from .device-carry/lib). Newer attnctl builds also print the
# server's total and the time outside the server; their lines are kept.
# NAME=SDIR:CDIR runs SDIR's server with CDIR's attnctl under NAME, so a
# client change and a server change each get their own share (Echo always
# runs CDIR's attnctl against SDIR's server).
# Usage: bench/gpu/kv_step_overhead.sh ROUNDS DIR|NAME=SDIR:CDIR [...]   (OUT: results folder)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/kv-overhead-out}
mkdir -p "$OUT"
rounds=$1; shift
use_carried_libs lib
shape=(--heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16)
port=50071
table=$OUT/kv-step-overhead.txt
: >"$table"
for round in $(seq 1 "$rounds"); do
  for spec in "$@"; do
    if [[ $spec == *=*:* ]]; then
      name=${spec%%=*}; sdir=${spec#*=}; cdir=${sdir#*:}; sdir=${sdir%%:*}
    else
      name=$(basename "$spec"); sdir=$spec; cdir=$spec
    fi
    log=$OUT/$name-r$round
    start_server "$log-server.log" 60 "$cdir/bin/attnctl" --target="127.0.0.1:$port" -- \
      "$sdir/bin/attnserve" --backend=cuda --host=127.0.0.1 --port="$port" --log_level=warn \
      --metrics_port=0 --http_port=0 --devices=0 --kv_cache_bytes=$((8 << 30)) || { echo "$name: server did not start"; continue; }
    pid=$SERVER_PID
    ctl=("$cdir/bin/attnctl" --target="127.0.0.1:$port" --timeout=600s)
    timeout 200 "${ctl[@]}" load-kv "${shape[@]}" --page_size=64 --sequences=64 --prompt=8192 \
      --tokens=40 --warmup_tokens=4 --layers=1 >"$log-kv.txt" 2>&1
    timeout 60 "${ctl[@]}" load --rpc=echo --batch=64 --seqlen_q=1 --seqlen_k=1 "${shape[@]}" \
      --concurrency=1 --warmup=2s --duration=8s --csv="$log-echo.csv" --label=echo64 >"$log-echo.txt" 2>&1
    kill -TERM "$pid"; wait "$pid" 2>/dev/null
    p50=$(grep -oE 'layer-steps\): p50 [0-9.]+' "$log-kv.txt" | grep -oE '[0-9.]+$')
    compute=$(grep -oE 'compute [0-9.]+ ms' "$log-kv.txt" | head -1 | grep -oE '[0-9.]+')
    echo_p50=$(python3 -c 'import csv,sys; print(next(csv.DictReader(open(sys.argv[1])))["p50_ms"])' "$log-echo.csv" 2>/dev/null)
    over=$(python3 -c "print(f'{($p50 - $compute - $echo_p50) * 1000:.0f}')" 2>/dev/null)
    printf '%-8s round %s: step p50 %s ms, compute %s ms, Echo p50 %s ms -> overhead %s us\n' \
      "$name" "$round" "$p50" "$compute" "$echo_p50" "$over" | tee -a "$table"
    grep -E 'server means|outside the server' "$log-kv.txt" | sed "s/^/    $name: /" | tee -a "$table"
  done
done
