#!/usr/bin/env bash
# On a two-GPU machine (device kind nvidia-h100-x2 or nvidia-h200-x2, with a
# CUDA server and attnctl built with UCX, packed with UCX's modules by
# `scripts/device/ucx-step-bench.sh --pack BUILD_DIR` into .device-carry/server.tgz):
# one K/V cache moved between two CUDA servers on the same host, one GPU each.
# `attnctl load-kv --keep_cache --prefill_attend=false` fills the first server's
# cache (SEQS sequences x CONTEXT tokens x LAYERS layers, Hkv 8 / D 128, BF16,
# pages of 64: the default is the 69 GB of K and V of 64 x 8k x 32 layers), then
# `attnctl move-kv` copies it to the second server once per row of ROWS (a new
# cache each time, dropped after it; the receiver's sequence and token counts
# recorded). A row is PLANE:LANES:
#   grpc:N  the pages in the gRPC streams through attnctl, N transfers at once
#   ucx:N   the pages from server to server over UCX (UCX_TLS, default sm,tcp:
#           shared memory, tcp for UCX's connection manager), gRPC the control
#   cut:N   ucx:N whose attnctl is killed after CUT_FRACTION of the last ucx
#           row's time and run again with the same --transfer_id: the resume.
#           resent_bytes = what the source read for sending beyond the cache
#           (its attnserve_kv_transfer_bytes_total{direction="export"} counter);
#           resumed counts the rerun as one (0: the move ended before the cut)
# UCX rows use CHUNK-byte chunks (default 16 MiB), gRPC rows the default 4 MiB.
# Prints each row's GB/s and writes $OUT/kv-move.csv.
# BACKEND=cpu tries the script here on two CPU servers (small shapes; bin=
# the folder holding attnserve and attnctl).
# Usage: [SEQS=64] [CONTEXT=8192] [LAYERS=32] [ROWS="grpc:1 grpc:8 ucx:1 ucx:4 ucx:8 cut:8"]
#        [CHUNK=16777216] [CUT_FRACTION=0.4] [UCX_TLS=sm,tcp] [BACKEND=cuda|cpu] [bin=DIR]
#        scripts/device/kv-move-bench.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/kv-move-out}
mkdir -p "$OUT"
[ -f .device-carry/server.tgz ] && tar -C .device-carry -xzf .device-carry/server.tgz
use_carried_libs lib
[ -d .device-carry/lib/ucx ] && export UCX_MODULE_DIR=$PWD/.device-carry/lib/ucx
export UCX_TLS=${UCX_TLS:-sm,tcp}
bin=${bin:-.device-carry/bin}
SEQS=${SEQS:-64} CONTEXT=${CONTEXT:-8192} LAYERS=${LAYERS:-32}
ROWS=${ROWS:-grpc:1 grpc:8 ucx:1 ucx:4 ucx:8 cut:8}
CHUNK=${CHUNK:-16777216} CUT_FRACTION=${CUT_FRACTION:-0.4}
BACKEND=${BACKEND:-cuda}
if [ "$BACKEND" = cuda ]; then
  gpus=$(nvidia-smi -L | wc -l)
  [ "$gpus" -ge 2 ] || { echo "needs two GPUs, found $gpus" >&2; exit 2; }
fi
# Both servers hold the whole cache (pages of 64 round each sequence up; the
# pool grows in slabs of up to 4 GiB, hence the margin).
bytes=$(( SEQS * ((CONTEXT + 1 + 63) / 64 * 64) * LAYERS * 8 * 128 * 2 * 2 ))
pool=$(( bytes + (8 << 30) ))
ports=(50181 50182)
metrics=$(free_port)
pids=()
for d in 0 1; do
  ctl=("$bin/attnctl" --target="127.0.0.1:${ports[$d]}" --timeout=600s)
  device=(); [ "$BACKEND" = cuda ] && device=(--devices="$d")
  mport=0; [ "$d" = 0 ] && mport=$metrics
  server=("$bin/attnserve" --backend="$BACKEND" --host=127.0.0.1 --port="${ports[$d]}" "${device[@]}"
    --log_level=info --http_port=0 --kv_cache_bytes="$pool" --ucx_port=-1)
  if ! start_server "$OUT/server$d.log" 90 "${ctl[@]}" -- "${server[@]}" --metrics_port="$mport"; then
    # A build without /metrics (static): no resent_bytes column then.
    kill "$SERVER_PID" 2>/dev/null; wait "$SERVER_PID" 2>/dev/null
    metrics=""
    start_server "$OUT/server$d.log" 90 "${ctl[@]}" -- "${server[@]}" --metrics_port=0 || exit 1
  fi
  pids+=("$SERVER_PID")
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' EXIT
exported() {
  [ -n "$metrics" ] && metric_value "http://127.0.0.1:$metrics/metrics" attnserve_kv_transfer_bytes_total
}
{
  [ "$BACKEND" = cuda ] && nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | sed 's/^/# /'
  echo "# commit ${ATTNSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}; $SEQS x $CONTEXT x $LAYERS layers, Hkv 8, D 128, BF16, pages of 64; UCX_TLS=$UCX_TLS; ucx chunks $CHUNK bytes"
  echo "row,data_plane,lanes,from_gpu,to_gpu,sequences,bytes,seconds,gb_per_s,resumed,resent_bytes,receiver_sequences,receiver_tokens"
} >"$OUT/kv-move.csv"

