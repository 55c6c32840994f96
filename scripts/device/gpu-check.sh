#!/usr/bin/env bash
# On the GPU machine (device `run`, with .device-carry carried): configure and
# build the backend, its CUDA tests and attn_bench (server off), run the tests
# twice (the planner's choice: on sm90 the Hopper kernels; then
# ATTNSERVE_CUDA_PORTABLE=1: the portable kernel only), check the Hopper
# kernels' SASS (HGMMA, UTMALDG, no local memory), compute-sanitizer
# memcheck/racecheck/synccheck on a representative subset (both families),
# and, when .device-carry/bin/attnserve and attnctl exist, an end-to-end
# `attnctl forward --verify` round over loopback against --backend=cuda.
# Logs go to $OUT (or ./gpu-check-out); a summary table is printed last.
# The score-modifier and mask tests (cuda_score_mods_test, cuda_paged_test,
# sm90_block_sparse_test, sm90_bias_test) run too, each under both families, with their own
# sanitizer subset. KERNELS=dev builds the D 128 kernels only (a faster build;
# the other head dims' cases skip).
# Usage: [KERNELS=all|dev] [BUILD=dir] scripts/device/gpu-check.sh [--no-sanitizer] [--no-e2e]
# Shape and flag lists ($args, $shape, $C) are split into words on purpose.
# shellcheck disable=SC2086
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
SAN=1; E2E=1
for a in "$@"; do case $a in --no-sanitizer) SAN=0;; --no-e2e) E2E=0;; esac; done
declare -a SUMMARY
note() { SUMMARY+=("$(printf '%-34s %s' "$1" "$2")"); }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
KERNELS=${KERNELS:-all}
B=build-gpu
[ "$KERNELS" = dev ] && B=build-gpu-dev
B=${BUILD:-$B}
MODS_TESTS="cuda_score_mods_test cuda_paged_test sm90_block_sparse_test sm90_bias_test"
# The test binaries link the carried Abseil shared libraries; a carried
# shared-library server brings its own (scripts/device/pack-device-deps.sh --server).
use_carried_libs absl lib
t0=$(date +%s)
if cuda_build . "$B" "$OUT/build.log" cuda_backend_test $MODS_TESTS attn_bench; then
  note build "ok ($(( $(date +%s) - t0 )) s)"
else
  note build "FAILED (see build.log)"; printf '%s\n' "${SUMMARY[@]}"; exit 1
fi

T=$B/tests/cuda/cuda_backend_test
# Four gtest shards at once: the float64 reference of the long cases is the
# slow part, and the GPU is shared fine. rc is the worst shard's.
run_shards() {
  local log=$1 rc=0 i
  local pids=()
  for i in 0 1 2 3; do
    GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$i timeout 400 $T >"$log.$i" 2>&1 &
    pids+=($!)
  done
  for i in 0 1 2 3; do wait "${pids[$i]}" || rc=$?; done
  cat "$log".[0-3] >"$log"; rm -f "$log".[0-3]
  return $rc
}
for fam in default portable; do
  log="$OUT/tests-$fam.log"
  if [ $fam = portable ]; then ATTNSERVE_CUDA_PORTABLE=1 run_shards "$log"; rc=$?; else run_shards "$log"; rc=$?; fi
  fail=$(grep -c '^\[  FAILED  \]' "$log")
  passed=$(awk '/^\[  PASSED  \] [0-9]+/ {n += $4} END {print n + 0}' "$log")
  skipped=$(awk '/^\[  SKIPPED \] [0-9]+ test/ {n += $4} END {print n + 0}' "$log")
  note "cuda_backend_test ($fam)" "rc=$rc passed=${passed:-0} skipped=${skipped:-0} failed_lines=$fail"
  grep -E '^\[  FAILED  \]|Failure|error' "$log" | head -30
done

# The score-modifier and mask tests, the planner's choice then portable only.
for t in $MODS_TESTS; do
  for fam in default portable; do
    log="$OUT/$t-$fam.log"
    if [ $fam = portable ]; then ATTNSERVE_CUDA_PORTABLE=1 timeout 400 $B/tests/cuda/$t >"$log" 2>&1; rc=$?
    else timeout 400 $B/tests/cuda/$t >"$log" 2>&1; rc=$?; fi
    note "$t ($fam)" "rc=$rc $(gtest_counts "$log")"
    grep -E '^\[  FAILED  \]' "$log" | head -10
  done
done

