#!/usr/bin/env bash
# On the GPU machine (device `run`): one tree against another, side by side in
# one run. The K/V decode loop (attnctl load-kv, 64 sequences x 8k context,
# Hq 32 / Hkv 8 / D 128, BF16, 1 layer; unary and 4 streams) against each
# tree's server, alternated A B A B so drift between rounds shows, each server
# first passing a short --check loop; then attn_bench's quick grid (BF16,
# ours) built from each tree's sources. Rows go to $OUT/ab-loop.csv (load-kv's
# columns, label = tree-round-config) and $OUT/ab-bench.csv; a table is
# printed last.
# Expects, carried in .device-carry: absl/ (scripts/device/pack-device-deps.sh),
# servers.tar.xz holding bin/ and lib/ (this tree's attnserve and attnctl, a
# shared-library build, and their libraries) and old/bin/ (the other tree's),
# and old-src.tgz (the other tree's backend, bench and test sources, under old/).
# Usage: [TOKENS=16] [OLD_COMMIT=sha] [NEW_COMMIT=sha] scripts/device/ab-serving.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/ab-out}
mkdir -p "$OUT"
tokens=${TOKENS:-16}
t0=$(date +%s)
tar -C .device-carry -xJf .device-carry/servers.tar.xz
rm -rf /tmp/ab && mkdir -p /tmp/ab && tar -C /tmp/ab -xzf .device-carry/old-src.tgz
use_carried_libs absl lib

# Both trees' attn_bench first, so no build competes with the serving rounds.
cuda_build . build-ab-new "$OUT/build-new.log" -DATTNSERVE_BUILD_TESTS=OFF attn_bench || exit 1
cuda_build /tmp/ab/old build-ab-old "$OUT/build-old.log" -DATTNSERVE_BUILD_TESTS=OFF attn_bench || exit 1
echo "builds: $(( $(date +%s) - t0 )) s"

port=50071
pid=""
trap '[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; wait' EXIT
csv=$OUT/ab-loop.csv
rm -f "$csv"
shape=(--heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --page_size=64)
loop=(--sequences=64 --prompt=8192 --tokens="$tokens" --warmup_tokens=2 --layers=1)
round() {  # round TREE BIN_DIR ROUND
  local tree=$1 bin=$2 n=$3
  start_server "$OUT/server-$tree-$n.log" 60 "$bin/attnctl" --target="127.0.0.1:$port" -- \
    "$bin/attnserve" --backend=cuda --host=127.0.0.1 --port="$port" --log_level=warn \
    --metrics_port=0 --http_port=0 --devices=0 --kv_cache_bytes=$((40 << 30)) || return 1
  pid=$SERVER_PID
  local ctl=("$bin/attnctl" --target="127.0.0.1:$port" --timeout=600s)
  if [ "$n" = 1 ]; then
    "${ctl[@]}" load-kv --sequences=4 --prompt=300 --tokens=4 --layers=2 "${shape[@]}" --check \
      >"$OUT/check-$tree.txt" 2>&1 && echo "$tree check: PASS" || { echo "$tree check: FAIL"; tail -5 "$OUT/check-$tree.txt"; }
  fi
  timeout 200 "${ctl[@]}" load-kv "${shape[@]}" "${loop[@]}" --csv="$csv" --label="$tree-$n-unary" \
    >"$OUT/$tree-$n-unary.txt" 2>&1 || tail -3 "$OUT/$tree-$n-unary.txt"
  timeout 200 "${ctl[@]}" load-kv "${shape[@]}" "${loop[@]}" --stream --channels=4 --concurrency=4 \
    --csv="$csv" --label="$tree-$n-stream4" >"$OUT/$tree-$n-stream4.txt" 2>&1 || tail -3 "$OUT/$tree-$n-stream4.txt"
  kill -TERM "$pid"; wait "$pid"; pid=""
}
for n in 1 2; do
  round old .device-carry/old/bin "$n"
  round new .device-carry/bin "$n"
done

bench_csv=$OUT/ab-bench.csv
{
  echo "# gpu: $(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | head -1)"
  echo "# old: ${OLD_COMMIT:-unknown}; new: ${NEW_COMMIT:-unknown}; attn_bench --grid=quick --dtypes=bf16 --impls=ours"
} >"$bench_csv"
for tree in old new; do
  build-ab-"$tree"/bench/cuda/attn_bench --grid=quick --dtypes=bf16 --impls=ours --kv_csv=/dev/null \
    --csv="$OUT/bench-$tree.csv" 2>>"$OUT/attn_bench.log"
  [ "$tree" = old ] && head -1 "$OUT/bench-$tree.csv" >>"$bench_csv"
  tail -n +2 "$OUT/bench-$tree.csv" | sed -E "s/,ours,/,$tree,/" >>"$bench_csv"
done
python3 bench/gpu/ab_table.py "$csv" "$bench_csv"
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude='ab-*.csv' ./* 2>/dev/null &&
  find . -maxdepth 1 -type f ! -name logs.tgz ! -name 'ab-*.csv' -delete)
