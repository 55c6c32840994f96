#!/usr/bin/env bash
# On a two-GPU machine (device kind nvidia-h100-x2 or nvidia-h200-x2, with a
# CUDA server and attnctl carried as .device-carry/server.tgz, see
# scripts/device/pack-device-deps.sh --server): one K/V cache moved between
# two CUDA servers on the same host, one GPU each, over gRPC on loopback.
# `attnctl load-kv --keep_cache --prefill_attend=false` fills the first server's
# cache (SEQS sequences x CONTEXT tokens x LAYERS layers, Hkv 8 / D 128, BF16,
# pages of 64: the default is the 69 GB of K and V of 64 x 8k x 32 layers), then
# `attnctl move-kv` copies it to the second server ROUNDS times (a new cache
# each round, dropped after it; the receiver's sequence and token counts
# recorded). Prints each move's GB/s and writes $OUT/kv-move.csv.
# BACKEND=cpu tries the script here on two CPU servers (small shapes; bin=
# the folder holding attnserve and attnctl).
# Usage: [SEQS=64] [CONTEXT=8192] [LAYERS=32] [ROUNDS=2] [BACKEND=cuda|cpu] [bin=DIR]
#        scripts/device/kv-move-bench.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/kv-move-out}
mkdir -p "$OUT"
[ -f .device-carry/server.tgz ] && tar -C .device-carry -xzf .device-carry/server.tgz
use_carried_libs lib
bin=${bin:-.device-carry/bin}
SEQS=${SEQS:-64} CONTEXT=${CONTEXT:-8192} LAYERS=${LAYERS:-32} ROUNDS=${ROUNDS:-2}
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
pids=()
for d in 0 1; do
  ctl=("$bin/attnctl" --target="127.0.0.1:${ports[$d]}" --timeout=600s)
  device=(); [ "$BACKEND" = cuda ] && device=(--devices="$d")
  start_server "$OUT/server$d.log" 90 "${ctl[@]}" -- "$bin/attnserve" --backend="$BACKEND" \
    --host=127.0.0.1 --port="${ports[$d]}" "${device[@]}" --log_level=warn --metrics_port=0 \
    --http_port=0 --kv_cache_bytes="$pool" || exit 1
  pids+=("$SERVER_PID")
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait' EXIT
{
  [ "$BACKEND" = cuda ] && nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv | sed 's/^/# /'
  echo "# commit ${ATTNSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}; $SEQS x $CONTEXT x $LAYERS layers, Hkv 8, D 128, BF16, pages of 64"
  echo "round,from_gpu,to_gpu,sequences,bytes,seconds,gb_per_s,resumed,receiver_sequences,receiver_tokens"
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

for r in $(seq 1 "$ROUNDS"); do
  echo "round $r: server 0 -> server 1" >&2
  "$bin/attnctl" --timeout=600s move-kv --from="127.0.0.1:${ports[0]}" \
    --to="127.0.0.1:${ports[1]}" --cache="$cache" --to_cache="moved-$r" --capacity_bytes="$bytes" \
    >"$OUT/move-$r.txt" 2>&1 || { echo "move $r failed: $(tail -3 "$OUT/move-$r.txt")"; break; }
  python3 - "$r" "$OUT/move-$r.txt" >>"$OUT/kv-move.csv" <<'EOF'
import re, sys
r, path = sys.argv[1:]
t = open(path).read()
m = re.search(r": (\d+) sequences, ([\d.]+) GB in ([\d.]+) s \(([\d.]+) GB/s\)", t)
res = re.search(r"; (\d+) resumed", t)
recv = re.search(r"receiver: +cache \S+ \(device \d+\): (\d+) sequences, (\d+) tokens", t)
print(",".join([r, "0", "1", m.group(1), str(int(float(m.group(2)) * 1e9)), m.group(3),
                m.group(4), res.group(1) if res else "", recv.group(1) if recv else "",
                recv.group(2) if recv else ""]))
EOF
  "$bin/attnctl" --target="127.0.0.1:${ports[1]}" kv drop --cache="moved-$r" >/dev/null 2>&1
done
grep -v "^#" "$OUT/kv-move.csv" | tr , "\t"
