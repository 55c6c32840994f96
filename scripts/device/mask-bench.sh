#!/usr/bin/env bash
# On the GPU machine: bench/cuda/mask_bench (block-sparse masks, biases, ALiBi,
# sinks against the same shapes without them) and its peers on the same GPU
# (bench/gpu/mask_peers.py: FlexAttention compiled with the same block masks,
# SDPA with an attn_mask), merged into $OUT/masks-<gpu>-<date>.csv with a
# table printed last.
# Usage: [GRID=all|sparse|bias|mods] [IMPLS=ours,portable] [DIMS=64,128]
#   [NS=8192,16384,32768 (sparse N)] [KERNELS=all|dev (dev: D 128 only, a faster build)]
#   [VARIANTS="split banded" (mask_bench --sm90_mods, one run each, in turn;
#    the first one's CSV meets the peers)] [PEERS=0 (no peers: ours alone)]
#   [TESTS=1 (first the CUDA mask tests, then after the bench a compute-sanitizer
#    memcheck subset of them; MEMCHECK=0 skips the memcheck)]
#   [ATTNSERVE_COMMIT=sha] scripts/device/mask-bench.sh
# More than one variant: a table of each case's ms / bound per variant side by side last.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. scripts/lib/common.sh
OUT=${OUT:-$PWD/mask-bench-out}
mkdir -p "$OUT"
GRID=${GRID:-all}; IMPLS=${IMPLS:-ours}; DIMS=${DIMS:-64,128}; NS=${NS:-8192,16384,32768}
KERNELS=${KERNELS:-all}; VARIANTS=${VARIANTS:-split}; PEERS=${PEERS:-1}; TESTS=${TESTS:-0}
MEMCHECK=${MEMCHECK:-$TESTS}
B=build-gpu
[ "$KERNELS" = dev ] && B=build-gpu-dev
MASK_TESTS="sm90_block_sparse_test sm90_bias_test cuda_score_mods_test cuda_backend_test"
targets=mask_bench
[ "$TESTS" = 1 ] && targets="$targets $MASK_TESTS"
use_carried_libs absl
t0=$(date +%s)
if [ ! -f $B/build.ninja ]; then
  cmake -S . -B $B -G Ninja -DATTNSERVE_BUILD_SERVER=OFF -DATTNSERVE_CUDA=ON \
    -DCMAKE_PREFIX_PATH="$PWD/.device-carry/absl" -DCMAKE_CUDA_ARCHITECTURES=90-real \
    -DATTNSERVE_CUDA_KERNELS="$KERNELS" >"$OUT/mconfigure.log" 2>&1
fi
# Always: an incremental build after the tree changed.
# shellcheck disable=SC2086  # the target list
ninja -C $B -j16 $targets >"$OUT/mbuild.log" 2>&1 || { tail -20 "$OUT/mbuild.log"; exit 1; }
echo "build ok ($(( $(date +%s) - t0 )) s)"
grep -E "spill" "$OUT/mbuild.log" | sed -E 's/.*function .(_Z[^ ]*). /\1 /' | sort | uniq -c | head -20
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
slug=$(echo "$gpu" | tr '[:upper:]' '[:lower:]' | sed -E 's/nvidia //; s/[^a-z0-9]+/-/g; s/-+$//')
date=$(date +%Y-%m-%d)
T=$B/tests/cuda
SUMMARY=()
note() { SUMMARY+=("$(printf '%-40s %s' "$1" "$2")"); }
if [ "$TESTS" = 1 ]; then
  for t in sm90_block_sparse_test sm90_bias_test cuda_score_mods_test; do
    timeout 240 $T/$t >"$OUT/test-$t.log" 2>&1; rc=$?
    note "$t" "rc=$rc $(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]|^\[  SKIPPED \] [0-9]' "$OUT/test-$t.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$OUT/test-$t.log" | head -10
  done
  # The plain Hopper kernel (its epilogue takes sinks) and varlen staging.
  timeout 240 $T/cuda_backend_test --gtest_filter='Sm90/*varlen*:Sm90/*_b2_*:CudaBackendVarlen.*' \
    >"$OUT/test-cuda_backend_test.log" 2>&1; rc=$?
  note "cuda_backend_test (Sm90, varlen)" "rc=$rc $(grep -E '^\[  PASSED  \]|^\[  FAILED  \] [0-9]' "$OUT/test-cuda_backend_test.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$OUT/test-cuda_backend_test.log" | head -10
