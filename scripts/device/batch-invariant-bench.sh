#!/usr/bin/env bash
# On the GPU machine (device `run`, with .device-carry carried): batch-invariant
# mode (AttnParams::batch_invariant, docs/design.md §3) checked and priced.
# Builds like gpu-check.sh (server off; KERNELS=dev by default: the D 128
# kernels only), runs cuda_batch_invariance_test under the planner's choice and
# under ATTNSERVE_CUDA_PORTABLE=1, cuda_backend_test's split cases (the
# combine code the mode touches), compute-sanitizer memcheck and racecheck on
# the invariance test's decode cases, then attn_bench --grid=quick (the quick
# prefill grid and the decode grid) with ours and ours_bi, twice in opposite
# orders. Prints a table of ours_bi / ours per shape (the mean of the two
# passes' medians) and writes every row to
# $OUT/batch-invariant-<gpu>-<date>.csv ('#' lines: GPU, clocks, commit).
# The target: ours_bi / ours <= 1.10 on every decode and quick prefill row.
# The ablation of the decode split rule's minimum split size T
# (attn_fwd_plan.h, kInvariantMinTiles) in the same run: the decode grid again
# as ours_bi under ATTNSERVE_CUDA_INVARIANT_MIN_TILES=T for each T of
# T_SWEEP (default "1 4 16 32"; 1 is the rule before T, ceil(tiles / S) per
# split), rows named ours_bi_t<T>, one more ratio column each.
# GRID=decodesweep T_GRID=decodesweep: the same over B = 1 and 16 at 1k..32k
# keys instead (what T costs a single short sequence).
# Usage: [KERNELS=dev|all] [BUILD=dir] [COMMIT=sha] [T_SWEEP="1 4 16 32"] [GRID=quick] [T_GRID=decode]
#          scripts/device/batch-invariant-bench.sh [--no-sanitizer] [--no-tests] [--no-bench]
# (a call of the device tool lasts 10 minutes at most: the build stays in $B
# between calls on a warm machine, so tests and bench may go in two calls)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/batch-invariant-out}
mkdir -p "$OUT"
SAN=1 TESTS=1 BENCH=1
for a in "$@"; do
  case $a in --no-sanitizer) SAN=0 ;; --no-tests) TESTS=0 ;; --no-bench) BENCH=0 ;; esac
done
declare -a SUMMARY
note() { SUMMARY+=("$(printf '%-40s %s' "$1" "$2")"); }

KERNELS=${KERNELS:-dev}
B=build-gpu
[ "$KERNELS" = dev ] && B=build-gpu-dev
B=${BUILD:-$B}
use_carried_libs absl lib
t0=$(date +%s)
if cuda_build . "$B" "$OUT/build.log" cuda_batch_invariance_test cuda_backend_test attn_bench \
  plan_invariant_split_test; then
  note build "ok ($(($(date +%s) - t0)) s, KERNELS=$KERNELS)"
else
  note build "FAILED (see build.log)"
  printf '%s\n' "${SUMMARY[@]}"
  exit 1
fi
T=$B/tests/cuda

run_test() { # run_test NAME LOG CMD...
  local name=$1 log=$2
  shift 2
  timeout 400 "$@" >"$OUT/$log" 2>&1
  local rc=$?
  note "$name" "rc=$rc $(gtest_counts "$OUT/$log")"
  grep -E '^\[  FAILED  \]|Failure|Which is|differ' "$OUT/$log" | head -10
}
if [ $TESTS = 1 ]; then
  run_test "invariant split plan (host)" plan.log "$B"/tests/backend/plan_invariant_split_test
  run_test "invariance (planner's choice)" inv-default.log "$T"/cuda_batch_invariance_test
  ATTNSERVE_CUDA_PORTABLE=1 run_test "invariance (portable)" inv-portable.log "$T"/cuda_batch_invariance_test
  run_test "cuda_backend_test split cases" split.log "$T"/cuda_backend_test --gtest_filter='Split/*:CudaSplitWorkspace.*'
fi
if [ $TESTS = 1 ] && [ $SAN = 1 ]; then
  for tool in memcheck racecheck; do
    log="$OUT/sanitizer-$tool.log"
    timeout 500 compute-sanitizer --tool $tool --error-exitcode 9 \
      "$T"/cuda_batch_invariance_test --gtest_filter='*Fused*' >"$log" 2>&1
    note "compute-sanitizer $tool (fused/kernel combine)" "rc=$? $(grep -E 'ERROR SUMMARY' "$log" | tail -1)"
  done
fi

if [ $BENCH = 0 ]; then
  printf '%s\n' "${SUMMARY[@]}"
  exit 0
