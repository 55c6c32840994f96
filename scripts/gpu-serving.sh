#!/usr/bin/env bash
# On the GPU machine (device `run`, .device-carry carried): serving under load
# with the carried attnserve/attnctl (.device-carry/bin). Two servers on the
# CUDA backend, dynamic batching on and off, driven by `attnctl load --check`
# (every response verified against the float64 reference) with
#   small requests: B=1, Sq=Sk=256, Hq=16, D=128, BF16, concurrency 1, 16, 64
#   large requests: B=4, Sq=Sk=4096, Hq=16, D=128, BF16, concurrency 1, 4
# Rows go to $OUT/serving.csv (attnctl load's columns, label = scenario/batching);
# a short table is printed last.
# Usage: scripts/gpu-serving.sh [SECONDS_PER_STEP]   (default 5)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-serving-out}
mkdir -p "$OUT"
secs=${1:-5}
bin=.device-carry/bin
csv=$OUT/serving.csv
rm -f "$csv"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >"$OUT/gpu.txt" 2>&1

pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait' EXIT
start_server() {  # start_server PORT BATCHING
  "$bin/attnserve" --backend=cuda --host=127.0.0.1 --port="$1" --batching="$2" \
    --metrics_port=0 --log_level=warn >"$OUT/server-$1.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 1 100); do
    "$bin/attnctl" --target="127.0.0.1:$1" health >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "server on $1 did not become SERVING"; cat "$OUT/server-$1.log"; exit 1
}
start_server 50061 true
start_server 50062 false
"$bin/attnctl" --target=127.0.0.1:50061 info | tee "$OUT/info.txt" | head -5

small="--batch=1 --seqlen_q=256 --heads_q=16 --head_dim=128 --dtype=bf16"
large="--batch=4 --seqlen_q=4096 --heads_q=16 --head_dim=128 --dtype=bf16"
# --check on small requests only: the float64 reference of one large request
# takes minutes on the CPU (the first run of this script hung there).
run() {  # run PORT LABEL CONCURRENCY SHAPE...
  local port=$1 label=$2 conc=$3; shift 3
  local check=--check
  case $label in large/*) check= ;; esac
  "$bin/attnctl" --target="127.0.0.1:$port" --timeout=60s load --concurrency="$conc" \
    --warmup=1s --duration="${secs}s" --channels=4 $check --label="$label" --csv="$csv" "$@" \
    >>"$OUT/load.log" 2>>"$OUT/load-progress.log"
  echo "$label c=$conc rc=$?"
}
run 50061 small/batching=on 1,16,64 $small
run 50062 small/batching=off 1,16,64 $small
run 50061 large/batching=on 1,4 $large
run 50062 large/batching=off 1,4 $large
cat "$OUT/load.log" | grep -E '^(load:|concurrency=|  errors)' 
echo "---- serving.csv ----"
cat "$csv"
