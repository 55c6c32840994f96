#!/usr/bin/env bash
# On the GPU machine (device `run`, with .device-carry carried): FP8 K/V
# caches. Builds the CUDA backend's paged tests and fp8_kv_bench (server off,
# as scripts/device/gpu-check.sh does), runs cuda_paged_test's FP8 cases
# (CudaPagedFp8Test: the CUDA append and the FP8 kernels against the float64
# reference over the dequantised cache), cuda_paged_fp8_test (the decode
# kernel: splits, row tiles, masks, batch invariance) and the BF16 paged cases
# beside them, compute-sanitizer memcheck and racecheck on the FP8 cases, then
# times one decode step over a BF16 cache and over an FP8 cache of the same
# K/V in one process (default 64 x 8k, Hq 32 / Hkv 8, D 128, pages of 64; the
# target is FP8 <= 0.55x BF16): the SIMT kernel, the decode kernel's ablation
# rows and its plan, each output checked against its float64 reference.
# SHAPES="4096 16384" adds a bench run per context length; NCU=1 adds an
# Nsight Compute pass over the decode kernel and the BF16 one (DRAM
# throughput, warp stalls) into ncu.txt.
# Prints a summary and the bench's table; CSV and logs under $OUT.
# Usage: [KERNELS=dev|all] [BUILD=dir] [BENCH_ARGS="--b=64 --sk=8192"] [SHAPES=...] [NCU=1]
#        scripts/device/fp8-kv-bench.sh [--no-sanitizer]
# shellcheck disable=SC2086
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/fp8-kv-bench-out}
mkdir -p "$OUT"
SAN=1
for a in "$@"; do case $a in --no-sanitizer) SAN=0;; esac; done
declare -a SUMMARY
note() { SUMMARY+=("$(printf '%-30s %s' "$1" "$2")"); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
KERNELS=${KERNELS:-dev}
B=${BUILD:-build-gpu-$KERNELS}
use_carried_libs absl lib
t0=$(date +%s)
if cuda_build . "$B" "$OUT/build.log" cuda_paged_test cuda_paged_fp8_test fp8_kv_bench; then
  note build "ok ($(( $(date +%s) - t0 )) s)"
else
  note build "FAILED (see build.log)"; printf '%s\n' "${SUMMARY[@]}"; exit 1
fi
T=$B/tests/cuda/cuda_paged_test
T8=$B/tests/cuda/cuda_paged_fp8_test

run_test() {  # run_test NAME LOG ARGS...
  local name=$1 log=$2; shift 2
  timeout 300 "$@" >"$OUT/$log" 2>&1; local rc=$?
  note "$name" "rc=$rc $(gtest_counts "$OUT/$log")"
  grep -E '^\[  FAILED  \]|Failure|Which is' "$OUT/$log" | head -10
}
run_test "fp8 paged tests" fp8-tests.log $T --gtest_filter='*Fp8*'
run_test "fp8 decode tests" fp8-decode-tests.log $T8
run_test "bf16 paged tests" paged-tests.log $T --gtest_filter='-*Fp8*'
if [ "$SAN" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 $T --gtest_filter='*Fp8*' \
      >"$OUT/sanitizer-$tool.log" 2>&1
    note "sanitizer $tool (fp8)" "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1)"
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 $T8 \
      --gtest_filter='*DecodeKernel*/0:*DecodeKernel*/2:*DecodeKernel*/3:*DecodeKernel*/4' \
      >"$OUT/sanitizer-decode-$tool.log" 2>&1
    note "sanitizer $tool (decode)" "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-decode-$tool.log" | tail -1)"
  done
fi

# The CSV's '#' lines: GPU, driver, clocks, nvcc, the tree.
{
  echo "# $(nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null | head -1)"
  echo "# $(nvcc --version 2>/dev/null | tail -1)"
  echo "# tree $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo '+uncommitted')"
} >"$OUT/fp8-kv-bench.csv"
: >"$OUT/bench.log"
for sk in "" ${SHAPES:-}; do
  args=${BENCH_ARGS:-}
  [ -n "$sk" ] && args="$args --sk=$sk --simt=0"
  timeout 240 $B/bench/cuda/fp8_kv_bench $args --invariant=1 --csv="$OUT/bench-part.csv" >>"$OUT/bench.log" 2>&1
  note "fp8_kv_bench ${sk:-default}" "rc=$? $(grep -E '^fp8 / bf16' "$OUT/bench.log" | tail -1)"
  grep -v '^#' "$OUT/bench-part.csv" >>"$OUT/fp8-kv-bench.csv" 2>/dev/null
done
rm -f "$OUT/bench-part.csv"
if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  # Each decode kernel's launches (ablation rows and plan; then the BF16 one).
  for k in PagedFp8DecodeKernel PagedAttnDecodeSm90; do
    timeout 150 ncu --clock-control none -k "regex:$k" --launch-count 6 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section Occupancy --section LaunchStats --section SchedulerStats \
      $B/bench/cuda/fp8_kv_bench ${BENCH_ARGS:-} --iters=1 --warmup=1 --check_seqs=0 --simt=0 \
      >>"$OUT/ncu.txt" 2>&1
    note "ncu $k" "rc=$? (ncu.txt)"
  done
fi

printf '%s\n' "${SUMMARY[@]}"
echo
cat "$OUT/bench.log"
