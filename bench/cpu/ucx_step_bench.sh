#!/usr/bin/env bash
# The K/V decode step by transport on one host: the same unary decode loop
# (one group, one call in flight) with its q/k/v and O carried by gRPC bytes,
# by a registered system shared-memory region (--shm=system), by UCX over
# shared memory (UCX_TLS=sm,tcp; tcp only for UCX's connection manager) and
# by UCX over TCP (UCX_TLS=tcp), each with large steps tagged (rendezvous) and
# all on the stream (-stream), each against a fresh CPU server started
# with that UCX_TLS. Two shapes: "tiny" (8
# sequences x 64 context, Hq 8 / Hkv 2 / D 64, FP16: compute near nothing,
# the transport is the step) and "wide" (64 sequences x 16 context, Hq 32 /
# Hkv 8 / D 128, BF16: 512 KiB of q and of O per step). Rounds alternate the
# transports so drift shows. Rows go to $OUT/ucx-step.csv (load-kv's
# columns; label = shape-transport-round) and a p50 table is printed last.
# BIN is a build folder (server/attnserve, client/attnctl) or an install
# folder (bin/attnserve, bin/attnctl).
# Usage: [OUT=dir] [TOKENS=300] [ROUNDS=3] bench/cpu/ucx_step_bench.sh BIN
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
[ $# -ge 1 ] || { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
bin=$1
OUT=${OUT:-$PWD/ucx-step-out}
ROUNDS=${ROUNDS:-3}
TOKENS=${TOKENS:-300}
mkdir -p "$OUT"
csv=$OUT/ucx-step.csv
rm -f "$csv"
if [ -x "$bin/bin/attnserve" ]; then server_bin=$bin/bin/attnserve ctl_bin=$bin/bin/attnctl
else server_bin=$bin/server/attnserve ctl_bin=$bin/client/attnctl; fi
declare -A shapes=(
  [tiny]="--heads_q=8 --heads_kv=2 --head_dim=64 --dtype=fp16 --sequences=8 --prompt=64"
  [wide]="--heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --sequences=64 --prompt=16"
)
# transport name -> UCX_TLS of both processes, and load-kv's flags
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
for round in $(seq 1 "$ROUNDS"); do
  for t in grpc shm-system ucx-sm ucx-sm-stream ucx-tcp ucx-tcp-stream; do
    port=$(free_port)
    ucx_port=$(free_port)
    export UCX_TLS=${tls[$t]}
    ctl=("$ctl_bin" --target="127.0.0.1:$port" --timeout=120s)
    start_server "$OUT/$t-r$round-server.log" 60 "${ctl[@]}" -- "$server_bin" --backend=cpu \
      --host=127.0.0.1 --port="$port" --ucx_port="$ucx_port" --allow_client_shm \
      --log_level=warn --metrics_port=0 --http_port=0 --kv_cache_bytes=$((1 << 30)) ||
      { echo "$t: server did not start"; continue; }
    pid=$SERVER_PID
    for shape in tiny wide; do
      # shellcheck disable=SC2086  # the shape and flags are lists of words
      ATTNSERVE_UCX_TAGGED_BYTES=${tagged[$t]} "${ctl[@]}" load-kv ${shapes[$shape]} --page_size=64 --layers=1 --tokens="$TOKENS" \
        --warmup_tokens=20 --prefill_attend=false --concurrency=1 ${flags[$t]} --csv="$csv" \
        --label="$shape-$t-r$round" >"$OUT/$shape-$t-r$round.txt" 2>&1 ||
        echo "$shape $t round $round failed: $(tail -1 "$OUT/$shape-$t-r$round.txt")"
    done
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null
    pid=""
  done
done
unset UCX_TLS
python3 - "$csv" <<'PY'
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
by = {}
for r in rows:
    shape, rest = r["label"].split("-", 1)
    transport = rest.rsplit("-r", 1)[0]
    by.setdefault((shape, transport), []).append(r)
print(f"{'shape':>6} {'transport':>11} {'runs':>4} {'p50_ms':>8} {'p99_ms':>8} "
      f"{'server_ms':>9} {'outside_p50':>11} {'tok/s':>9}")
for (shape, transport), rs in sorted(by.items()):
    med = lambda c: statistics.median(float(r[c]) for r in rs)
    print(f"{shape:>6} {transport:>11} {len(rs):>4} {med('p50_ms'):8.3f} {med('p99_ms'):8.3f} "
          f"{med('server_total_ms'):9.3f} {med('outside_server_p50_ms'):11.3f} {med('tokens_per_s'):9.0f}")
PY
