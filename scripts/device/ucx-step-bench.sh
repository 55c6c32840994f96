#!/usr/bin/env bash
# The K/V decode step by transport on the GPU machine (same host): one unary
# decode loop (64 sequences x 8k context, Hq 32 / Hkv 8 / D 128, BF16, pages
# of 64, one layer) with q/k/v and O carried by gRPC bytes, by system shared
# memory (--shm=system), by UCX over shared memory (UCX_TLS=sm,tcp: tcp only
# for UCX's connection manager) and by UCX over TCP (UCX_TLS=tcp), each with
# its payloads as tagged messages (rendezvous: ucx-sm, ucx-tcp) and on the
# stream (ucx-sm-stream, ucx-tcp-stream), each against a fresh CUDA server
# started with that UCX_TLS, rounds alternated; first one short --check loop over UCX-sm.
# Prints p50 per transport beside the server's compute (the kernel) and
# p50 - compute, the transport's share, against the 100 us target.
#
# Two steps. Here, from a shared-library (not ATTNSERVE_STATIC) CUDA build
# that found UCX (its CMake log says "UCX 1.13.1 found"):
#   scripts/device/ucx-step-bench.sh --pack BUILD_DIR
# packs attnserve, attnctl, every library they load (UCX's too) and UCX's
# transport modules into .device-carry/server.tgz. Then on the device:
#   run(command="scripts/device/ucx-step-bench.sh", carry=[".device-carry"])
# Rows go to $OUT/ucx-step-gpu.csv (load-kv's columns; label =
# transport-round) and the table is printed last.
# Usage: [OUT=dir] [TOKENS=48] [ROUNDS=2] scripts/device/ucx-step-bench.sh [--pack BUILD_DIR]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh

if [ "${1:-}" = --pack ]; then
  build=${2:?usage: scripts/device/ucx-step-bench.sh --pack BUILD_DIR}
  ldd "$build/server/attnserve" | grep -q libucp ||
    { echo "$build/server/attnserve does not link UCX (reconfigure with libucx-dev installed)" >&2; exit 1; }
  scripts/device/pack-device-deps.sh --server "$build" || exit 1
  # UCX dlopen()s its transport modules (CMA, verbs) from its own folder.
  mkdir -p .device-carry/lib/ucx
  cp -L /usr/lib/x86_64-linux-gnu/ucx/libuct_*.so.0 .device-carry/lib/ucx/
  tar -C .device-carry -czf .device-carry/server.tgz bin lib
  du -sh .device-carry/server.tgz
  exit 0
fi

OUT=${OUT:-$PWD/ucx-step-gpu-out}
mkdir -p "$OUT"
[ -f .device-carry/server.tgz ] && tar -C .device-carry -xzf .device-carry/server.tgz
use_carried_libs lib
export UCX_MODULE_DIR=$PWD/.device-carry/lib/ucx
bin=.device-carry/bin
csv=$OUT/ucx-step-gpu.csv
rm -f "$csv"
{
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
  echo "commit ${ATTNSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  echo "libucp: $(ldd "$bin/attnserve" | awk '/libucp/ {print $3}')"
} | sed 's/^/# /' | tee "$OUT/header.txt"
shape=(--heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --page_size=64 --sequences=64
  --prompt=8192 --tokens="${TOKENS:-48}" --warmup_tokens=4 --layers=1 --prefill_attend=false
  --concurrency=1)
declare -A tls=([grpc]=tcp [shm-system]=tcp [ucx-sm]="sm,tcp" [ucx-tcp]=tcp
  [ucx-sm-stream]="sm,tcp" [ucx-tcp-stream]=tcp)
declare -A flags=([grpc]="--transport=grpc" [shm-system]="--shm=system"
  [ucx-sm]="--transport=ucx" [ucx-tcp]="--transport=ucx"
  [ucx-sm-stream]="--transport=ucx" [ucx-tcp-stream]="--transport=ucx")
# The client's ATTNSERVE_UCX_TAGGED_BYTES: ucx-* send steps of 64 KiB or more
# as tagged messages (rendezvous), ucx-*-stream every step on the stream.
declare -A tagged=([grpc]="" [shm-system]="" [ucx-sm]=65536 [ucx-tcp]=65536 [ucx-sm-stream]=off
  [ucx-tcp-stream]=off)
pid=""
trap '[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait' EXIT
start() {  # start TRANSPORT: a fresh server with that transport's UCX_TLS
  export UCX_TLS=${tls[$1]}
  port=$(free_port)
  ctl=("$bin/attnctl" --target="127.0.0.1:$port" --timeout=600s)
  start_server "$OUT/$1-server.log" 120 "${ctl[@]}" -- "$bin/attnserve" --backend=cuda \
    --host=127.0.0.1 --port="$port" --ucx_port="$(free_port)" --allow_client_shm \
    --log_level=warn --metrics_port=0 --http_port=0 --devices=0 --kv_cache_bytes=$((16 << 30)) ||
    return 1
  pid=$SERVER_PID
}
stop() { kill -TERM "$pid"; wait "$pid" 2>/dev/null; pid=""; }

if start ucx-sm; then
  if "${ctl[@]}" load-kv --heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --sequences=4 \
    --prompt=300 --tokens=3 --transport=ucx --check >"$OUT/check.txt" 2>&1 &&
    grep -q "over UCX" "$OUT/check.txt"; then
    echo "UCX-sm --check: ok"
  else
    echo "UCX-sm --check FAILED"
    tail -5 "$OUT/check.txt"
  fi
  stop
fi
for round in $(seq 1 "${ROUNDS:-2}"); do
  for t in grpc shm-system ucx-sm ucx-sm-stream ucx-tcp ucx-tcp-stream; do
    start "$t" || { echo "$t: server did not start"; continue; }
    echo "round $round: $t" >&2
    # shellcheck disable=SC2086  # flags is a list of words
    ATTNSERVE_UCX_TAGGED_BYTES=${tagged[$t]} timeout 300 "${ctl[@]}" load-kv "${shape[@]}" ${flags[$t]} --csv="$csv" --label="$t-r$round" \
      >"$OUT/$t-r$round.txt" 2>&1 || echo "$t round $round failed: $(tail -2 "$OUT/$t-r$round.txt")"
    stop
  done
done
python3 - "$csv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
by = {}
for r in rows:
    by.setdefault(r["label"].rsplit("-r", 1)[0], []).append(r)
print(f"{'transport':>11} {'runs':>4} {'p50_ms':>8} {'p99_ms':>8} {'compute_ms':>10} "
      f"{'p50-compute_us':>14} {'target':>8}")
for t, rs in sorted(by.items()):
    med = lambda c: statistics.median(float(r[c]) for r in rs)
    over = (med("p50_ms") - med("compute_ms")) * 1e3
    print(f"{t:>11} {len(rs):>4} {med('p50_ms'):8.3f} {med('p99_ms'):8.3f} "
          f"{med('compute_ms'):10.3f} {over:14.0f} {'met' if over <= 100 else 'missed':>8}")
PY