t0=$(date +%s)
"$bin/attnctl" --target="127.0.0.1:${ports[0]}" --timeout=600s load-kv --heads_q=32 --heads_kv=8 \
  --head_dim=128 --dtype=bf16 --page_size=64 --sequences="$SEQS" --prompt="$CONTEXT" --tokens=1 \
  --layers="$LAYERS" --prefill_attend=false --concurrency=8 --channels=8 --prefill_chunk=4096 \
  --keep_cache >"$OUT/fill.txt" 2>"$OUT/fill.err" ||
  { echo "fill failed: $(tail -n 3 "$OUT/fill.txt")"; exit 1; }
cache=$(sed -nE 's/.*; cache ([^,]+), page size.*/\1/p' "$OUT/fill.txt" | head -1)
echo "filled cache $cache on server 0 in $(( $(date +%s) - t0 )) s ($(grep -m1 prefill "$OUT/fill.txt"))"
[ -n "$cache" ] || { echo "no cache id in fill.txt"; exit 1; }

last_ucx_s=""
n=0
for row in $ROWS; do
  n=$((n + 1))
  plane=${row%%:*} lanes=${row#*:}
  flags=(--lanes="$lanes")
  case $plane in
    grpc) flags+=(--data_plane=grpc) ;;
    ucx | cut) flags+=(--data_plane=ucx --max_chunk_bytes="$CHUNK") ;;
    *) echo "row $row: expected grpc:N, ucx:N or cut:N" >&2; continue ;;
  esac
  move=("$bin/attnctl" --timeout=600s move-kv --from="127.0.0.1:${ports[0]}"
    --to="127.0.0.1:${ports[1]}" --cache="$cache" --to_cache="moved-$n" --capacity_bytes="$bytes"
    "${flags[@]}")
  echo "row $n ($row): server 0 -> server 1" >&2
  before=$(exported)
  start=$(date +%s.%N)
  rerun=0
  if [ "$plane" = cut ]; then
    # The first run is killed part way; the second, same transfer id, resumes.
    wait_s=$(python3 -c "print(max(1.0, ${CUT_FRACTION} * float('${last_ucx_s:-10}')))")
    "${move[@]}" --transfer_id="cut-$n" >"$OUT/move-$n-cut.txt" 2>&1 &
    mpid=$!
    sleep "$wait_s"
    kill -TERM "$mpid" 2>/dev/null
    wait "$mpid" 2>/dev/null
    if grep -q "^moved cache" "$OUT/move-$n-cut.txt"; then
      echo "row $n: finished before the cut at ${wait_s} s (no resume: lower CUT_FRACTION)" >&2
      cp "$OUT/move-$n-cut.txt" "$OUT/move-$n.txt"
    else
      rerun=1
      "${move[@]}" --transfer_id="cut-$n" >"$OUT/move-$n.txt" 2>&1 ||
        { echo "move $n failed: $(tail -3 "$OUT/move-$n.txt")"; continue; }
    fi
  else
    "${move[@]}" >"$OUT/move-$n.txt" 2>&1 ||
      { echo "move $n failed: $(tail -3 "$OUT/move-$n.txt")"; continue; }
  fi
  end=$(date +%s.%N)
  after=$(exported)
  python3 - "$row" "$OUT/move-$n.txt" "$start" "$end" "${before:-}" "${after:-}" "$rerun" \
    >>"$OUT/kv-move.csv" <<'EOF'
import re, sys
row, path, start, end, before, after, rerun = sys.argv[1:]
t = open(path).read()
m = re.search(r": (\d+) sequences, ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s\)", t)
res = re.search(r"; (\d+) resumed", t)
plane = re.search(r"data plane: (\w+)", t)
recv = re.search(r"receiver: +cache \S+ \(device \d+\): (\d+) sequences, (\d+) tokens", t)
kind, lanes = row.split(":")
seconds = float(m.group(3))
moved = int(float(m.group(2)) * 1e9)
sent = int(float(after) - float(before)) if before and after else -1
if kind == "cut":
    # Both runs' wall time; bytes (the whole cache) filled in below.
    seconds = float(end) - float(start)
    moved = -1
print(",".join([row, plane.group(1) if plane else "", lanes, "0", "1", m.group(1), str(moved),
                "%.3f" % seconds, "%.2f" % (moved / 1e9 / seconds if seconds > 0 else 0),
                str(int(res.group(1) if res else 0) + int(rerun)), str(sent), recv.group(1) if recv else "",
                recv.group(2) if recv else ""]))
EOF
  [ "$plane" = ucx ] && last_ucx_s=$(tail -1 "$OUT/kv-move.csv" | cut -d, -f8)
  "$bin/attnctl" --target="127.0.0.1:${ports[1]}" kv drop --cache="moved-$n" >/dev/null 2>&1
done
# resent_bytes: the source's export counter over the row less the cache's bytes
# (the first grpc or ucx row's); a cut row's excess is what the resume sent
# again (chunks in flight at the cut), and its GB/s is the cache over both runs.
python3 - "$OUT/kv-move.csv" <<'EOF'
import sys
lines = open(sys.argv[1]).read().splitlines()
rows = [l.split(",") for l in lines if l and not l.startswith("#")]
head, body = rows[0], rows[1:]
full = next((int(r[10]) for r in body if not r[0].startswith("cut") and int(r[10]) > 0), None)
out = [l for l in lines if l.startswith("#")] + [",".join(head)]
for r in body:
    if full is not None and int(r[10]) >= 0:
        r[10] = str(int(r[10]) - full)
    if r[0].startswith("cut") and full is not None:
        r[6] = str(full)
        r[8] = "%.2f" % (full / 1e9 / float(r[7]))
    out.append(",".join(r))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
EOF
grep -v "^#" "$OUT/kv-move.csv" | tr , "\t"
