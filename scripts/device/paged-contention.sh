#!/usr/bin/env bash
# On the GPU machine (device `run`, carrying .device-carry/absl): cuda_paged_test's
# cases that failed on 7cf2e4b when mask-check.sh ran them beside sanitizers (NaN or
# 0 outputs), run repeatedly alone and then beside GPU hogs (compute-sanitizer
# memcheck and racecheck loops of the paged test's long cases, other processes
# time-sliced on the same GPU, as in mask-check.sh). Each phase runs twice: with
# the test's old cache poison (ATTNSERVE_TEST_LEGACY_POISON=1: a cudaMemset on the
# legacy stream that the backend's non-blocking streams do not wait for) and with
# the current one (its own stream, waited for). Then the deterministic test
# CudaPaged.CachePoisonIsInPlaceBeforeTheAppend both ways: it must fail with the old
# poison and pass with the current one.
# Expected: "old" may fail beside the hogs (never alone); "new" never fails.
# $OUT (or ./paged-contention-out) gets build.log, summary.txt (also printed) and
# the logs of the first failing runs.
# Usage: [N=8 runs per phase] [REPEAT=4 passes over the cases per run]
#   [HOGS=2 sanitizer loops] [TORCH_HOGS=2 bf16 matmul loops, when torch imports]
#   [PHASE_S=40 seconds per phase at most] [KERNELS=all|dev]
#   scripts/device/paged-contention.sh
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/paged-contention-out}
mkdir -p "$OUT"
export KERNELS=${KERNELS:-all}
N=${N:-8}
REPEAT=${REPEAT:-4}
HOGS=${HOGS:-2}
TORCH_HOGS=${TORCH_HOGS:-2}
PHASE_S=${PHASE_S:-40}
B=build-gpu  # shared with mask-check.sh, so a warm machine rebuilds nothing
[ "$KERNELS" = dev ] && B=build-gpu-dev
BIN=$B/tests/cuda/cuda_paged_test
use_carried_libs absl
t0=$(date +%s)
SUMMARY=()
note() { SUMMARY+=("$(printf '%-34s %s' "$1" "$2")"); }

if ! cuda_build . "$B" "$OUT/build.log" cuda_paged_test; then
  echo "build FAILED (see build.log)"
  exit 1
fi
note build "ok, KERNELS=$KERNELS ($(($(date +%s) - t0)) s)"
# The five cases that failed at 18:05 (D 64 and 128: KERNELS=dev skips the D 64 one).
FILTER='Paged/*bf16_varlen_q1_1_k3000_77_h8x1_*:Paged/*bf16_varlen_q129_64_*:Paged/*bf16_varlen_q0_1_3_*'
FILTER+=':Paged/*bf16_varlen_q20_3_*:Paged/*bf16_varlen_q1_9_k2000_300_h8x2_d64_*'
GATE='CudaPaged.CachePoisonIsInPlaceBeforeTheAppend'
L=$(mktemp -d)
kept=0

# phase SLUG LEGACY(0|1) LABEL: up to N runs of FILTER, REPEAT passes each (at most PHASE_S
# seconds), counted: failed_cases counts case failures over all passes.
phase() {
  local name=$1 legacy=$2 label=$3 runs=0 bad=0 cases=0 nan=0 zero=0 start i log rc f
  start=$(date +%s)
  for ((i = 0; i < N; i++)); do
    [ $(($(date +%s) - start)) -ge "$PHASE_S" ] && break
    log=$L/$name-$i.log
    ATTNSERVE_TEST_LEGACY_POISON=$legacy timeout 120 "$BIN" --gtest_filter="$FILTER" \
      --gtest_repeat="$REPEAT" >"$log" 2>&1
    rc=$?
    runs=$((runs + 1))
    f=$(grep -cE '^\[  FAILED  \] Paged/.* \([0-9]+ ms\)$' "$log")
    if [ "$rc" -ne 0 ] || [ "$f" -gt 0 ]; then
      bad=$((bad + 1))
      cases=$((cases + f))
      nan=$((nan + $(grep -c 'poison left' "$log")))
      zero=$((zero + $(grep -cE '\) = 0, reference' "$log")))
      if [ "$kept" -lt 3 ]; then
        cp "$log" "$OUT/failed-$name-$i.log"
        kept=$((kept + 1))
      fi
    fi
  done
  note "$label" "runs=$runs failed_runs=$bad failed_cases=$cases (NaN $nan, zero $zero) $(($(date +%s) - start)) s"
}

