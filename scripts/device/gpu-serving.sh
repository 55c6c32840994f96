#!/usr/bin/env bash
# On the GPU machine (device `run`, with .device-carry carried): the serving
# benchmark, every side in one run on one host.
#   attnserve, dynamic batching on and off (one server each, GPU 0)
#   echo       the Echo RPC of the batching-on server: the same bytes in and
#              out with no compute (the transport ceiling)
#   python_sdpa bench/baselines/sdpa_server.py (grpcio + PyTorch SDPA, GPU 0)
#   attnserve over every visible GPU (--devices=all) when there are two or more
# Scenarios (BF16, Hq=Hkv=16, D=128, non-causal):
#   small: B=1, Sq=Sk=256, concurrency 1, 16, 64
#   large: B=4, Sq=Sk=4096, concurrency 1, 4, 8
# Every server first answers a short `attnctl load --check` (each response
# checked against the float64 reference; small shape only, the large one's
# reference takes minutes on the CPU); the timed steps run without --check so
# the client's checking does not cap the throughput it measures.
# Rows go to $OUT/serving-raw.csv (attnctl load's columns, label =
# scenario/impl/batching); bench/gpu/serving_report.py turns them into the
# committed CSV and prints the table last.
# Usage: [SECS_LARGE=10] scripts/device/gpu-serving.sh [SECONDS_PER_STEP]   (default 4)
# Shape and flag lists ($args, $shape, $C) are split into words on purpose.
# shellcheck disable=SC2086
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/gpu-serving-out}
mkdir -p "$OUT"
secs=${1:-4}
secs_large=${SECS_LARGE:-10}  # large requests take ~0.6 s each: longer windows
bin=.device-carry/bin
# A shared-library build carries its libraries (scripts/device/pack-device-deps.sh --server).
use_carried_libs lib
raw=$OUT/serving-raw.csv
rm -f "$raw"
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
{
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
  python3 -c 'import torch, grpc, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "grpcio", grpc.__version__)'
  echo "cpus $(nproc)"
} >"$OUT/env.txt" 2>&1

pids=()
# shellcheck disable=SC2154  # p is the trap's own loop variable
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait' EXIT
serve() {  # serve PORT NAME SERVER...: starts it, waits for SERVING, else exits
  local port=$1 name=$2; shift 2
  start_server "$OUT/$name.log" 30 "$bin/attnctl" --target="127.0.0.1:$port" -- "$@"
  local rc=$?
  pids+=("$SERVER_PID")
  [ "$rc" = 0 ] || { echo "$name on port $port did not become SERVING"; exit 1; }
}
start_attnserve() {  # start_attnserve PORT NAME FLAGS...
  local port=$1 name=$2; shift 2
  serve "$port" "$name" "$bin/attnserve" --backend=cuda --host=127.0.0.1 --port="$port" \
    --log_level=warn --http_port=0 "$@"
}
start_attnserve 50061 attnserve-on --batching=true --devices=0 --metrics_port=50081
start_attnserve 50062 attnserve-off --batching=false --devices=0 --metrics_port=0
serve 50071 python_sdpa python3 bench/baselines/sdpa_server.py --port=50071 --device=0 \
  --log_level=WARNING
if [ "$ngpu" -ge 2 ]; then
  start_attnserve 50063 attnserve-multi --batching=true --devices=all --metrics_port=50083
fi
"$bin/attnctl" --target=127.0.0.1:50061 info >"$OUT/info.txt" 2>&1

small="--batch=1 --seqlen_q=256 --heads_q=16 --head_dim=128 --dtype=bf16"
large="--batch=4 --seqlen_q=4096 --heads_q=16 --head_dim=128 --dtype=bf16"
declare -a SUMMARY
load() {  # load PORT LABEL CONCURRENCY SHAPE [more attnctl load flags]
  local port=$1 label=$2 conc=$3 shape=$4; shift 4
  local s=$secs
  case $label in large/*) s=$secs_large ;; esac
  "$bin/attnctl" --target="127.0.0.1:$port" --timeout=120s load --concurrency="$conc" \
    --warmup=1s --duration="${s}s" --channels=4 --label="$label" --csv="$raw" $shape "$@" \
    >>"$OUT/load.log" 2>>"$OUT/load-progress.log"
  local rc=$?
  SUMMARY+=("$(printf '%-34s c=%-8s rc=%s' "$label" "$conc" "$rc")")
}
check() {  # check PORT NAME [CONCURRENCY SHAPE]: every response of a short run verified
  local port=$1 name=$2 conc=${3:-16} shape=${4:-$small}
  "$bin/attnctl" --target="127.0.0.1:$port" --timeout=60s load --concurrency="$conc" --warmup=0s \
    --duration=3s --channels=4 --check $shape --causal >"$OUT/check-$name.log" 2>&1
  local rc=$?
  SUMMARY+=("$(printf '%-34s rc=%s %s' "check $name" "$rc" "$(grep -E '^concurrency=' "$OUT/check-$name.log" | awk '{print $2" req/s, errors="$NF}')")")
  grep -E 'requests by device|first error' "$OUT/check-$name.log" | sed 's/^/    /' >>"$OUT/check-notes.txt"
}
check 50061 attnserve-on
check 50062 attnserve-off
check 50071 python_sdpa
# The multi-GPU server fills one device's batch (batch_max_tokens) before the
# next gets work, so its check sends enough tokens to spill: 4096 per request
# at concurrency 32 (the log's "requests by device" shows both).
[ "$ngpu" -ge 2 ] && check 50063 attnserve-multi 32 \
  "--batch=4 --seqlen_q=512 --heads_q=8 --heads_kv=2 --head_dim=64 --dtype=fp16"

load 50061 small/echo/on 1,16,64 "$small" --rpc=echo
load 50061 small/attnserve/on 1,16,64 "$small"
load 50062 small/attnserve/off 1,16,64 "$small"
load 50071 small/python_sdpa/off 1,16,64 "$small"
[ "$ngpu" -ge 2 ] && load 50063 "small/attnserve-${ngpu}gpu/on" 64 "$small"
load 50061 large/echo/on 1,4,8 "$large" --rpc=echo
load 50061 large/attnserve/on 1,4,8 "$large"
load 50071 large/python_sdpa/off 1,4,8 "$large"
[ "$ngpu" -ge 2 ] && load 50063 "large/attnserve-${ngpu}gpu/on" 4,8 "$large"

# The metrics endpoint under load's aftermath: Triton's names, GPU gauges.
scrape_metrics http://127.0.0.1:50081/metrics >"$OUT/metrics-on.txt" 2>&1
[ "$ngpu" -ge 2 ] && scrape_metrics http://127.0.0.1:50083/metrics >"$OUT/metrics-multi.txt" 2>&1

echo "==== steps"
printf '%s\n' "${SUMMARY[@]}"
cat "$OUT/check-notes.txt" 2>/dev/null
echo "==== metrics (batching-on server)"
grep -E '^nv_(inference_(request_success|count|exec_count)|gpu_)' "$OUT/metrics-on.txt" | head -12
python3 bench/gpu/serving_report.py "$raw" --env "$OUT/env.txt" --out "$OUT/serving.csv"