fi
# The cost: quick prefill grid + decode grid, ours and ours_bi in both orders.
t1=$(date +%s)
rows=$OUT/rows.csv
: >"$rows"
for order in ours,ours_bi ours_bi,ours; do
  tag=${order%%,*}
  "$B"/bench/cuda/attn_bench --grid="${GRID:-quick}" --dtypes=bf16 --impls=$order --csv="$OUT/b-$tag.csv" \
    2>>"$OUT/attn_bench.log" && tail -n +2 "$OUT/b-$tag.csv" >>"$rows"
done
# The T ablation: decode grid only, its rows renamed ours_bi_t<T>.
ABL=()
for t in ${T_SWEEP-1 4 16 32}; do
  ATTNSERVE_CUDA_INVARIANT_MIN_TILES=$t "$B"/bench/cuda/attn_bench --grid="${T_GRID:-decode}" --dtypes=bf16 \
    --impls=ours_bi --csv="$OUT/b-t$t.csv" 2>>"$OUT/attn_bench.log" &&
    tail -n +2 "$OUT/b-t$t.csv" | awk -F, -v OFS=, -v t="$t" '{ $10 = "ours_bi_t" t; print }' >>"$rows"
  ABL+=("ours_bi_t$t")
done
note attn_bench "$(($(date +%s) - t1)) s, $(wc -l <"$rows") rows; $(grep -cE 'SKIP|FAIL|error' "$OUT/attn_bench.log") skips/errors"
grep -E 'SKIP|FAIL|error' "$OUT/attn_bench.log" | head -5

gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
slug=$(echo "$gpu" | tr '[:upper:]' '[:lower:]' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
csv="$OUT/batch-invariant-$slug-$(date +%Y-%m-%d).csv"
{
  echo "# gpu: $gpu"
  echo "# clocks (sm, max sm, mem MHz): $(nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | head -1)"
  echo "# commit: ${COMMIT:-unknown}; date: $(date +%Y-%m-%d); KERNELS=$KERNELS; grid quick (prefill N 1k/8k, decode grid), bf16"
  echo "# impls: ours = the planner's choice, ours_bi = the same planned batch-invariant; two passes in opposite orders;"
  echo "#   ours_bi_t<T> = ours_bi with the invariant decode split minimum T (ATTNSERVE_CUDA_INVARIANT_MIN_TILES; default T $(grep -oE 'kInvariantMinTiles = [0-9]+' backend/cuda/attn_fwd_plan.h | grep -oE '[0-9]+$'))"
  echo "kind,dtype,d,b,hq,hkv,sq,sk,causal,impl,ms,tflops,tbps,peak_mem_bytes"
  cat "$rows"
} >"$csv"

# Ratio table: mean ms of each (shape, impl) over the passes, ours_bi / ours.
echo
printf '%s\n' "${SUMMARY[@]}"
echo
awk -F, -v abl="${ABL[*]}" '
  BEGIN { na = split(abl, ab, " ") }
  { key = $1 "," $3 "," $4 "," $5 "," $6 "," $7 "," $8 "," $9
    if (!(key in seen)) { seen[key] = 1; order[++n] = key }
    sum[key "|" $10] += $11; cnt[key "|" $10]++ }
  END {
    printf "%-8s %4s %4s %4s %4s %6s %6s %-6s %10s %10s %7s", "kind", "d", "b", "hq", "hkv", "sq", "sk", "causal", "ours_ms", "bi_ms", "ratio"
    for (j = 1; j <= na; ++j) printf " %13s", ab[j] "/ours"
    printf "\n"
    worst = 0
    for (i = 1; i <= n; ++i) {
      k = order[i]
      if (cnt[k "|ours"] == 0 || cnt[k "|ours_bi"] == 0) continue
      a = sum[k "|ours"] / cnt[k "|ours"]; b = sum[k "|ours_bi"] / cnt[k "|ours_bi"]
      split(k, f, ",")
      r = b / a
      if (r > worst) { worst = r; wk = k }
      printf "%-8s %4s %4s %4s %4s %6s %6s %-6s %10.4f %10.4f %7.3f", f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], a, b, r
      for (j = 1; j <= na; ++j) {
        c = cnt[k "|" ab[j]]
        if (c > 0) printf " %13.3f", sum[k "|" ab[j]] / c / a; else printf " %13s", "-"
      }
      printf "%s\n", (r > 1.10 ? "  > 1.10" : "")
    }
    printf "worst ratio %.3f at %s (target <= 1.10)\n", worst, wk
  }' "$rows" | tee "$OUT/ratios.txt"
echo "CSV: $csv"