# gate SLUG LEGACY LABEL: the deterministic test once; its outcome.
gate() {
  local log=$OUT/gate-$1.log rc
  ATTNSERVE_TEST_LEGACY_POISON=$2 timeout 120 "$BIN" --gtest_filter="$GATE" >"$log" 2>&1
  rc=$?
  note "gate test, $3" "rc=$rc $(gtest_counts "$log")"
}

gate old 1 "old poison (must fail)"
gate new 0 "new poison (must pass)"
phase alone-old 1 "alone, old poison"
phase alone-new 0 "alone, new poison"

# GPU hogs until the stop file appears: sanitizer loops of the long paged cases (as
# mask-check.sh ran beside the test) and bf16 matmul loops (long kernels of another
# process: the GPU time-slices between them and the test).
STOP=$L/stop
torch_hog() {
  python3 - "$STOP" <<'PY'
import os, sys, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
while not os.path.exists(sys.argv[1]):
    for _ in range(40):
        a @ a
    torch.cuda.synchronize()
PY
}
HOG_PIDS=()
SAN_PGIDS=()
command -v compute-sanitizer >/dev/null || HOGS=0
for ((h = 0; h < HOGS; h++)); do
  tool=memcheck
  [ $((h % 2)) -eq 1 ] && tool=racecheck
  # Its own process group (setsid), so the stop below ends the sanitizer it is in.
  # shellcheck disable=SC2016  # $0..$2 are the inner shell's
  setsid bash -c 'while [ ! -e "$0" ]; do
      compute-sanitizer --tool "$1" "$2" --gtest_filter="$3" >/dev/null 2>&1
    done' "$STOP" "$tool" "$BIN" \
    'Paged/*bf16_varlen_q1_k8192_h32x8_d128_alibi_sinks_*:Paged/*bf16_varlen_q64_k8192_*' &
  SAN_PGIDS+=($!)
done
if python3 -c 'import torch; assert torch.cuda.is_available()' >/dev/null 2>&1; then
  for ((h = 0; h < TORCH_HOGS; h++)); do
    torch_hog &
    HOG_PIDS+=($!)
  done
else
  TORCH_HOGS=0
fi
# Until the hogs hold the GPU: at least one of their processes on it (60 s at most).
hogs_on_gpu() { [ "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | wc -l)" -ge 1 ]; }
if wait_until 60 0.5 hogs_on_gpu; then
  note hogs "$HOGS sanitizer + $TORCH_HOGS torch, on the GPU after $(($(date +%s) - t0)) s"
else
  note hogs "none seen on the GPU within 60 s (the contended phases ran anyway)"
fi
phase hogs-old 1 "beside hogs, old poison"
phase hogs-new 0 "beside hogs, new poison"
gate hogs-old 1 "old poison, beside hogs"
gate hogs-new 0 "new poison, beside hogs"
touch "$STOP"
for g in "${SAN_PGIDS[@]}"; do kill -TERM -- -"$g" 2>/dev/null; done
for p in "${HOG_PIDS[@]}" "${SAN_PGIDS[@]}"; do wait "$p" 2>/dev/null; done

{
  echo "==== paged-contention on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)," \
    "$(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(($(date +%s) - t0)) s"
  printf '%s\n' "${SUMMARY[@]}"
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
rm -rf "$L"