fi
{
  echo "# gpu: $gpu"
  echo "# driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1); nvcc: $(nvcc --version | tail -2 | head -1)"
  echo "# torch: $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  echo "# commit: ${ATTNSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; date: $date"
  echo "# mask_bench --grid=$GRID --impls=$IMPLS --sm90_mods=${VARIANTS%% *}; peers: bench/gpu/mask_peers.py; CUDA events, L2 flushed, median of 15"
  echo "# bound = ms / (kept x plain ms) for sparse rows (target <= 1.15), ms / plain ms otherwise"
} >"$OUT/header.txt"
masks=$(mktemp -d)
first=1
TAGS=()
for v in $VARIANTS; do
  TAGS+=("$v")
  mask_args=()
  [ $first = 1 ] && mask_args+=(--mask_dir="$masks")
  $B/bench/cuda/mask_bench --grid="$GRID" --impls="$IMPLS" --dims="$DIMS" --ns="$NS" --sm90_mods="$v" \
    --csv="$OUT/ours-$v.csv" "${mask_args[@]}" 2>"$OUT/mask_bench-$v.log"
  echo "mask_bench --sm90_mods=$v rc=$?"; tail -2 "$OUT/mask_bench-$v.log"
  [ $first = 1 ] && cp "$OUT/ours-$v.csv" "$OUT/ours.csv"
  first=0
done
if [ "$PEERS" = 1 ]; then
  peer_args=()
  [[ $GRID == all || $GRID == sparse ]] && peer_args+=(--mask_dir "$masks")
  [[ $GRID == all || $GRID == bias ]] || peer_args+=(--skip_bias)
  python3 bench/gpu/mask_peers.py "${peer_args[@]}" --csv "$OUT/peers.csv" 2>"$OUT/peers.log"
  echo "mask_peers rc=$?"; tail -3 "$OUT/peers.log"
  python3 bench/gpu/mask_table.py "$OUT/ours.csv" "$OUT/peers.csv" --header "$OUT/header.txt" \
    --out "$OUT/masks-$slug-$date.csv"
fi
rm -rf "$masks"
if [ "$MEMCHECK" = 1 ]; then
  # memcheck on a subset: every 4th case of each mask test, the many-sequence
  # varlen cases (staged offsets) and the Hopper plain-kernel varlen cases.
  for t in sm90_block_sparse_test sm90_bias_test cuda_score_mods_test; do
    cases=$($T/$t --gtest_list_tests | awk '/^[^ ]/ {s=$1} /^  / {print s $1}' |
      awk 'NR % 4 == 1 || /many_sequences/' | paste -sd: -)
    cases="$cases-*AllocationFailure*:*Timing*"
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $T/$t --gtest_filter="$cases" \
      >"$OUT/memcheck-$t.log" 2>&1; rc=$?
    note "memcheck $t" "rc=$rc ok=$(grep -cE '^\[       OK \]' "$OUT/memcheck-$t.log") $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-$t.log" | head -1)"
  done
fi
echo "==== $gpu: $(( $(date +%s) - t0 )) s"
[ ${#SUMMARY[@]} -gt 0 ] && printf '%s\n' "${SUMMARY[@]}"
# One line per case and variant: ms, plain ms, ms / plain (sparse: bound).
for v in "${TAGS[@]}"; do
  awk -F, -v v="$v" 'NR > 1 {printf "%-6s %-7s %-11s n=%-5s s=%-4s %-8s ms=%-8s plain=%-8s x=%s bound=%s\n", \
    v, $1, $3 == "none" ? $2 : $3, $8, $9, $12, $13, $14, $15, $16}' "$OUT/ours-$v.csv"
done
# Several runs: one row per case, each run's ms / plain ms (sparse: bound) side by side.
if [ ${#TAGS[@]} -gt 1 ]; then
  printf '%-7s %-11s %-6s %-5s' grid case n s; printf ' %14s' "${TAGS[@]}"; echo
  files=(); for v in "${TAGS[@]}"; do files+=("$OUT/ours-$v.csv"); done
  awk -F, 'FNR == 1 {f++; next}
    {k = $1 "," ($3 == "none" ? $2 : $3) "," $5 "," $8 "," $9 "," $11;
     if (f == 1) keys[++nk] = k; v[k, f] = sprintf("%.4f/%.3f", $13, $16)}
    END {for (i = 1; i <= nk; i++) {split(keys[i], a, ",");
      printf "%-7s %-11s %-6s %-5s", a[1], a[2], a[4], a[5];
      for (j = 1; j <= f; j++) printf " %14s", v[keys[i], j]; printf "\n"}}' "${files[@]}"
fi
