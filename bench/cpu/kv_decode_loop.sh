#!/usr/bin/env bash
# The K/V decode loop on the CPU backend: a host-path row anyone can run (no
# GPU), so a regression of the serving path (parsing, admission, hand-offs,
# allocation, response building) shows between sessions. The shape is small
# enough that the CPU kernel does not hide the host path: 32 sequences x 256
# context, Hq 8 / Hkv 2 / D 64, FP16, pages of 64, 1 layer, one new token per
# step; unary (one group) and 4 streams. Each DIR holds bin/attnserve and
# bin/attnctl (or server/attnserve and client/attnctl of a build folder);
# rounds alternate the DIRs so drift between rounds shows. Rows go to
# $OUT/kv-decode-cpu.csv (load-kv's columns, label = dir-round-config) and a
# table is printed last. CLIENT=path/to/attnctl drives every server with one
# client, so only the servers differ (and older servers can be measured).
# Usage: [CLIENT=attnctl] [TOKENS=200] bench/cpu/kv_decode_loop.sh ROUNDS DIR [DIR...]
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
[ $# -ge 2 ] || { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
OUT=${OUT:-$PWD/kv-decode-cpu-out}
mkdir -p "$OUT"
rounds=$1
shift
csv=$OUT/kv-decode-cpu.csv
rm -f "$csv"
shape=(--heads_q=8 --heads_kv=2 --head_dim=64 --dtype=fp16 --page_size=64 --sequences=32
  --prompt=256 --tokens=${TOKENS:-200} --warmup_tokens=10 --layers=1 --prefill_attend=false)
bin_of() {  # bin_of DIR NAME: the binary NAME in an install-like or a build folder
  if [ -x "$1/bin/$2" ]; then echo "$1/bin/$2"; elif [ "$2" = attnserve ]; then
    echo "$1/server/attnserve"; else echo "$1/client/attnctl"; fi
}
pid=""
trap '[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait' EXIT
for round in $(seq 1 "$rounds"); do
  for dir in "$@"; do
    name=$(basename "$dir")
    port=$(free_port)
    server=$(bin_of "$dir" attnserve)
    ctl=("${CLIENT:-$(bin_of "$dir" attnctl)}" --target="127.0.0.1:$port" --timeout=120s)
    log=$OUT/$name-r$round
    start_server "$log-server.log" 60 "${ctl[@]}" -- "$server" --backend=cpu --host=127.0.0.1 \
      --port="$port" --log_level=warn --metrics_port=0 --http_port=0 --kv_cache_bytes=$((1 << 30)) ||
      { echo "$name: server did not start"; continue; }
    pid=$SERVER_PID
    echo "round $round $name: unary, then 4 streams" >&2
    "${ctl[@]}" load-kv "${shape[@]}" --concurrency=1 --csv="$csv" --label="$name-r$round-unary" \
      >"$log-unary.txt" 2>&1 || echo "$name round $round unary failed: $(tail -1 "$log-unary.txt")"
    "${ctl[@]}" load-kv "${shape[@]}" --concurrency=4 --stream --channels=4 --csv="$csv" \
      --label="$name-r$round-streams4" >"$log-streams.txt" 2>&1 ||
      echo "$name round $round streams failed: $(tail -1 "$log-streams.txt")"
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null
    pid=""
  done
done
python3 - "$csv" <<'EOF'
import csv, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if not l.startswith("#"))]
head, body = rows[0], rows[1:]
col = {name: i for i, name in enumerate(head)}
want = [c for c in ("label", "tokens_per_s", "p50_ms", "p99_ms", "compute_ms", "server_total_ms")
        if c in col]
print(" ".join(f"{c:>16}" for c in want))
for r in body:
    print(" ".join(f"{(r[col[c]] if col[c] < len(r) else ''):>16}" for c in want))
EOF
