#!/usr/bin/env bash
# On the GPU machine (device `run`, with .device-carry carried): FP8 prefill
# with P V on FP8 wgmma (Plan::fp8_pv) against the path before it (Q K^T
# alone on the codes, V dequantised: attn_bench's fp8_qk). Builds (or takes
# BUILD=<dir>, a configured build tree whose kernels are built) the CUDA
# backend's tests and attn_bench; runs cuda_fp8_pv_test (V^T's layout, the
# transpose pass, rows dominated by a few keys, a broken permutation that
# must fail), cuda_backend_test's FP8 cases (the Fp8/ grid, the Sm90/ FP8
# case, the planner's check; then the Fp8/ grid on the portable kernel), the
# batch-invariant prefill test (FP8 alone against packed) and
# compute-sanitizer memcheck and racecheck on small FP8 cases; then attn_bench's FP8 rows at D 64/128/256, N 1k-16k
# (B x N = 16k tokens, 2048 / D heads), causal and not, new (fp8), old
# (fp8_qk), two variants of new (fp8_mufu, fp8_stage) and each path's pass
# over V alone (fp8_pass, fp8_qk_pass) side by side, and BF16 (ours). D 64 and 256 need the full kernel set (KERNELS=all, the
# default); with KERNELS=dev only D 128 runs on the Hopper kernel.
# IMPLS replaces the bench's list of implementations.
# Prints a summary and, last, one table (TFLOP/s new, old, ratio); CSV and
# logs under $OUT.
# Usage: [BUILD=dir] [KERNELS=all|dev] [NS=1024,...] [DS="64 128 256"] [BF16=1]
#        [IMPLS=fp8,fp8_qk,...] [EXTRA_IMPLS=fp8_dequant,fp8_poly_stage]
#        scripts/device/fp8-pv-bench.sh [--no-sanitizer] [--no-tests] [--no-bench]
# shellcheck disable=SC2086
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/fp8-pv-bench-out}
mkdir -p "$OUT"
SAN=1 TESTS=1 BENCH=1
for a in "$@"; do
  case $a in --no-sanitizer) SAN=0;; --no-tests) TESTS=0;; --no-bench) BENCH=0;; esac
done
KERNELS=${KERNELS:-all}; NS=${NS:-1024,2048,4096,8192,16384}; DS=${DS:-64 128 256}
BF16=${BF16:-1}
declare -a SUMMARY
note() { SUMMARY+=("$(printf '%-34s %s' "$1" "$2")"); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
use_carried_libs absl lib
if [ -n "${BUILD:-}" ]; then
  B=$BUILD
  ninja -C $B -j16 cuda_backend_test cuda_fp8_pv_test cuda_batch_invariance_test attn_bench >"$OUT/build.log" 2>&1 &&
    note build "ok (BUILD=$B)" || { note build "FAILED (BUILD=$B, build.log)"; tail -30 "$OUT/build.log"; printf '%s\n' "${SUMMARY[@]}"; exit 1; }
else
  B=build-gpu-$KERNELS
  t0=$(date +%s)
  if KERNELS=$KERNELS cuda_build . $B "$OUT/build.log" cuda_backend_test cuda_fp8_pv_test \
       cuda_batch_invariance_test attn_bench; then
    note build "ok ($(( $(date +%s) - t0 )) s, KERNELS=$KERNELS)"
  else
    note build "FAILED (see build.log)"
    printf '%s\n' "${SUMMARY[@]}"; exit 1
  fi
fi
grep -E "spill" "$OUT/build.log" | grep -cE "ELi(64|128|256)ELb1EEEvNS0_13Sm90FwdLaunch" >"$OUT/fp8pv-spills.txt"
note "fp8 P V kernel spill warnings" "$(cat "$OUT/fp8pv-spills.txt")"
T=$B/tests/cuda/cuda_backend_test
TP=$B/tests/cuda/cuda_fp8_pv_test

run_test() {  # run_test NAME LOG ARGS...
  local name=$1 log=$2; shift 2
  timeout 400 "$@" >"$OUT/$log" 2>&1; local rc=$?
  note "$name" "rc=$rc $(grep -E '^\[  PASSED|^\[  SKIPPED \] [0-9]+ tests' "$OUT/$log" | tr '\n' ' ')failed=$(grep -c '^\[  FAILED  \]' "$OUT/$log")"
  grep -E '^\[  FAILED  \]|Failure|Which is|allowed' "$OUT/$log" | head -12
}
if [ "$TESTS" = 1 ]; then
  run_test "cuda_fp8_pv_test" fp8-pv-tests.log $TP
  run_test "fp8 tests (plan: fp8_pv)" fp8-tests.log $T \
    --gtest_filter='Fp8/*:Sm90/*fp8*:CudaBackendSm90.PlannerPicks*'
  # The portable kernel on the same FP8 cases: the tolerance's FP8 term must
  # not hide anything there either.
  ATTNSERVE_CUDA_PORTABLE=1 run_test "fp8 tests (portable)" fp8-tests-portable.log $T \
    --gtest_filter='Fp8/*'
  # A call's bytes alone and packed with others (FP8 among the dtypes): V^T's
  # columns move with the packing, the tiles' math must not.
  run_test "batch invariance (prefill)" batch-invariance.log \
    $B/tests/cuda/cuda_batch_invariance_test --gtest_filter='*PrefillAloneEqualsPackedVarlen*'
  if [ "$SAN" = 1 ] && command -v compute-sanitizer >/dev/null; then
    # One small FP8 prefill case on the new path (1 x 1025 causal, D 128),
    # the transpose pass over a varlen batch and a varlen sharp case.
    for tool in memcheck racecheck; do
      timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 $T --gtest_filter='Fp8/*_7' \
        >"$OUT/sanitizer-$tool.log" 2>&1
      note "sanitizer $tool (Fp8/*_7)" "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1)"
      # Sharp cases _3 (D 64, the 192-key tile) and _4 (D 256), whose V^T
      # boxes are 64 bytes, and _6 (varlen, D 128).
      timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 $TP \
        --gtest_filter='CudaFp8Pv.TransposeMatchesTheLayout:*PassesTheFp8Rule/*_3:*PassesTheFp8Rule/*_4:*PassesTheFp8Rule/*_6' \
        >"$OUT/sanitizer-$tool-pv.log" 2>&1
      note "sanitizer $tool (fp8 pv test)" "rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool-pv.log" | tail -1)"
    done
  fi