# The Hopper kernels' machine code: wgmma (HGMMA; QGMMA: FP8) and TMA (UTMALDG) present,
# no local-memory traffic (LDL/STL: spills or a runtime-indexed array).
sm90_objs=$(find $B/backend/cuda/CMakeFiles/attn_cuda_sm90.dir -name '*sm90.cu.o' 2>/dev/null)
if [ -n "$sm90_objs" ]; then
  for o in $sm90_objs; do cuobjdump --dump-sass "$o"; done >"$OUT/sm90.sass" 2>&1
  note "sm90 SASS" "HGMMA=$(grep -c HGMMA "$OUT/sm90.sass") QGMMA=$(grep -c QGMMA "$OUT/sm90.sass") UTMALDG=$(grep -c UTMALDG "$OUT/sm90.sass") LDL/STL=$(grep -cE '\b(LDL|STL)\b' "$OUT/sm90.sass")"
else
  note "sm90 SASS" "no attn_cuda_sm90 objects"
fi

if [ $SAN = 1 ]; then
  FILTER='Standard/*bf16_b1_q97_k97*:Standard/*fp16_varlen*:Standard/*fp32_b2_q17*:Shapes/*bf16_b3_q1_k4097*:Shapes/*fp16_varlen*:Shapes/*b2_q1_k6000*:HeadDims/*fp16_b2_q97_k130_h4x2_d72_*'
  # Hopper cases (portable on other GPUs): each head dim, masked rows, window + softcap.
  FILTER="$FILTER:Sm90/*bf16_b2_q333_k333_h4x2_d64_*:Sm90/*fp16_b1_q257_k700_h2x1_d256_causal*:Sm90/*bf16_b2_q80_k17_*:Sm90/*fp16_b1_q700_k700_h4x2_d64_causal*"
  # The Hopper decode kernel: split + fused combine, speculative causal, window + softcap.
  FILTER="$FILTER:Sm90/*bf16_b3_q1_k4999_h32x8_d64*:Sm90/*fp16_b2_q3_k777_h8x2_d96*:Sm90/*bf16_b5_q1_k2100_h16x16_d128*"
  # Hopper varlen prefill (empty sequences, a tile past a sequence's end: its V rows zeroed), D 192, D < 64.
  FILTER="$FILTER:Sm90/*bf16_varlen_q129*d192*:Sm90/*fp16_varlen_q1000*:Sm90/*bf16_b2_q333_k333_h4x2_d40_*:CudaBackendVarlen.*"
  # The wider key tile of long key ranges (D <= 64), dense and varlen.
  FILTER="$FILTER:Sm90/*bf16_b2_q333_k4133_h4x2_d64_*:Sm90/*bf16_varlen_q300*d64*"
  for tool in memcheck racecheck synccheck; do
    timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 9 $T --gtest_filter="$FILTER" \
      >"$OUT/sanitizer-$tool.log" 2>&1; rc=$?
    n=$(grep -cE '^\[       OK \]' "$OUT/sanitizer-$tool.log")
    note "sanitizer $tool" "rc=$rc tests_ok=$n $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | head -1)"
  done
  # The modifier kernels: every fourth case of each mods test under memcheck,
  # every twelfth under racecheck (the slower tool).
  for t in $MODS_TESTS; do
    for tool in memcheck racecheck; do
      step=4; [ $tool = racecheck ] && step=12
      cases=$($B/tests/cuda/$t --gtest_list_tests | awk '/^[^ ]/ {s=$1} /^  / {print s $1}' |
        awk -v n=$step 'NR % n == 1' | paste -sd: -)
      # Not the deliberate cudaMalloc failure: the sanitizer counts the API error.
      cases="$cases-*AllocationFailure*"
      timeout ${SAN_TIMEOUT:-240} compute-sanitizer --tool $tool --error-exitcode 9 $B/tests/cuda/$t \
        --gtest_filter="$cases" >"$OUT/sanitizer-$tool-$t.log" 2>&1; rc=$?
      n=$(grep -cE '^\[       OK \]' "$OUT/sanitizer-$tool-$t.log")
      note "sanitizer $tool $t" "rc=$rc tests_ok=$n $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool-$t.log" | head -1)"
    done
  done
fi

if [ $E2E = 1 ] && [ -x .device-carry/bin/attnserve ] && [ -x .device-carry/bin/attnctl ]; then
  port=50917
  C=".device-carry/bin/attnctl --target=127.0.0.1:$port"
  # Goes on after a timeout: the e2e rows below then report the failure.
  start_server "$OUT/server.log" 30 $C -- \
    .device-carry/bin/attnserve --backend=cuda --host=127.0.0.1 --port=$port --http_port=0 --metrics_port=0
  spid=$SERVER_PID
  $C info >"$OUT/e2e-info.log" 2>&1
  if grep -qE '^backend: +cuda' "$OUT/e2e-info.log" && grep -qE '^device 0: ' "$OUT/e2e-info.log"; then
    note "e2e info" "PASS ($(grep -E '^device 0: ' "$OUT/e2e-info.log" | sed -E 's/^device 0: +//'))"
  else
    note "e2e info" "FAIL ($(head -3 "$OUT/e2e-info.log" | tr '\n' ' '))"
  fi
  : >"$OUT/e2e.log"
  # The bias ([1, 4, 300, 400] BF16-valued FP32) and mask ([2, 1, 300, 400]) of fp16_bias_mask.
  python3 -c "import numpy as n, sys; r = n.random.default_rng(1)
