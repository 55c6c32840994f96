#!/usr/bin/env bash
# On a two-GPU machine (device `run`, kind nvidia-h100-x2 or nvidia-h200-x2):
# does one server on both GPUs serve two decode clients as two one-GPU
# servers do? Each client is `attnctl load-kv` (64 sequences x 8k context,
# Hq 32 / Hkv 8 / D 128, BF16, 1 layer, 4 streams), the two run at once:
#   split     two servers, --devices=0 and --devices=1, one client each
#   shared    one server with --devices=all, both clients on it
#   shared_old  the same against the older tree's server (.device-carry/old/bin)
#   alone     one client alone on the shared server
# Rows go to $OUT/two-gpu.csv (load-kv's columns, label = config-client);
# each server's log says where its caches went. Expects .device-carry as
# scripts/device/ab-serving.sh does (servers.tar.xz with bin/, lib/, old/bin/).
# Usage: [TOKENS=32] [CONFIGS="split shared old"] scripts/device/two-gpu-decode.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/two-gpu-out}
mkdir -p "$OUT"
tokens=${TOKENS:-32}
tar -C .device-carry -xJf .device-carry/servers.tar.xz
use_carried_libs lib
csv=$OUT/two-gpu.csv
rm -f "$csv"
pids=()
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done; wait' EXIT
serve() {  # serve BIN_DIR PORT LOG FLAGS...
  local bin=$1 port=$2 log=$3
  shift 3
  start_server "$OUT/$log" 60 "$bin/attnctl" --target="127.0.0.1:$port" -- \
    "$bin/attnserve" --backend=cuda --host=127.0.0.1 --port="$port" --log_level=info \
    --metrics_port=0 --http_port=0 --kv_cache_bytes=$((40 << 30)) "$@" || return 1
  pids+=("$SERVER_PID")
}
stop_all() {  # SIGTERM each server and wait for it (a drain that hangs is killed after 30 s)
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do
    wait_until 30 0.2 bash -c "! kill -0 $p" || { echo "server $p still up 30 s after SIGTERM"; kill -KILL "$p"; }
  done
  pids=()
}
client() {  # client BIN_DIR PORT LABEL
  timeout 300 "$1/attnctl" --target="127.0.0.1:$2" --timeout=600s load-kv --heads_q=32 --heads_kv=8 \
    --head_dim=128 --dtype=bf16 --page_size=64 --sequences=64 --prompt=8192 --tokens="$tokens" \
    --warmup_tokens=2 --layers=1 --stream --channels=4 --concurrency=4 --csv="$csv" --label="$3" \
    >"$OUT/$3.txt" 2>&1 || { echo "$3 failed:"; tail -3 "$OUT/$3.txt"; }
}
new=.device-carry/bin
old=.device-carry/old/bin
# CONFIGS picks which to run (default all): split shared old.
configs=" ${CONFIGS:-split shared old} "

pair() {  # pair BIN PORT_A PORT_B LABEL: two clients at once
  client "$1" "$2" "$4-a" &
  local a=$!
  client "$1" "$3" "$4-b"
  wait "$a"
}
if [[ $configs == *" split "* ]]; then
  serve $new 50101 split-0.log --devices=0 && serve $new 50102 split-1.log --devices=1 &&
    pair $new 50101 50102 split
  stop_all
fi
if [[ $configs == *" shared "* ]]; then
  serve $new 50103 shared.log --devices=all && { pair $new 50103 50103 shared; client $new 50103 alone-a; }
  stop_all
fi
if [[ $configs == *" old "* ]]; then
  serve $old 50104 shared-old.log --devices=all && pair $old 50104 50104 shared_old
  stop_all
fi
python3 - "$csv" <<'PY'
import csv, sys
rows = {r["label"]: r for r in csv.DictReader(open(sys.argv[1]))}
def tok(*labels): return sum(float(rows[l]["tokens_per_s"]) for l in labels if l in rows)
split, shared, old = tok("split-a", "split-b"), tok("shared-a", "shared-b"), tok("shared_old-a", "shared_old-b")
alone = tok("alone-a")
split = split or float("nan")
alone = alone or float("nan")
for l, r in sorted(rows.items()):
    print(f"{l:<16} {float(r['tokens_per_s']):>9.0f} tok/s  p50 {float(r['p50_ms']):.3f} ms  batch {float(r['mean_batch_size']):.2f}")
print(f"shared/split {shared / split:.3f}   shared/alone {shared / alone:.3f}   old shared/split {old / split:.3f}")
PY
grep -h "kv cache created" "$OUT"/shared*.log | sed -E 's/.*(id=[^ ]+ device=[0-9]+).*/\1/' | head -8