fi

CSV=$OUT/fp8-pv-bench.csv
if [ "$BENCH" = 1 ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  {
    echo "# gpu: $gpu; driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
    echo "# tree $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo '+uncommitted'); KERNELS=$KERNELS; $(date -u +%Y-%m-%dT%H:%MZ)"
  } >"$CSV"
  impls=${IMPLS:-fp8,fp8_mufu,fp8_stage,fp8_qk,fp8_pass,fp8_qk_pass}${EXTRA_IMPLS:+,$EXTRA_IMPLS}
  [ "$BF16" = 1 ] && impls=$impls,ours
  # The anchor grid (D 64/128/256 x N 512..16k), BF16 shapes as FP8 codes.
  timeout 540 $B/bench/cuda/attn_bench --grid=anchor --dtypes=bf16 --impls=$impls \
    --ds="$(echo $DS | tr ' ' ',')" --ns="$NS" \
    --csv="$OUT/bench-raw.csv" >"$OUT/bench.log" 2>&1
  note "attn_bench (anchor, $impls)" "rc=$? $(grep -c 'FAIL' "$OUT/bench.log") failed/skipped"
  grep -E 'FAIL|SKIP' "$OUT/bench.log" | head -8
  cat "$OUT/bench-raw.csv" >>"$CSV"
fi

printf '%s\n' "${SUMMARY[@]}"
echo
[ "$BENCH" = 1 ] || exit 0
# The table: per shape (D, N, causal) in DS and NS, TFLOP/s of fp8 (new, as
# planned: a quarter of P's exp2 as a polynomial), fp8_qk (old), new / old,
# fp8_mufu (new with every exp2 on MUFU: Plan::fp8_poly_exp2 clear) and new /
# mufu, fp8_stage (new with one more K/V stage: Plan::fp8_extra_stage) and
# stage / new, BF16 beside them; then the
# ablation's split: each path's pass over V alone (ms) and its kernel (the
# call's ms less the pass's), new / old for each.
python3 - "$CSV" "$NS" "$DS" <<'EOF'
import csv, sys
rows = [r for r in csv.DictReader(l for l in open(sys.argv[1]) if not l.startswith("#"))]
ns = {int(x) for x in sys.argv[2].split(",")}
ds = {int(x) for x in sys.argv[3].split()}
t, ms = {}, {}
for r in rows:
    k = (int(r["d"]), int(r["sq"]), int(r["causal"]), r["impl"])
    t[k], ms[k] = float(r["tflops"]), float(r["ms"])
shapes = sorted({k[:3] for k in t if k[0] in ds and k[1] in ns})
print(f"{'D':>4} {'N':>6} {'causal':>6} {'new fp8':>8} {'old fp8_qk':>10} {'new/old':>8} "
      f"{'fp8_mufu':>8} {'new/mufu':>8} {'fp8_stage':>9} {'stage/new':>9} {'bf16':>7}  (TFLOP/s)")
for d, n, c in shapes:
    g = lambda i: t.get((d, n, c, i), float("nan"))
    new, old, mufu, stage = g("fp8"), g("fp8_qk"), g("fp8_mufu"), g("fp8_stage")
    print(f"{d:>4} {n:>6} {c:>6} {new:8.1f} {old:10.1f} {new / old:8.3f} {mufu:8.1f} "
          f"{new / mufu:8.3f} {stage:9.1f} {stage / new:9.3f} {g('ours'):7.1f}")
print()
print(f"{'D':>4} {'N':>6} {'causal':>6} {'pass new':>9} {'pass old':>9} {'kern new':>9} "
      f"{'kern old':>9} {'pass n/o':>8} {'kern n/o':>8}  (ms)")
for d, n, c in shapes:
    g = lambda i: ms.get((d, n, c, i), float("nan"))
    pn, po = g("fp8_pass"), g("fp8_qk_pass")
    kn, ko = g("fp8") - pn, g("fp8_qk") - po
    print(f"{d:>4} {n:>6} {c:>6} {pn:9.4f} {po:9.4f} {kn:9.4f} {ko:9.4f} {pn / po:8.3f} "
          f"{kn / ko:8.3f}")
EOF