n.save(sys.argv[1], r.uniform(-2, 2, (1, 4, 300, 400)).astype(n.float32))
n.save(sys.argv[2], r.random((2, 1, 300, 400)) < 0.7)" "$OUT/bias.npy" "$OUT/mask.npy"
  while read -r name args; do
    args=${args//\$OUT/$OUT}
    echo "==== $name: attnctl forward $args --verify" >>"$OUT/e2e.log"
    $C forward $args --verify >"$OUT/e2e-case.log" 2>&1; rc=$?
    cat "$OUT/e2e-case.log" >>"$OUT/e2e.log"
    err=$(grep -oE 'o max abs err [^,]+' "$OUT/e2e-case.log" | head -1 | sed 's/o max abs err //')
    if [ $rc = 0 ] && grep -q '^PASS' "$OUT/e2e-case.log"; then note "e2e $name" "PASS (max abs err $err)"
    else note "e2e $name" "FAIL rc=$rc $(grep -E 'FAIL|rror' "$OUT/e2e-case.log" | head -1)"; fi
  done <<'CASES'
fp16_causal --batch=2 --seqlen_q=300 --heads_q=8 --heads_kv=8 --head_dim=128 --dtype=fp16 --causal --return_lse
fp16_noncausal_gqa --batch=2 --seqlen_q=200 --seqlen_k=333 --heads_q=8 --heads_kv=2 --head_dim=64 --dtype=fp16
bf16_noncausal --batch=2 --seqlen_q=257 --heads_q=4 --heads_kv=4 --head_dim=64 --dtype=bf16
bf16_causal_gqa --batch=1 --seqlen_q=500 --heads_q=8 --heads_kv=2 --head_dim=256 --dtype=bf16 --causal --return_lse
fp32_causal --batch=1 --seqlen_q=200 --heads_q=4 --heads_kv=2 --head_dim=96 --dtype=fp32 --causal --return_lse
fp32_noncausal --batch=2 --seqlen_q=65 --seqlen_k=130 --heads_q=4 --heads_kv=4 --head_dim=128 --dtype=fp32 --return_lse
bf16_gqa_decode --batch=2 --seqlen_q=1 --seqlen_k=5000 --heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --return_lse
fp16_varlen --varlen_q=3,0,17,130 --varlen_k=5,4,17,200 --heads_q=4 --heads_kv=1 --head_dim=256 --dtype=fp16 --causal --return_lse
bf16_varlen_noncausal_gqa --varlen_q=1,40,7 --varlen_k=300,41,2000 --heads_q=8 --heads_kv=2 --head_dim=128 --dtype=bf16 --return_lse
fp32_varlen --varlen_q=3,0,17 --varlen_k=5,4,17 --heads_q=4 --heads_kv=2 --head_dim=64 --dtype=fp32 --causal
bf16_window_softcap --batch=1 --seqlen_q=300 --heads_q=4 --heads_kv=2 --head_dim=72 --dtype=bf16 --window_left=50 --softcap=20 --return_lse
bf16_alibi_sinks_causal --batch=2 --seqlen_q=700 --heads_q=8 --heads_kv=2 --head_dim=128 --dtype=bf16 --alibi --sinks=0.5 --causal --return_lse
fp16_block_random --batch=1 --seqlen_q=1000 --heads_q=4 --heads_kv=4 --head_dim=128 --dtype=fp16 --block_density=0.3 --return_lse
bf16_block_stripes_varlen --varlen_q=300,900 --varlen_k=300,1100 --heads_q=4 --heads_kv=2 --head_dim=128 --dtype=bf16 --block_density=0.4 --block_pattern=stripes --sinks=1
bf16_decode_alibi_sinks --batch=3 --seqlen_q=1 --seqlen_k=5000 --heads_q=32 --heads_kv=8 --head_dim=128 --dtype=bf16 --alibi --sinks=0.25 --return_lse
fp16_bias_mask --batch=2 --seqlen_q=300 --seqlen_k=400 --heads_q=4 --heads_kv=4 --head_dim=128 --dtype=fp16 --bias=$OUT/bias.npy --mask=$OUT/mask.npy --return_lse
CASES
  kill "$spid" 2>/dev/null; wait "$spid" 2>/dev/null
else
  note e2e "skipped (no .device-carry/bin/attnserve+attnctl)"
fi
echo "==== gpu-check summary ($(head -2 "$OUT/gpu.txt" | tail -1))"
printf '%s\n' "${SUMMARY[@]}"
