#!/usr/bin/env bash
# On the GPU machine (device `run`, with .device-carry carried): the
# absorbed-MLA paged decode (backend/cuda/paged_mla.h). Builds the CUDA
# backend's MLA test and mla_decode_bench (server off, as fp8-kv-bench.sh
# does), runs cuda_paged_mla_test (the K-only append and the kernel against
# the float64 reference: 16..128 heads, short causal runs, splits, softcap,
# windows, ALiBi, sinks, empty sequences, batch invariance) and the MLA
# refusal test, compute-sanitizer memcheck and racecheck on a few cases,
# then the bench: 64 x 8k at Hq 16/32/64/128 and 1 x 8k, us, GB/s, % of
# HBM peak, TFLOP/s, each row checked against float64 first.
# NCU=1 adds an Nsight Compute pass (DRAM throughput, stalls) into ncu.txt.
# Prints a summary and the bench's table; CSV and logs under $OUT.
# SAN_TOOLS / SAN_FILTER narrow the sanitizer pass (default: memcheck,
# racecheck and synccheck over four small cases).
# Usage: [KERNELS=dev|all] [BUILD=dir] [BENCH_ARGS="--sk=8192"] [NCU=1] [SAN_TOOLS=...] [SAN_FILTER=...]
#        scripts/device/mla-decode-bench.sh [--no-sanitizer]
# shellcheck disable=SC2086
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/mla-decode-bench-out}
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
if cuda_build . "$B" "$OUT/build.log" cuda_paged_mla_test cuda_mla_refusal_test mla_decode_bench; then
  note build "ok ($(( $(date +%s) - t0 )) s)"
else
  note build "FAILED (see build.log)"; printf '%s\n' "${SUMMARY[@]}"; exit 1
fi
T=$B/tests/cuda/cuda_paged_mla_test
TR=$B/tests/cuda/cuda_mla_refusal_test

run_test() {  # run_test NAME LOG ARGS...
  local name=$1 log=$2; shift 2
  timeout 300 "$@" >"$OUT/$log" 2>&1; local rc=$?
  note "$name" "rc=$rc $(gtest_counts "$OUT/$log")"
  grep -E '^\[  FAILED  \]|Failure|Which is|error|mismatch|max' "$OUT/$log" | head -40
}
run_test "mla paged tests" mla-tests.log $T
run_test "mla refusal tests" mla-refusal.log $TR
if [ "$SAN" = 1 ] && command -v compute-sanitizer >/dev/null; then
  for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
    timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $T \
      --gtest_filter="${SAN_FILTER:-*decode_bf16_h16:*chunk_causal_h16:*empty_sequences:*fully_masked_rows}" \
      >"$OUT/sanitizer-$tool.log" 2>&1
    note "sanitizer $tool" "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1)"
  done
fi

timeout 300 $B/bench/cuda/mla_decode_bench ${BENCH_ARGS:-} --csv="$OUT/mla-decode-bench.csv" >"$OUT/bench.log" 2>&1
note "mla_decode_bench" "rc=$?"
if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  timeout 200 ncu --clock-control none -k "regex:PagedMlaDecodeKernel" --launch-count 4 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats --section SchedulerStats \
    $B/bench/cuda/mla_decode_bench --iters=1 ${BENCH_ARGS:-} >"$OUT/ncu.txt" 2>&1
  note "ncu" "rc=$? (ncu.txt)"
fi

printf '%s\n' "${SUMMARY[@]}"
echo
cat "$OUT/bench.log"
