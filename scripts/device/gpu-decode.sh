#!/usr/bin/env bash
# On the GPU machine (device `run`): the split-KV decode path's checks and
# benchmark in one go (the fused combine, bench/NOTES-cuda.md). Runs the
# split/decode GPU tests (cuda_backend_test's Shapes, Split and
# CudaSplitWorkspace cases; all of cuda_paged_test), compute-sanitizer
# memcheck and racecheck on split-decode cases, then attn_bench
# --grid=decodesweep (B = 1 and 16 x Sk 1k..32k, and chunked prefill): ours
# (fused combine), paged16, an older attn_bench when given (attn_bench_base:
# before/after), a --decode_splits sweep, and SDPA
# FLASH and cuDNN on the same grid. Merges everything into
# $OUT/decode-<gpu>-<date>.csv ('#' lines: GPU, clocks, versions, commit) and
# prints bench/gpu/decode_table.py's table last.
# BIN=DIR: prebuilt sm_90 binaries (cuda_backend_test, cuda_paged_test,
# attn_bench, optionally attn_bench_base) with the shared libraries they load
# in DIR/lib, built elsewhere so the GPU machine's time goes to running them;
# without BIN they are built here as scripts/device/gpu-kv.sh does (carried Abseil).
# Usage: [BIN=dir] [BUILD=dir] [COMMIT=sha] [SWEEP="8 16 32 64 128"] scripts/device/gpu-decode.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/gpu-decode-out}
mkdir -p "$OUT"
declare -a SUMMARY
note() { SUMMARY+=("$(printf '%-26s %s' "$1" "$2")"); }
t0=$(date +%s)
if [ -n "${BIN:-}" ]; then
  export LD_LIBRARY_PATH=$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  TESTS=$BIN BENCH=$BIN
else
  use_carried_libs absl
  B=${BUILD:-build-gpu}
  KERNELS=dev cuda_build . "$B" "$OUT/build.log" cuda_backend_test cuda_paged_test attn_bench || exit 1
  TESTS=$B/tests/cuda BENCH=$B/bench/cuda
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
note setup "$(( $(date +%s) - t0 )) s, ${BIN:+prebuilt }binaries"

run_test() {  # run_test NAME LOG ARGS...
  local name=$1 log=$2; shift 2
  timeout 240 "$@" >"$OUT/$log" 2>&1; local rc=$?
  note "$name" "rc=$rc $(gtest_counts "$OUT/$log")"
  grep -E '^\[  FAILED  \]|Failure|Which is|differs' "$OUT/$log" | head -10
}
run_test cuda_backend_test backend.log $TESTS/cuda_backend_test --gtest_filter='Shapes/*:Split/*:CudaSplitWorkspace.*'
run_test cuda_paged_test paged.log $TESTS/cuda_paged_test
# attn_bench rows with impl renamed (a variant of "ours") and without the header.
bench() {  # bench BINARY NEW_NAME ARGS...
  local bin=$1 name=$2; shift 2
  $bin --grid=decodesweep --dtypes=bf16 --kv_csv=/dev/null --csv="$OUT/b-$name.csv" "$@" 2>>"$OUT/attn_bench.log"
  tail -n +2 "$OUT/b-$name.csv" | sed -E "s/,ours,/,$name,/"
}
rows=$OUT/rows.csv
t1=$(date +%s)
{
  $BENCH/attn_bench --grid=decodesweep --dtypes=bf16 --impls=ours,paged16 --kv_csv=/dev/null --csv="$OUT/b-ours.csv" \
    2>>"$OUT/attn_bench.log" && tail -n +2 "$OUT/b-ours.csv"
  [ -x $BENCH/attn_bench_base ] && bench $BENCH/attn_bench_base ours_base --impls=ours
  for n in ${SWEEP:-8 16 32 64 128}; do bench $BENCH/attn_bench "ours_s$n" --impls=ours --decode_splits="$n"; done
} >"$rows"
note "attn_bench" "$(( $(date +%s) - t1 )) s, $(wc -l <"$rows") rows; $(grep -cE 'SKIP|FAIL|error' "$OUT/attn_bench.log") skips/errors"
grep -E "SKIP|FAIL|error" "$OUT/attn_bench.log" | head -5
t1=$(date +%s)
python3 bench/gpu/sdpa_bench.py --grid=decodesweep --dtypes=bf16 --csv="$OUT/sdpa.csv" --kv_csv="$OUT/kv-sdpa.csv" \
  2>"$OUT/sdpa.log" && tail -n +2 "$OUT/sdpa.csv" >>"$rows"
note "sdpa_bench" "$(( $(date +%s) - t1 )) s, $(grep -c , "$OUT/sdpa.csv" 2>/dev/null) lines"

slug=$(echo "$gpu" | tr '[:upper:]' '[:lower:]' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
csv="$OUT/decode-$slug-$(date +%Y-%m-%d).csv"
{
  echo "# gpu: $gpu"
  echo "# clocks (sm, max sm, mem MHz): $(nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader | head -1)"
  echo "# driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1); nvcc: $(nvcc --version 2>/dev/null | tail -2 | head -1)"
  echo "# torch: $(python3 -c 'import torch; print(torch.__version__, "cudnn", torch.backends.cudnn.version())' 2>/dev/null)"
  echo "# commit: ${COMMIT:-unknown}; date: $(date +%Y-%m-%d); grid decodesweep: decode Hq=32 Hkv=8 D=128 Sq=1 bf16, chunked prefill Sq=128"
  echo "# impls: ours = this commit, ours_base = attn_bench_base (an older tree), ours_s<N> = --decode_splits=N,"
  echo "#   paged16 = paged decode, 16-token pages"
  echo "# timing: CUDA events, L2 flushed (256 MB) before each run, 5 warm-ups, median of 100 (ours) / 100 (sdpa)"
  echo "kind,dtype,d,b,hq,hkv,sq,sk,causal,impl,ms,tflops,tbps,peak_mem_bytes"
  cat "$rows"
} >"$csv"
python3 bench/gpu/decode_table.py "$csv" >"$OUT/decode-table.txt" 2>&1
cat "$OUT/decode-table.txt"
# Sanitizers last (slowest): memcheck on B=16 and the workspace test, racecheck
# (shared memory: the combine's weights and tickets) on two small B=1 cases.
for tool in memcheck racecheck; do
  filter='Split/*b16_q1_k1024*:CudaSplitWorkspace.*'
  [ $tool = racecheck ] && filter='Split/*b1_q1_k5000_h8x8*:Split/*bf16_b1_q1_k1000_*'
  timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $TESTS/cuda_backend_test --gtest_filter="$filter" \
    >"$OUT/$tool.log" 2>&1; rc=$?
  note "$tool (split decode)" "rc=$rc tests_ok=$(grep -c '^\[       OK \]' "$OUT/$tool.log") $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/$tool.log" | head -1)"
done

echo "==== gpu-decode summary ($gpu)"
printf '%s\n' "${SUMMARY[@]}"
cat "$OUT/decode-table.txt"
# Few files come back from the device tool: the logs travel in one tarball.
(cd "$OUT" && tar czf logs.tgz --exclude=logs.tgz --exclude='decode-*' ./* 2>/dev/null &&
  find . -maxdepth 1 -type f ! -name logs.tgz ! -name 'decode-*' -delete)
